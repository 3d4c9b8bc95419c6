"""Key scopes on both dialects: account-wide keys (one operation per key across endpoints, a
reuse elsewhere refused with its own 422) and per-principal keys (one namespace per principal
inside the tenant), app-wide and per view; the operator tools and the inspection endpoint find
their records, and never show one principal's record to another."""

from __future__ import annotations

import base64
import concurrent.futures
import json
import logging
import threading
import time
import typing as t
import uuid

import flask
import pytest
import sqlalchemy as sa
from flask import abort

from flask_idem import Idempotency, Scope, State
from flask_idem.core import signals
from flask_idem.core.errors import ConfigurationError
from flask_idem.core.fingerprint import fingerprint
from flask_idem.core.scopes import ACCOUNT, account_fingerprint
from flask_idem.ops.reconcile import Verdict, reconcile
from flask_idem.store import SQLStore
from tests.support.answers import PAYMENT, post, problem_name
from tests.support.helpers import Counter

ORDERS, PAYMENTS, REFUNDS = "POST /orders", "POST /payments", "POST /refunds"
#: The caller's credential -> its principal (the API key's id, never the key).
KEY_IDS = {"sk_alice": "key_alice", "sk_bob": "key_bob", "sk_int": 42}


def _principal() -> t.Any:
    credential = flask.request.headers.get("Authorization")
    if credential == "sk_abort":
        abort(401, description="who are you?")
    if credential == "sk_raise":
        # A principal looked up by the credential: the failed statement's parameters hold it.
        engine = sa.create_engine("sqlite://")
        try:
            with engine.connect() as connection:
                query = sa.text("SELECT id FROM api_keys WHERE secret = :secret")
                connection.execute(query, {"secret": "sk_raise-secret"})
        finally:
            engine.dispose()
    return KEY_IDS.get(credential) if credential is not None else None


def _build(
    store: SQLStore, *, view_options: t.Mapping[str, t.Any] | None = None, **config: t.Any
) -> tuple[flask.Flask, Idempotency, Counter]:
    """Three POST endpoints; ``/refunds`` takes ``view_options`` (``/orders`` and
    ``/payments`` the app's)."""
    app = flask.Flask("idem-scopes")
    app.config.update(TESTING=True, PROPAGATE_EXCEPTIONS=False, **config)
    idem = Idempotency(app, store=store, tenant=lambda: "alpha")
    counter = Counter()

    @app.post("/orders")
    @idem.idempotent
    def create_order() -> t.Any:
        return {"order": counter.bump(), "by": flask.request.headers.get("Authorization")}, 201

    @app.post("/payments")
    @idem.idempotent
    def pay() -> t.Any:
        return {"payment": counter.bump()}, 201

    @app.post("/refunds")
    @idem.idempotent(**(view_options or {}))
    def refund() -> t.Any:
        return {"refund": counter.bump()}, 201

    return app, idem, counter


def _key() -> str:
    return f"scope-{uuid.uuid4().hex}"


# -- account-wide -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "secrets", [None, "k1:" + base64.b64encode(b"s" * 32).decode()], ids=["unkeyed", "keyed"]
)
def test_an_account_wide_key_reused_on_another_endpoint_is_refused(
    store: SQLStore, secrets: str | None
) -> None:
    """Also with IDEMPOTENCY_KEY_SECRETS, whose keyed fingerprint keeps the endpoint's tag
    apart from the rest: the reuse elsewhere is told from a reuse with another body."""
    app, _, counter = _build(store, IDEMPOTENCY_SCOPE="account", IDEMPOTENCY_KEY_SECRETS=secrets)
    key = _key()
    first = post(app, key, path="/orders")
    assert first.status_code == 201 and counter.calls == 1
    again = post(app, key, path="/orders")
    assert again.headers["Idempotent-Replayed"] == "true" and again.json == first.json
    for elsewhere in (
        post(app, key, path="/payments"),
        post(app, key, {"amount": 2}, path="/payments"),
    ):
        assert elsewhere.status_code == 422
        assert elsewhere.content_type == "application/problem+json"
        assert problem_name(elsewhere) == "idempotency-key-used-elsewhere"
        assert "order" not in elsewhere.get_data(as_text=True), "never the first one's answer"
    assert counter.calls == 1, "nothing ran elsewhere"
    other_body = post(app, key, {"amount": 2}, path="/orders")
    assert other_body.status_code == 422 and problem_name(other_body) == "idempotency-key-reused"
    record = store.get(Scope("alpha", ACCOUNT, key))
    assert record is not None and record.state is State.COMPLETED
    assert store.get(Scope("alpha", ORDERS, key)) is None, "no endpoint in the namespace"


