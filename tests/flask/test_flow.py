"""The HTTP behaviour of a protected endpoint, through the Flask test client, on both databases."""

from __future__ import annotations

import json
import logging
import threading
import time
import typing as t

import flask
import pytest
import sqlalchemy as sa

from flask_idem import Idempotency, Problem, Scope, State, create_store, signals
from flask_idem.store import SQLStore
from tests.support.answers import assert_problem, post
from tests.support.helpers import Counter, count_statements, record_count, shift

Factory = t.Callable[..., tuple[flask.Flask, Idempotency, Counter]]
PAYMENTS = "POST /payments"


# -- replay ----------------------------------------------------------------------------------


def test_retry_replays_the_stored_response(app_factory: Factory) -> None:
    app, _, counter = app_factory()
    client = app.test_client()
    first = post(client)
    second = post(client)
    assert first.status_code == second.status_code == 201
    assert second.data == first.data
    assert second.headers["Content-Type"] == first.headers["Content-Type"]
    assert second.headers["Location"] == first.headers["Location"]
    assert second.headers["Idempotent-Replayed"] == "true"
    assert "Idempotent-Replayed" not in first.headers
    assert "Set-Cookie" in first.headers and "Set-Cookie" not in second.headers
    assert "X-Request-Id" not in second.headers, "per-request headers are never replayed"
    assert first.headers["Idempotency-Key"] == second.headers["Idempotency-Key"] == "key-1"
    assert counter.calls == 1


@pytest.mark.parametrize(
    "retry",
    [
        {"amount": 4200.0},
        b'{"amount": 4.2e3}',
        b'{ "amount" :42E2 }',
        {"amount": 4200, "client_ts": 1733000000},
    ],
)
def test_equivalent_requests_replay(app_factory: Factory, retry: t.Any) -> None:
    app, _, counter = app_factory()
    client = app.test_client()
    first = post(client, body={"amount": 4200, "client_ts": 1})
    again = post(client, body=retry)
    assert again.status_code == 201 and again.headers["Idempotent-Replayed"] == "true"
    assert again.data == first.data
    assert counter.calls == 1


@pytest.mark.parametrize("retry", [{"amount": 4201}, {"amount": "4200"}, {"amount": 4200, "x": 1}])
def test_same_key_different_request_is_422(app_factory: Factory, retry: t.Any) -> None:
    app, _, counter = app_factory()
    client = app.test_client()
    first = post(client)
    assert_problem(post(client, body=retry), 422, "idempotency-key-reused")
    original = post(client)
    assert original.data == first.data and original.headers["Idempotent-Replayed"] == "true"
    assert counter.calls == 1


def test_query_and_path_are_part_of_the_request(app_factory: Factory) -> None:
    app, _, counter = app_factory()
    client = app.test_client()
    assert client.post("/status/201?a=1&b=2", headers={"Idempotency-Key": "k"}).status_code == 201
    replay = client.post("/status/201?b=2&a=1", headers={"Idempotency-Key": "k"})
    assert replay.headers["Idempotent-Replayed"] == "true"
    other = client.post("/status/201?a=1&b=3", headers={"Idempotency-Key": "k"})
    assert_problem(other, 422, "idempotency-key-reused")
    assert counter.calls == 1


# -- keys ------------------------------------------------------------------------------------


def test_missing_key_is_400_and_stores_nothing(app_factory: Factory, store: SQLStore) -> None:
    app, _, counter = app_factory()
    response = post(app.test_client(), key=None)
    assert_problem(response, 400, "idempotency-key-missing")
    assert counter.calls == 0 and record_count(store) == 0


@pytest.mark.parametrize(
    ("key", "echo"),
    [
        ("", None),
        ("has space", "has space"),
        ("x" * 256, "x" * 256),
        ("ключ", None),  # not printable ASCII: never sent back
        ('a"b', 'a"b'),
        ("a\\b", "a\\b"),
        ('"unterminated', '"unterminated'),
        ('"quoted space"', "quoted space"),
        ("semi;colon", "semi;colon"),
        ("%41", "%41"),
    ],
)
def test_invalid_key_is_400_and_stores_nothing(
    app_factory: Factory, store: SQLStore, key: str, echo: str | None
) -> None:
    app, _, counter = app_factory()
    headers = {"Idempotency-Key": key.encode("utf-8").decode("latin-1")}
    response = app.test_client().post("/payments", json={"amount": 1}, headers=headers)
    assert_problem(response, 400, "idempotency-key-invalid")
    assert response.headers.get("Idempotency-Key") == echo
    assert counter.calls == 0 and record_count(store) == 0


