"""``GET /idempotency/requests`` (key in the header) and ``POST`` (key in the body): a tenant
asks what became of its key (both databases)."""

from __future__ import annotations

import hashlib
import json
import typing as t

import flask
import pytest
from werkzeug.exceptions import HTTPException

from flask_idem import ConfigurationError, Idempotency, Scope, StoredResponse
from flask_idem.store import SQLStore
from tests.support.answers import assert_problem
from tests.support.helpers import Counter

Factory = t.Callable[..., tuple[flask.Flask, Idempotency, Counter]]
FP = hashlib.sha256(b"request").digest()


def _pay(client: t.Any, key: str, tenant: str = "alpha") -> t.Any:
    return client.post(
        "/payments", json={"amount": 4200}, headers={"Idempotency-Key": key, "X-Tenant": tenant}
    )


def _ask(client: t.Any, key: str, tenant: str | None = "alpha", **query: str) -> t.Any:
    headers = {"X-Tenant": tenant} if tenant else {}
    headers["Idempotency-Key"] = key
    return client.get("/idempotency/requests", query_string=query, headers=headers)


def test_completed_request_is_described_without_its_body(app_factory: Factory) -> None:
    app, _, _ = app_factory()
    client = app.test_client()
    assert _pay(client, "k-1").status_code == 201
    response = _ask(client, "k-1")
    assert response.status_code == 200, response.data
    assert response.headers["Cache-Control"] == "no-store"
    [answer] = response.get_json()["requests"]
    record = app.extensions["idempotency"].store.get(Scope("alpha", "POST /payments", "k-1"))
    assert answer == {
        "endpoint": "POST /payments",
        "state": "completed",
        "first_seen": record.created_at.isoformat(),
        "completed_at": record.completed_at.isoformat(),
        "status": 201,
        "replays": True,
        "expires_at": record.expires_at.isoformat(),
    }
    assert b"pay_1" not in response.data


def test_key_only_in_a_header_or_a_post_body_never_in_the_url(app_factory: Factory) -> None:
    app, _, _ = app_factory()
    client = app.test_client()
    _pay(client, "k-1")
    by_header = client.get(
        "/idempotency/requests", headers={"Idempotency-Key": '"k-1"', "X-Tenant": "alpha"}
    )
    assert by_header.status_code == 200
    by_body = client.post(
        "/idempotency/requests",
        json={"key": "k-1", "endpoint": "POST /payments"},
        headers={"X-Tenant": "alpha"},
    )
    assert by_body.get_json() == by_header.get_json()
    assert client.get("/idempotency/requests/k-1", headers={"X-Tenant": "alpha"}).status_code == 404
    missing = client.get("/idempotency/requests", headers={"X-Tenant": "alpha"})
    assert_problem(missing, 400, "idempotency-key-missing")
    assert_problem(_ask(client, "bad key"), 400, "idempotency-key-invalid")


@pytest.mark.parametrize(
    "query",
    [
        {"endpoint": "\x00"},
        {"endpoint": "POST /pay\x00ments"},
        {"endpoint": "POST /" + "x" * 600},
        {"endpoint": "POST"},
        {"endpoint": "POST /caf\u00e9"},
    ],
)
def test_invalid_endpoint_filters_are_400_before_any_lookup(
    app_factory: Factory, query: dict[str, str]
) -> None:
    app, _, _ = app_factory()
    client = app.test_client()
    assert_problem(_ask(client, "k-1", **query), 400, "parameter-invalid")


@pytest.mark.parametrize(
    "body",
    [b"[]", b"{", b'{"key": 5}', b'{"key": "k", "other": 1}', b'{"key": "k", "endpoint": 7}'],
)
def test_invalid_post_bodies_are_400(app_factory: Factory, body: bytes) -> None:
    app, _, _ = app_factory()
    client = app.test_client()
    response = client.post(
        "/idempotency/requests",
        data=body,
        content_type="application/json",
        headers={"X-Tenant": "alpha"},
    )
    assert_problem(response, 400, "parameter-invalid")
    too_large = client.post(
        "/idempotency/requests", data=b" " * 5000, headers={"X-Tenant": "alpha"}
    )
    assert_problem(too_large, 413, "request-body-too-large")


def test_keys_with_slashes_are_found(app_factory: Factory) -> None:
    app, _, _ = app_factory()
    client = app.test_client()
    _pay(client, "a/b+c=")
    assert _ask(client, "a/b+c=").status_code == 200


def test_another_tenants_key_answers_exactly_like_an_unknown_key(app_factory: Factory) -> None:
    app, _, _ = app_factory()
    client = app.test_client()
    before = _ask(client, "shared", tenant="beta")
    document = assert_problem(before, 404, "idempotency-key-unknown")
    assert document["status"] == 404
    assert _pay(client, "shared", tenant="alpha").status_code == 201
    after = _ask(client, "shared", tenant="beta")
    assert (after.status_code, after.data) == (before.status_code, before.data)
    assert dict(after.headers) == dict(before.headers)
    assert _ask(client, "shared", tenant="alpha").status_code == 200