def test_an_account_wide_key_in_progress_elsewhere_is_refused_not_409(store: SQLStore) -> None:
    """A reuse elsewhere is a client bug whatever the first request's state: waiting for it
    (409 and Retry-After) would only get the same refusal later."""
    app, _, counter = _build(store, IDEMPOTENCY_SCOPE="account")
    key = _key()
    orders = account_fingerprint(ORDERS, b"\0" * 32)
    assert store.claim(Scope("alpha", ACCOUNT, key), orders, ttl=60, lease=30).claimed
    response = post(app, key, path="/payments")
    assert (
        response.status_code == 422 and problem_name(response) == "idempotency-key-used-elsewhere"
    )
    assert counter.calls == 0


def test_the_default_scope_is_the_endpoint_byte_for_byte(store: SQLStore) -> None:
    """Without a scope option, records are spelled as they always were: a key per endpoint,
    the plain canonical fingerprint."""
    app, _, counter = _build(store)
    key = _key()
    assert post(app, key, path="/orders").status_code == 201
    assert post(app, key, path="/payments").status_code == 201
    assert counter.calls == 2
    record = store.get(Scope("alpha", ORDERS, key))
    assert record is not None
    body = json.dumps(PAYMENT).encode()
    assert record.fingerprint == fingerprint("POST", "/orders", {}, (), body, "application/json")
    assert store.get(Scope("alpha", ACCOUNT, key)) is None


def test_a_view_option_overrides_the_app_wide_scope(store: SQLStore) -> None:
    """An account-wide view among endpoint-scoped ones, and the other way round: the two
    scopes never share a namespace."""
    account_view, _, counter = _build(store, view_options={"scope": "account"})
    key = _key()
    assert post(account_view, key, path="/refunds").status_code == 201
    assert post(account_view, key, path="/orders").status_code == 201, "its own namespace"
    assert store.get(Scope("alpha", ACCOUNT, key)) is not None
    endpoint_view, _, _ = _build(
        store, IDEMPOTENCY_SCOPE="account", view_options={"scope": "endpoint"}
    )
    other = _key()
    assert post(endpoint_view, other, path="/orders").status_code == 201
    refused = post(endpoint_view, other, path="/payments")
    assert refused.status_code == 422 and problem_name(refused) == "idempotency-key-used-elsewhere"
    assert post(endpoint_view, other, path="/refunds").status_code == 201
    assert store.get(Scope("alpha", REFUNDS, other)) is not None
    assert counter.calls == 2


def test_a_blueprint_can_be_account_wide(store: SQLStore) -> None:
    app = flask.Flask("idem-scope-blueprint")
    app.config.update(PROPAGATE_EXCEPTIONS=False)
    idem = Idempotency(app, store=store, tenant=lambda: "alpha")
    blueprint = flask.Blueprint("billing", __name__)
    counter = Counter()

    @blueprint.post("/invoices")
    def invoice() -> t.Any:
        return {"invoice": counter.bump()}, 201

    @blueprint.post("/credits")
    def credit() -> t.Any:
        return {"credit": counter.bump()}, 201

    idem.protect_blueprint(blueprint, scope="account")
    app.register_blueprint(blueprint)
    key = _key()
    assert post(app, key, path="/invoices").status_code == 201
    refused = post(app, key, path="/credits")
    assert refused.status_code == 422 and problem_name(refused) == "idempotency-key-used-elsewhere"
    assert counter.calls == 1


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"IDEMPOTENCY_SCOPE": "global"}, "IDEMPOTENCY_SCOPE must be one of endpoint, account"),
        ({"IDEMPOTENCY_PRINCIPAL": "g.user_id"}, "IDEMPOTENCY_PRINCIPAL must be a callable"),
    ],
)
def test_bad_scope_config_fails_in_init_app(
    store: SQLStore, config: dict[str, t.Any], message: str
) -> None:
    app = flask.Flask("bad-scope")
    app.config.update(config)
    with pytest.raises(ConfigurationError, match=message):
        Idempotency(app, store=store)


@pytest.mark.parametrize(
    ("options", "message"),
    [({"scope": "global"}, "scope must be one of"), ({"principal": "u"}, "principal must be")],
)
def test_bad_scope_options_fail_when_declared(
    store: SQLStore, options: dict[str, t.Any], message: str
) -> None:
    idem = Idempotency(store=store)
    with pytest.raises(ConfigurationError, match=message):
        idem.idempotent(**options)