def test_every_allowed_character_and_255_long_keys_work(app_factory: Factory) -> None:
    app, _, counter = app_factory()
    client = app.test_client()
    for key in ("AZaz09-_.:~+/=", "k" * 255, "a"):
        assert post(client, key=key).status_code == 201
    assert counter.calls == 3


def test_quoted_and_aliased_keys_are_the_same_key(app_factory: Factory) -> None:
    app, _, counter = app_factory()
    client = app.test_client()
    post(client, key="abc")
    quoted = post(client, key='"abc"')
    assert quoted.headers["Idempotent-Replayed"] == "true"
    assert quoted.headers["Idempotency-Key"] == "abc"
    alias = client.post("/payments", json={"amount": 4200}, headers={"x-idempotency-key": "abc"})
    assert alias.headers["Idempotent-Replayed"] == "true"
    lower = client.post("/payments", json={"amount": 4200}, headers={"idempotency-key": "abc"})
    assert lower.headers["Idempotent-Replayed"] == "true"
    both = post(client, key="abc", **{"X-Idempotency-Key": '"abc"'})
    assert both.headers["Idempotent-Replayed"] == "true"
    assert counter.calls == 1


def test_two_different_keys_are_400(app_factory: Factory, store: SQLStore) -> None:
    app, _, counter = app_factory()
    response = post(app.test_client(), key="one", **{"X-Idempotency-Key": "two"})
    assert_problem(response, 400, "idempotency-key-invalid")
    assert counter.calls == 0 and record_count(store) == 0


def test_get_ignores_the_header(app_factory: Factory, store: SQLStore) -> None:
    app, _, counter = app_factory()
    client = app.test_client()
    for _ in range(2):
        response = client.get("/payments", headers={"Idempotency-Key": "k"})
        assert response.status_code == 200
        assert "Idempotent-Replayed" not in response.headers
        assert "Idempotency-Key" not in response.headers
    assert counter.calls == 2 and record_count(store) == 0


def test_optional_key_without_key_runs_unprotected(app_factory: Factory, store: SQLStore) -> None:
    app, _, counter = app_factory(IDEMPOTENCY_KEY_REQUIRED=False)
    client = app.test_client()
    assert post(client, key=None).status_code == 201
    assert post(client, key=None).status_code == 201
    assert counter.calls == 2 and record_count(store) == 0
    post(client)
    assert post(client).headers["Idempotent-Replayed"] == "true"


# -- scope -----------------------------------------------------------------------------------


def test_tenants_and_endpoints_are_independent(app_factory: Factory) -> None:
    app, _, counter = app_factory()
    client = app.test_client()
    alpha = post(client, body={"amount": 1})
    beta = post(client, body={"amount": 2}, **{"X-Tenant": "beta"})
    assert beta.status_code == 201 and "Idempotent-Replayed" not in beta.headers
    assert beta.data != alpha.data
    other_endpoint = client.post("/status/200", headers={"Idempotency-Key": "key-1"})
    assert other_endpoint.status_code == 200 and "Idempotent-Replayed" not in other_endpoint.headers
    assert post(client, body={"amount": 2}, **{"X-Tenant": "beta"}).data == beta.data
    assert counter.calls == 3


def test_no_tenant_no_claim(app_factory: Factory, store: SQLStore) -> None:
    app, _, counter = app_factory(tenant=None)
    assert_problem(post(app.test_client()), 500, "tenant-unresolved")
    assert counter.calls == 0 and record_count(store) == 0


# -- in flight, lease, unknown ----------------------------------------------------------------


def _hold(store: SQLStore, key: str = "key-1", lease: float = 30, tenant: str = "alpha") -> str:
    """Claim the key as a concurrent first request would, with the app's fingerprint."""
    app_body = json.dumps({"amount": 4200}).encode()
    from flask_idem.core.fingerprint import fingerprint

    digest = fingerprint("POST", "/payments", {}, [], app_body, "application/json")
    return store.claim(Scope(tenant, PAYMENTS, key), digest, ttl=86400, lease=lease).token