def test_in_progress_and_unknown_records_do_not_replay(
    store: SQLStore, app_factory: Factory
) -> None:
    app, _, _ = app_factory()
    client = app.test_client()
    running, unknown = (Scope("alpha", "POST /payments", name) for name in ("running", "unk"))
    store.claim(running, FP, ttl=60, lease=30)
    store.mark_unknown(unknown, store.claim(unknown, FP, ttl=60, lease=30).token)
    for scope, state in ((running, "in_progress"), (unknown, "unknown")):
        [answer] = _ask(client, scope.key).get_json()["requests"]
        assert (answer["state"], answer["replays"], answer["status"]) == (state, False, None)
        assert answer["completed_at"] is None


def test_endpoint_filter_accepts_the_path_a_client_called(app_factory: Factory) -> None:
    app, _, _ = app_factory()
    client = app.test_client()
    _pay(client, "multi")
    client.post("/status/200", headers={"Idempotency-Key": "multi", "X-Tenant": "alpha"})
    both = _ask(client, "multi").get_json()["requests"]
    assert [r["endpoint"] for r in both] == ["POST /payments", "POST /status/<int:code>"]
    for spelled in ("POST /status/200", "post /status/200", "POST /status/<int:code>"):
        [one] = _ask(client, "multi", endpoint=spelled).get_json()["requests"]
        assert one["endpoint"] == "POST /status/<int:code>", spelled
        assert one["status"] == 200
    assert_problem(_ask(client, "multi", endpoint="POST /refunds"), 404, "idempotency-key-unknown")
    assert_problem(_ask(client, "multi", endpoint="GET /payments"), 404, "idempotency-key-unknown")


def test_anonymous_callers_get_401(app_factory: Factory) -> None:
    app, _, _ = app_factory(tenant=None)
    client = app.test_client()
    document = assert_problem(_ask(client, "k", tenant=None), 401, "authentication-required")
    assert document["status"] == 401


def test_bodies_only_when_configured(store: SQLStore, app_factory: Factory) -> None:
    app, _, _ = app_factory(IDEMPOTENCY_INSPECT_BODIES=True)
    client = app.test_client()
    _pay(client, "text")
    [answer] = _ask(client, "text").get_json()["requests"]
    assert json.loads(answer["body"]) == {"id": "pay_1", "amount": 4200}
    assert answer["body_encoding"] == "utf-8"
    assert ["Location", "/payments/pay_1"] in answer["headers"]
    binary = Scope("alpha", "POST /payments", "binary")
    token = store.claim(binary, FP, ttl=60, lease=30).token
    store.complete(binary, token, StoredResponse(200, (), b"\xff\x00"))
    [answer] = _ask(client, "binary").get_json()["requests"]
    assert (answer["body"], answer["body_encoding"]) == ("/wA=", "base64")


def test_prefix_is_configurable_and_can_be_switched_off(app_factory: Factory) -> None:
    app, _, _ = app_factory(IDEMPOTENCY_BLUEPRINT_PREFIX="/ops/idem")
    client = app.test_client()
    _pay(client, "k")
    headers = {"X-Tenant": "alpha", "Idempotency-Key": "k"}
    assert client.get("/ops/idem/requests", headers=headers).status_code == 200
    assert client.get("/idempotency/requests", headers=headers).status_code == 404
    for off in (None, ""):
        app, _, _ = app_factory(IDEMPOTENCY_BLUEPRINT_PREFIX=off)
        assert "flask_idem" not in app.blueprints
        assert app.test_client().get("/idempotency/requests", headers=headers).status_code == 404


@pytest.mark.parametrize("prefix", ["idempotency", 7, True])
def test_bad_prefix_fails_in_init_app(store: SQLStore, prefix: object) -> None:
    app = flask.Flask("bad")
    app.config["IDEMPOTENCY_BLUEPRINT_PREFIX"] = prefix
    with pytest.raises(ConfigurationError, match="IDEMPOTENCY_BLUEPRINT_PREFIX must be a path"):
        Idempotency(app, store=store, tenant=lambda: "alpha")


def test_the_endpoint_is_never_protected_itself(app_factory: Factory) -> None:
    app, _, _ = app_factory(IDEMPOTENCY_PROTECT_ALL=True, IDEMPOTENCY_METHODS=["GET", "POST"])
    client = app.test_client()
    _pay(client, "k")
    response = _ask(client, "k")  # the key header is the question, not a claim
    assert response.status_code == 200
    assert "Idempotency-Key" not in response.headers
    posted = client.post("/idempotency/requests", json={"key": "k"}, headers={"X-Tenant": "alpha"})
    assert posted.status_code == 200
    assert store_count(app) == 1, "no record for the inspection requests themselves"


def store_count(app: flask.Flask) -> int:
    store = app.extensions["idempotency"].store
    with store.engine.connect() as conn:
        return int(conn.exec_driver_sql("SELECT count(*) FROM idempotency_keys").scalar_one())


@pytest.mark.parametrize("handled", [Exception, HTTPException])
def test_its_problems_pass_the_applications_own_error_handlers(
    app_factory: Factory, handled: type[Exception]
) -> None:
    """An ``errorhandler(Exception)`` or ``errorhandler(HTTPException)`` of the application
    never turns the endpoint's 404 or 400 into its own 500 or JSON."""
    app, _idem, _counter = app_factory()
    app.register_error_handler(handled, lambda error: ({"error": "internal"}, 500))
    client = app.test_client()
    assert_problem(_ask(client, "never-used"), 404, "idempotency-key-unknown")
    assert_problem(
        client.get("/idempotency/requests", headers={"X-Tenant": "alpha"}),
        400,
        "idempotency-key-missing",
    )