# -- per principal ----------------------------------------------------------------------------


def test_principals_of_one_tenant_have_keys_of_their_own(store: SQLStore) -> None:
    app, _, counter = _build(store, IDEMPOTENCY_PRINCIPAL=_principal)
    key = _key()
    alice = post(app, key, path="/orders", authorization="sk_alice")
    bob = post(app, key, path="/orders", authorization="sk_bob")
    assert alice.status_code == bob.status_code == 201 and counter.calls == 2
    assert alice.json == {"order": 1, "by": "sk_alice"} and bob.json == {"order": 2, "by": "sk_bob"}
    for credential, first in (("sk_alice", alice), ("sk_bob", bob)):
        retry = post(app, key, path="/orders", authorization=credential)
        assert retry.headers["Idempotent-Replayed"] == "true" and retry.json == first.json
    assert counter.calls == 2
    record = store.get(Scope("alpha", "principal=key_alice POST /orders", key))
    assert record is not None and record.scope.tenant == "alpha", "the tenant stays the tenant"
    assert store.get(Scope("alpha", ORDERS, key)) is None
    integer = post(app, key, path="/orders", authorization="sk_int")
    assert integer.status_code == 201
    assert store.get(Scope("alpha", "principal=42 POST /orders", key)) is not None


def test_principal_and_account_wide_scopes_compose(store: SQLStore) -> None:
    app, _, counter = _build(store, IDEMPOTENCY_SCOPE="account", IDEMPOTENCY_PRINCIPAL=_principal)
    key = _key()
    assert post(app, key, path="/orders", authorization="sk_alice").status_code == 201
    elsewhere = post(app, key, path="/payments", authorization="sk_alice")
    assert (
        elsewhere.status_code == 422 and problem_name(elsewhere) == "idempotency-key-used-elsewhere"
    )
    assert post(app, key, path="/payments", authorization="sk_bob").status_code == 201, (
        "Bob's own key"
    )
    assert counter.calls == 2
    assert store.get(Scope("alpha", "principal=key_alice *", key)) is not None
    assert store.get(Scope("alpha", "principal=key_bob *", key)) is not None


def test_a_view_principal_overrides_the_app_wide_one(store: SQLStore) -> None:
    app, _, _ = _build(store, view_options={"principal": lambda: "view-principal"})
    key = _key()
    assert post(app, key, path="/refunds").status_code == 201
    assert store.get(Scope("alpha", "principal=view-principal POST /refunds", key)) is not None
    assert post(app, key, path="/orders").status_code == 201
    assert store.get(Scope("alpha", ORDERS, key)) is not None, "no principal app-wide"