def test_in_flight_duplicate_is_409_with_retry_after(app_factory: Factory, store: SQLStore) -> None:
    app, _, counter = app_factory()
    _hold(store, lease=30)
    response = post(app.test_client())
    assert_problem(response, 409, "request-in-progress")
    assert response.headers["Retry-After"] == "1"
    assert response.headers["Idempotency-Key"] == "key-1"
    assert counter.calls == 0


def test_server_side_wait_replays_once_the_first_finishes(
    app_factory: Factory, store: SQLStore
) -> None:
    app, _, counter = app_factory(IDEMPOTENCY_WAIT=5)
    scope = Scope("alpha", PAYMENTS, "key-1")
    token = _hold(store)
    from flask_idem import StoredResponse

    def finish() -> None:
        time.sleep(0.3)
        store.complete(scope, token, StoredResponse(201, (("Content-Type", "text/plain"),), b"ok"))

    threading.Thread(target=finish).start()
    started = time.monotonic()
    response = post(app.test_client())
    assert response.status_code == 201 and response.data == b"ok"
    assert response.headers["Idempotent-Replayed"] == "true"
    assert 0.2 < time.monotonic() - started < 4
    assert counter.calls == 0


def test_server_side_wait_is_bounded(app_factory: Factory, store: SQLStore) -> None:
    app, _, _ = app_factory(IDEMPOTENCY_WAIT=0.3)
    _hold(store)
    started = time.monotonic()
    assert_problem(post(app.test_client()), 409, "request-in-progress")
    assert 0.25 < time.monotonic() - started < 3


def test_expired_lease_with_fail_policy_is_outcome_pending(
    app_factory: Factory, store: SQLStore
) -> None:
    app, _, counter = app_factory()
    _hold(store, lease=30)
    shift(store, Scope("alpha", PAYMENTS, "key-1"), 31, "lease_expires_at")
    assert_problem(post(app.test_client()), 409, "outcome-pending")
    assert counter.calls == 0


def test_expired_lease_with_reexecute_policy_takes_over_and_fences(
    app_factory: Factory, store: SQLStore
) -> None:
    app, idem, counter = app_factory()

    @app.post("/charges")
    @idem.idempotent(recovery="reexecute")
    def charge() -> t.Any:
        counter.bump()
        return flask.jsonify(ok=True), 201

    from flask_idem.core.fingerprint import fingerprint

    scope = Scope("alpha", "POST /charges", "key-1")
    digest = fingerprint("POST", "/charges", {}, [], b"", None)
    stale = store.claim(scope, digest, ttl=60, lease=5).token
    client = app.test_client()
    assert_problem(
        client.post("/charges", headers={"Idempotency-Key": "key-1"}), 409, "request-in-progress"
    )
    shift(store, scope, 6, "lease_expires_at")
    response = client.post("/charges", headers={"Idempotency-Key": "key-1"})
    assert response.status_code == 201 and counter.calls == 1
    from flask_idem import StoredResponse

    assert not store.complete(scope, stale, StoredResponse(200, (), b"stale")), "fenced"
    replay = client.post("/charges", headers={"Idempotency-Key": "key-1"})
    assert replay.headers["Idempotent-Replayed"] == "true" and replay.data == response.data


def test_slow_request_renews_its_lease(app_factory: Factory, store: SQLStore) -> None:
    app, idem, _ = app_factory(IDEMPOTENCY_LEASE=1)
    seen: list[bool] = []

    @app.post("/slow")
    @idem.idempotent
    def slow() -> t.Any:
        time.sleep(1.6)
        record = store.get(Scope("alpha", "POST /slow", "slow-1"))
        assert record is not None
        seen.append(record.lease_expired)
        return "done", 200

    assert app.test_client().post("/slow", headers={"Idempotency-Key": "slow-1"}).status_code == 200
    assert seen == [False], "a live request's lease must never expire"