@pytest.mark.parametrize(
    "credential",
    [
        None,
        "sk_raise",
        "sk_space",
        "sk_long",
        "sk_huge",
        "sk_empty",
        "sk_object",
        "sk_true",
        "sk_nul",
    ],
)
def test_an_unusable_principal_is_refused_before_any_claim(
    store: SQLStore,
    credential: str | None,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """None, a callable that raises, a value that is no string or integer, or one that
    cannot name a namespace (too long to spell, even as an integer): 500
    principal-unresolved, nothing claimed, nothing run, and the statement parameters of a
    database error it raised (the credential it looked up by) never logged."""
    for name, value in {
        "sk_space": "key alice",
        "sk_long": "k" * 129,
        # str() of an int past the interpreter's digit limit raises ValueError (3.11+).
        "sk_huge": 10**5000,
        "sk_empty": "",
        "sk_object": object(),
        "sk_true": True,
        "sk_nul": "key\x00alice",
    }.items():
        monkeypatch.setitem(KEY_IDS, name, value)
    app, _, counter = _build(store, IDEMPOTENCY_PRINCIPAL=_principal)
    key = _key()
    with caplog.at_level(logging.ERROR, logger="flask_idem"):
        response = post(app, key, path="/orders", authorization=credential)
    assert response.status_code == 500, response.get_data(as_text=True)
    assert problem_name(response) == "principal-unresolved"
    assert response.content_type == "application/problem+json"
    assert counter.calls == 0
    assert store.find("alpha", key) == []
    logged = "\n".join(
        record.getMessage() + str(record.exc_info and record.exc_info[1])
        for record in caplog.records
    )
    assert "principal" in logged
    assert "sk_raise-secret" not in logged


def test_a_principal_callable_that_aborts_is_answered_as_it_aborts(store: SQLStore) -> None:
    app, _, counter = _build(store, IDEMPOTENCY_PRINCIPAL=_principal)
    response = post(app, _key(), path="/orders", authorization="sk_abort")
    assert response.status_code == 401 and counter.calls == 0


def test_a_principal_too_long_for_the_endpoint_is_refused(store: SQLStore) -> None:
    """The principal and the endpoint share the record's 255 characters: a pair that does
    not fit is refused, never truncated into another principal's namespace."""
    app, idem, counter = _build(store, IDEMPOTENCY_PRINCIPAL=lambda: "p" * 128)
    app.add_url_rule("/" + "x" * 120, "long", idem.idempotent(counter.bump), methods=["POST"])
    response = post(app, _key(), path="/" + "x" * 120)
    assert response.status_code == 500 and problem_name(response) == "principal-unresolved"
    assert post(app, _key(), path="/orders").status_code == 201
    assert counter.calls == 1


def test_events_name_the_endpoint_never_the_principal(store: SQLStore) -> None:
    """Events (and the metrics and spans fed by them) carry the endpoint the request ran on,
    also for an account-wide key, and never a principal: one series per endpoint, not per
    user."""
    app, _, _ = _build(store, IDEMPOTENCY_SCOPE="account", IDEMPOTENCY_PRINCIPAL=_principal)
    seen: list[tuple[str, str]] = []

    def collect(sender: flask.Flask, **event: t.Any) -> None:
        seen.append((event["event"], event["endpoint"]))

    key = _key()
    with signals.claimed.connected_to(collect), signals.mismatch.connected_to(collect):
        assert post(app, key, path="/orders", authorization="sk_alice").status_code == 201
        assert post(app, key, path="/payments", authorization="sk_alice").status_code == 422
    assert seen == [("claimed", ORDERS), ("mismatch", PAYMENTS)]


# -- operators --------------------------------------------------------------------------------


def _inspect(app: flask.Flask, key: str, credential: str, endpoint: str | None = None) -> t.Any:
    query = {} if endpoint is None else {"endpoint": endpoint}
    return app.test_client().get(
        "/idempotency/requests",
        query_string=query,
        headers={"Idempotency-Key": key, "Authorization": credential},
    )


def test_the_inspection_endpoint_shows_a_principal_only_its_own_records(
    store: SQLStore,
) -> None:
    app, _, _ = _build(store, IDEMPOTENCY_PRINCIPAL=_principal)
    key = _key()
    assert post(app, key, path="/orders", authorization="sk_alice").status_code == 201
    mine = _inspect(app, key, "sk_alice")
    assert mine.status_code == 200
    assert [r["endpoint"] for r in mine.json["requests"]] == ["principal=key_alice POST /orders"]
    theirs = _inspect(app, key, "sk_bob")
    assert theirs.status_code == 404 and problem_name(theirs) == "idempotency-key-unknown"
    assert _inspect(app, key, "sk_raise").status_code == 404, "no principal: none of theirs"
    filtered = _inspect(app, key, "sk_alice", "POST /orders")
    assert len(filtered.json["requests"]) == 1
    assert _inspect(app, key, "sk_alice", "POST /payments").status_code == 404


def test_the_inspection_endpoint_finds_account_wide_records_by_endpoint(
    store: SQLStore,
) -> None:
    app, _, _ = _build(store, IDEMPOTENCY_SCOPE="account")
    key = _key()
    assert post(app, key, path="/orders").status_code == 201
    found = _inspect(app, key, "sk_alice", "POST /orders")
    assert found.status_code == 200
    assert [r["endpoint"] for r in found.json["requests"]] == [ACCOUNT]
    assert _inspect(app, key, "sk_alice", "POST /payments").status_code == 404
    assert len(_inspect(app, key, "sk_alice").json["requests"]) == 1


def _idem(app: flask.Flask, *args: str, input: str | None = None) -> t.Any:
    return app.test_cli_runner().invoke(args=["idem", *args], input=input)


def test_flask_idem_show_and_release_name_the_scope_as_records_spell_it(
    store: SQLStore,
) -> None:
    app, _, _ = _build(store, IDEMPOTENCY_SCOPE="account", IDEMPOTENCY_PRINCIPAL=_principal)
    key = _key()
    assert post(app, key, path="/orders", authorization="sk_alice").status_code == 201
    assert post(app, key, path="/orders", authorization="sk_bob").status_code == 201
    every = _idem(app, "show", "--tenant", "alpha", "--json", input=key)
    assert every.exit_code == 0, every.output
    assert sorted(r["endpoint"] for r in json.loads(every.stdout)) == [
        "principal=key_alice *",
        "principal=key_bob *",
    ]
    column = "principal=key_bob *"
    one = _idem(app, "show", "--tenant", "alpha", "--endpoint", column, "--json", input=key)
    assert [r["endpoint"] for r in json.loads(one.stdout)] == [column]
    stuck = Scope("alpha", column, _key())
    digest = account_fingerprint(ORDERS, b"\2" * 32)
    store.mark_unknown(stuck, store.claim(stuck, digest, ttl=600, lease=30).token)
    released = _idem(
        app, "release", "--tenant", "alpha", "--endpoint", column, "--yes", input=stuck.key
    )
    assert released.exit_code == 0, released.output
    record = store.get(stuck)
    assert record is not None and record.state is State.REOPENED


def test_reconcile_hands_an_account_wide_record_to_its_endpoints_reconciler(
    store: SQLStore,
) -> None:
    app, idem, _ = _build(store, IDEMPOTENCY_SCOPE="account", IDEMPOTENCY_PRINCIPAL=_principal)
    asked: list[str] = []

    @idem.reconciler("pay")
    def payment_outcome(record: t.Any) -> Verdict:
        asked.append(record.scope.key)
        return Verdict.not_happened()

    key, other = _key(), _key()
    scope = Scope("alpha", "principal=key_alice *", key)
    digest = account_fingerprint(PAYMENTS, b"\1" * 32)
    store.mark_unknown(scope, store.claim(scope, digest, ttl=600, lease=30).token)
    elsewhere = Scope("alpha", ACCOUNT, other)
    orders = account_fingerprint(ORDERS, b"\1" * 32)
    store.mark_unknown(elsewhere, store.claim(elsewhere, orders, ttl=600, lease=30).token)
    with app.app_context():
        settled = {
            s.record.scope: s.action.value
            for s in reconcile([store.get(scope), store.get(elsewhere)])
        }
    assert asked == [key]
    assert settled == {scope: "reopened", elsewhere: "unknown"}


# -- two endpoints racing with one account-wide key -------------------------------------------

ROUNDS = 10
ENDPOINTS = ("/orders", "/payments", "/refunds")


@pytest.mark.postgresql
@pytest.mark.parametrize("atomic", [False, True], ids=["leased", "atomic"])
def test_endpoints_racing_with_one_account_wide_key_run_one_of_them(
    pg_store: SQLStore, atomic: bool
) -> None:
    """Three endpoints, one key, requests released together on real threads against
    PostgreSQL, each view holding its claim a while: exactly one view runs per key. The others
    are refused, 422 idempotency-key-used-elsewhere (or, for atomic views, 409 while the
    winner's transaction holds the namespace's lock), never run, never the winner's answer."""
    app = flask.Flask("idem-scope-race")
    app.config.update(PROPAGATE_EXCEPTIONS=False, IDEMPOTENCY_SCOPE="account")
    idem = Idempotency(app, store=pg_store, tenant=lambda: "alpha")
    runs: list[tuple[str, str]] = []

    def view() -> t.Any:
        runs.append((flask.request.path, flask.request.headers["Idempotency-Key"]))
        time.sleep(0.05)  # the claim is held while the others arrive
        return {"ran": flask.request.path}, 201

    for path in ENDPOINTS:
        app.add_url_rule(path, path, idem.idempotent(atomic=atomic)(view), methods=["POST"])
    start = threading.Barrier(len(ENDPOINTS))

    def send(path: str, key: str) -> tuple[int, str]:
        client = app.test_client()
        start.wait()
        response = post(client, key, path=path)
        return response.status_code, problem_name(response) if response.status_code >= 400 else ""

    allowed = {(422, "idempotency-key-used-elsewhere")}
    if atomic:
        allowed.add((409, "request-in-progress"))
    with concurrent.futures.ThreadPoolExecutor(len(ENDPOINTS)) as pool:
        for _ in range(ROUNDS):
            key = _key()
            answers = list(pool.map(send, ENDPOINTS, [key] * len(ENDPOINTS)))
            assert len([run for run in runs if run[1] == key]) == 1, answers
            assert sorted(answers)[0] == (201, ""), answers
            assert set(sorted(answers)[1:]) <= allowed, answers
            [(winner, _)] = [run for run in runs if run[1] == key]
            for path in ENDPOINTS:
                again = post(app, key, path=path)
                if path == winner:
                    assert again.headers["Idempotent-Replayed"] == "true"
                else:
                    assert problem_name(again) == "idempotency-key-used-elsewhere"
    assert len(runs) == ROUNDS