def test_lost_lease_rolls_back_the_business_transaction(
    app_factory: Factory, store: SQLStore, ledger: str
) -> None:
    app, idem, _ = app_factory()

    @app.post("/lost")
    @idem.idempotent(recovery="reexecute")
    def lost() -> t.Any:
        # A retry takes the lease over while this request still runs (SQLite has one writer,
        # so the takeover happens before this request opens its business transaction).
        scope = Scope("alpha", "POST /lost", "lost-1")
        shift(store, scope, 60, "lease_expires_at")
        record = store.get(scope)
        assert record is not None and record.claim_token is not None
        assert store.take_over(scope, record.claim_token, lease=30) is not None
        idem.connection().execute(sa.text(f"INSERT INTO {ledger} VALUES ('lost')"))
        return "too late", 201

    response = app.test_client().post("/lost", headers={"Idempotency-Key": "lost-1"})
    assert_problem(response, 409, "request-in-progress")
    assert _ledger(store, ledger) == []


# -- outcomes ----------------------------------------------------------------------------------


@pytest.mark.parametrize("code", [401, 403, 408, 425, 429, 502, 503, 504])
def test_never_stored_statuses_release_the_key(
    app_factory: Factory, store: SQLStore, code: int
) -> None:
    app, _, counter = app_factory()
    client = app.test_client()
    for _ in range(2):
        response = client.post(f"/status/{code}", headers={"Idempotency-Key": "k"})
        assert response.status_code == code and "Idempotent-Replayed" not in response.headers
    assert counter.calls == 2 and record_count(store) == 0


@pytest.mark.parametrize("code", [200, 400, 402, 404, 409, 500])
def test_other_statuses_are_stored(app_factory: Factory, code: int) -> None:
    app, _, counter = app_factory()
    client = app.test_client()
    client.post(f"/status/{code}", headers={"Idempotency-Key": "k"})
    replay = client.post(f"/status/{code}", headers={"Idempotency-Key": "k"})
    assert replay.status_code == code and replay.headers["Idempotent-Replayed"] == "true"
    assert counter.calls == 1


def test_unhandled_exception_releases_the_key(app_factory: Factory, store: SQLStore) -> None:
    app, idem, counter = app_factory()

    @app.post("/crash")
    @idem.idempotent(release_before_contact=True)
    def crash() -> t.Any:
        counter.bump()
        raise RuntimeError("boom")

    client = app.test_client()
    for attempt in (1, 2):
        response = client.post("/crash", headers={"Idempotency-Key": "c"})
        assert_problem(response, 500, "internal-error")
        assert response.headers["Idempotency-Key"] == "c"
        assert counter.calls == attempt
    assert record_count(store) == 0


def test_exception_after_a_side_effect_marks_the_key_unknown(
    app_factory: Factory, store: SQLStore
) -> None:
    app, idem, counter = app_factory()

    @app.post("/charge")
    @idem.idempotent
    def charge() -> t.Any:
        counter.bump()
        idem.side_effect()
        raise RuntimeError("provider answered, then we crashed")

    client = app.test_client()
    assert_problem(client.post("/charge", headers={"Idempotency-Key": "c"}), 500, "internal-error")
    assert_problem(client.post("/charge", headers={"Idempotency-Key": "c"}), 409, "outcome-pending")
    record = store.get(Scope("alpha", "POST /charge", "c"))
    assert record is not None and record.state is State.UNKNOWN
    assert counter.calls == 1


def test_store_unavailable_is_503_and_the_view_never_runs(app_factory: Factory) -> None:
    app = flask.Flask("down")
    app.config["IDEMPOTENCY_DATABASE_URL"] = "postgresql://nobody@127.0.0.1:1/none"
    idem = Idempotency(app, tenant=lambda: "alpha")
    ran: list[bool] = []

    @app.post("/pay")
    @idem.idempotent
    def pay() -> t.Any:
        ran.append(True)
        return "paid", 201

    response = app.test_client().post("/pay", headers={"Idempotency-Key": "k"})
    assert_problem(response, 503, "store-unavailable")
    assert int(response.headers["Retry-After"]) >= 1
    assert ran == []


@pytest.mark.parametrize("kind", ["large", "streamed"])
def test_unstorable_response_keeps_the_key_taken(
    app_factory: Factory, store: SQLStore, kind: str
) -> None:
    app, idem, counter = app_factory(IDEMPOTENCY_MAX_BODY=16)

    @app.post("/export")
    @idem.idempotent
    def export() -> t.Any:
        counter.bump()
        if kind == "large":
            return "x" * 17, 200
        return flask.Response((chunk for chunk in ["a", "b"]), 200)

    client = app.test_client()
    first = client.post("/export", headers={"Idempotency-Key": "e"})
    assert first.status_code == 200
    assert_problem(
        client.post("/export", headers={"Idempotency-Key": "e"}), 409, "response-not-stored"
    )
    record = store.get(Scope("alpha", "POST /export", "e"))
    assert record is not None and record.state is State.UNSTORED
    assert counter.calls == 1


def test_raised_problems_and_aborts_are_stored_and_replayed(app_factory: Factory) -> None:
    app, idem, counter = app_factory()

    @app.post("/declined")
    @idem.idempotent
    def declined() -> t.Any:
        counter.bump()
        raise Problem("Card declined.", problem="card-declined", status=402, title="Declined")

    @app.post("/missing")
    @idem.idempotent
    def missing() -> t.Any:
        counter.bump()
        flask.abort(404)

    client = app.test_client()
    for path, status in (("/declined", 402), ("/missing", 404)):
        first = client.post(path, headers={"Idempotency-Key": "k"})
        replay = client.post(path, headers={"Idempotency-Key": "k"})
        assert first.status_code == replay.status_code == status
        assert replay.headers["Idempotent-Replayed"] == "true" and replay.data == first.data
        assert replay.headers["Content-Type"] == first.headers["Content-Type"]
    assert counter.calls == 2


def test_answers_before_the_claim_echo_the_key(store: SQLStore) -> None:
    app = flask.Flask("deny")

    @app.before_request
    def deny() -> t.Any:
        return Problem("Who are you?", problem="unauthorized", status=401).get_response()

    idem = Idempotency(app, store=store, tenant=lambda: "alpha")
    ran: list[bool] = []

    @app.post("/payments")
    @idem.idempotent
    def pay() -> t.Any:
        ran.append(True)
        return "paid", 201

    response = post(app.test_client(), key='"k-401"')
    assert response.status_code == 401 and response.headers["Idempotency-Key"] == "k-401"
    invalid = post(app.test_client(), key="bad key")
    assert invalid.status_code == 401 and invalid.headers["Idempotency-Key"] == "bad key"
    unprintable = post(app.test_client(), key="ключ".encode().decode("latin-1"))
    assert unprintable.status_code == 401 and "Idempotency-Key" not in unprintable.headers
    assert ran == [] and record_count(store) == 0


# -- business transaction -------------------------------------------------------------------


@pytest.fixture
def ledger(store: SQLStore) -> t.Iterator[str]:
    with store.engine.begin() as conn:
        conn.execute(sa.text("CREATE TABLE IF NOT EXISTS test_ledger (entry varchar(64))"))
        conn.execute(sa.text("DELETE FROM test_ledger"))
    yield "test_ledger"
    with store.engine.begin() as conn:
        conn.execute(sa.text("DROP TABLE test_ledger"))


def _ledger(store: SQLStore, table: str) -> list[str]:
    with store.engine.connect() as conn:
        return [row[0] for row in conn.execute(sa.text(f"SELECT entry FROM {table}"))]


def test_business_writes_commit_with_the_stored_response(
    app_factory: Factory, store: SQLStore, ledger: str
) -> None:
    app, idem, counter = app_factory()

    @app.post("/ledger/<int:code>")
    @idem.idempotent
    def write(code: int) -> t.Any:
        counter.bump()
        idem.connection().execute(sa.text(f"INSERT INTO {ledger} VALUES (:e)"), {"e": f"c{code}"})
        if code == 0:
            raise RuntimeError("crash after the write")
        return "written", code

    client = app.test_client()
    assert client.post("/ledger/201", headers={"Idempotency-Key": "a"}).status_code == 201
    assert (
        client.post("/ledger/201", headers={"Idempotency-Key": "a"}).headers["Idempotent-Replayed"]
        == "true"
    )
    assert client.post("/ledger/503", headers={"Idempotency-Key": "b"}).status_code == 503
    assert client.post("/ledger/0", headers={"Idempotency-Key": "c"}).status_code == 500
    assert _ledger(store, ledger) == ["c201"], "only the stored outcome's writes survive"
    assert counter.calls == 3


def test_connection_outside_protection_commits_at_request_end(
    app_factory: Factory, store: SQLStore, ledger: str
) -> None:
    app, idem, _ = app_factory()

    @app.post("/free")
    def free() -> t.Any:
        idem.connection().execute(sa.text(f"INSERT INTO {ledger} VALUES ('free')"))
        return "ok", 200

    assert app.test_client().post("/free").status_code == 200
    assert _ledger(store, ledger) == ["free"]


# -- downstream keys, signals, logs ------------------------------------------------------------


def test_downstream_key_is_deterministic_per_operation(
    app_factory: Factory, store: SQLStore
) -> None:
    app, idem, _ = app_factory()

    @app.post("/provider")
    @idem.idempotent(required=True)
    def provider() -> t.Any:
        return flask.jsonify(charge=idem.downstream_key("charge"), mail=idem.downstream_key("mail"))

    client = app.test_client()
    first = json.loads(client.post("/provider", headers={"Idempotency-Key": "k1"}).data)
    other = json.loads(client.post("/provider", headers={"Idempotency-Key": "k2"}).data)
    beta = json.loads(
        client.post("/provider", headers={"Idempotency-Key": "k1", "X-Tenant": "beta"}).data
    )
    assert first["charge"] != first["mail"]
    assert first["charge"] != other["charge"] != beta["charge"] != first["charge"]
    from flask_idem import derive_key

    record = store.get(Scope("alpha", "POST /provider", "k1"))
    assert record is not None and first["charge"] == derive_key(record, "charge")


def test_a_key_reused_after_expiry_gets_new_downstream_keys(
    app_factory: Factory, store: SQLStore
) -> None:
    app, idem, _ = app_factory()

    @app.post("/provider")
    @idem.idempotent
    def provider() -> t.Any:
        return flask.jsonify(charge=idem.downstream_key("charge"))

    client = app.test_client()
    first = client.post("/provider", headers={"Idempotency-Key": "k1"}).data
    shift(store, Scope("alpha", "POST /provider", "k1"), 86401)
    again = client.post("/provider", headers={"Idempotency-Key": "k1"})
    assert "Idempotent-Replayed" not in again.headers
    assert again.data != first, "an expired key is a new operation: a new downstream charge"


def test_signals_and_logs_never_carry_the_raw_key(
    app_factory: Factory, store: SQLStore, caplog: pytest.LogCaptureFixture
) -> None:
    app, idem, _ = app_factory()
    secret = "secret-key-value-1234"
    received: list[tuple[str, dict[str, t.Any]]] = []
    names = ["claimed", "completed", "replayed", "conflict", "mismatch", "released", "unknown"]

    def receiver(name: str) -> t.Callable[..., None]:
        def receive(sender: flask.Flask, **kwargs: t.Any) -> None:
            assert sender is app
            received.append((name, kwargs))

        return receive

    receivers = [receiver(name) for name in names]
    for name, function in zip(names, receivers, strict=True):
        getattr(signals, name).connect(function, app)

    @app.post("/unknown")
    @idem.idempotent
    def unknown_view() -> t.Any:
        idem.side_effect()
        raise RuntimeError("boom")

    caplog.set_level(logging.DEBUG)
    client = app.test_client()
    post(client, key=secret)
    post(client, key=secret)
    post(client, key=secret, body={"amount": 1})
    client.post("/status/503", headers={"Idempotency-Key": secret})
    client.post("/unknown", headers={"Idempotency-Key": secret})
    _hold(store, key="held")
    post(client, key="held")
    kinds = [name for name, _ in received]
    assert set(kinds) == set(names)
    for _, kwargs in received:
        assert secret not in repr(kwargs) and len(kwargs["key_hash"]) == 16
    for record in caplog.records:
        assert secret not in record.getMessage() and secret not in repr(record.__dict__)


# -- SQL budget ------------------------------------------------------------------------------


@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
def test_round_trips_on_postgresql(app_factory: Factory, store: SQLStore, ledger: str) -> None:
    app, idem, _ = app_factory()

    @app.post("/tx")
    @idem.idempotent
    def tx() -> t.Any:
        idem.connection().execute(sa.text(f"INSERT INTO {ledger} VALUES ('tx')"))
        return "ok", 201

    client = app.test_client()
    commits: list[object] = []

    def on_commit(connection: object) -> None:
        commits.append(connection)

    sa.event.listen(store.engine, "commit", on_commit)
    try:
        with count_statements(store.engine) as new:
            assert post(client).status_code == 201
        with count_statements(store.engine) as replay:
            assert post(client).headers["Idempotent-Replayed"] == "true"
        with count_statements(store.engine) as mismatch:
            assert post(client, body={"amount": 1}).status_code == 422
        _hold(store, key="busy")
        with count_statements(store.engine) as conflict:
            assert post(client, key="busy").status_code == 409
        del commits[:]
        with count_statements(store.engine) as in_tx:
            assert client.post("/tx", headers={"Idempotency-Key": "tx"}).status_code == 201
    finally:
        sa.event.remove(store.engine, "commit", on_commit)
    assert len(new) == 2, new  # claim + completion
    assert len(replay) == len(mismatch) == len(conflict) == 1
    assert len(in_tx) == 3, in_tx  # claim + business INSERT + completion in its transaction
    assert len(commits) == 1, "the completion adds no commit of its own"


def test_store_outage_during_completion_answers_honestly(
    app_factory: Factory, store: SQLStore
) -> None:
    """A view that ran without a business transaction keeps its key taken if the store dies."""
    app, idem, counter = app_factory()
    broken = create_store("postgresql://nobody@127.0.0.1:1/none")

    @app.post("/late-failure")
    @idem.idempotent
    def late_failure() -> t.Any:
        counter.bump()
        flask.current_app.extensions["idempotency"].store = broken
        return "charged", 201

    client = app.test_client()
    response = client.post("/late-failure", headers={"Idempotency-Key": "late"})
    assert response.status_code == 201 and response.data == b"charged"
    broken.engine.dispose()
    app.extensions["idempotency"].store = store
    assert_problem(
        client.post("/late-failure", headers={"Idempotency-Key": "late"}),
        409,
        "request-in-progress",
    )
    assert counter.calls == 1, "the key stayed taken: the operation never runs twice"


def test_a_request_running_past_its_ttl_still_blocks_retries(
    app_factory: Factory, store: SQLStore
) -> None:
    """TTL 1 s, lease 1 s renewed while the view runs 2.5 s: a retry at 1.6 s must not run."""
    app, idem, counter = app_factory(IDEMPOTENCY_TTL=1, IDEMPOTENCY_LEASE=1)
    started = threading.Event()

    @app.post("/slow-charge")
    @idem.idempotent
    def slow_charge() -> t.Any:
        counter.bump()
        started.set()
        time.sleep(2.5)
        return "charged", 201

    results: list[int] = []
    first = threading.Thread(
        target=lambda: results.append(
            app.test_client().post("/slow-charge", headers={"Idempotency-Key": "k"}).status_code
        )
    )
    first.start()
    assert started.wait(10)
    time.sleep(1.6)
    retry = app.test_client().post("/slow-charge", headers={"Idempotency-Key": "k"})
    first.join(10)
    assert_problem(retry, 409, "request-in-progress")
    assert results == [201] and counter.calls == 1


def test_store_failure_in_any_view_is_a_503_problem(app_factory: Factory) -> None:
    app, idem, _ = app_factory()
    app.extensions["idempotency"].store = create_store("postgresql://nobody@127.0.0.1:1/none")

    @app.get("/report")
    def report() -> t.Any:
        idem.connection().execute(sa.text("SELECT 1"))
        return "never", 200

    response = app.test_client().get("/report")
    assert_problem(response, 503, "store-unavailable")
    app.extensions["idempotency"].store.engine.dispose()


def test_an_unprotected_request_whose_commit_fails_is_a_503_problem(app_factory: Factory) -> None:
    # A view's own query met a dead pooled connection and an application error handler
    # rendered that; the transaction is then invalid, and committing it at the end of the
    # request fails: the answer is a 503 problem (nothing was committed), never a 500.
    app, idem, _ = app_factory()

    @app.get("/report")
    def report() -> t.Any:
        connection = idem.connection()
        connection.execute(sa.text("SELECT 1"))
        connection.invalidate()  # what SQLAlchemy does when the server went away
        return "looked fine", 200

    response = app.test_client().get("/report")
    assert_problem(response, 503, "store-unavailable")
