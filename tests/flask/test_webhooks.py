"""``@idem.idempotent(key=...)``: views whose requests carry their own key (a webhook's event
id), in-process on both databases. The same scope, replay, 409 and 422 rules as a header key;
a missing or invalid id is a 400 before any claim; a signature check before the claim."""

from __future__ import annotations

import concurrent.futures
import io
import threading
import typing as t

import flask
import pytest
import sqlalchemy as sa

from flask_idem import ConfigurationError, Idempotency, Scope
from flask_idem.store import SQLStore
from tests.flask.test_outcomes import business
from tests.support.answers import problem_name
from tests.support.helpers import Counter

Factory = t.Callable[..., tuple[flask.Flask, Idempotency, Counter]]
__all__ = ["business"]  # the fixture, imported for its side of the module


def _event_id(request: t.Any) -> t.Any:
    return request.get_json()["id"]


Receiver = t.Callable[..., tuple[flask.Flask, Counter]]


@pytest.fixture
def receiver(app_factory: Factory, business: sa.Table) -> Receiver:
    """A webhook receiver whose signature check (a ``before_request`` hook) runs first."""

    def make(**config: t.Any) -> tuple[flask.Flask, Counter]:
        app, idem, counter = app_factory(**config)

        @app.before_request
        def verify_signature() -> None:
            if flask.request.headers.get("X-Signature") != "valid":
                flask.abort(401)

        @app.post("/webhooks")
        @idem.idempotent(key=_event_id, release_before_contact=True)
        def receive() -> t.Any:
            counter.bump()
            idem.connection().execute(business.insert())
            return {"received": flask.request.get_json()["id"]}, 200

        return app, counter

    return make


def _deliver(client: t.Any, body: t.Any, *, signature: str = "valid", **headers: str) -> t.Any:
    return client.post("/webhooks", json=body, headers={"X-Signature": signature, **headers})


def _effects(store: SQLStore, table: sa.Table) -> int:
    with store.engine.connect() as conn:
        return int(conn.execute(sa.select(sa.func.count()).select_from(table)).scalar_one())


def test_every_delivery_of_one_event_is_one_effect(
    receiver: Receiver, store: SQLStore, business: sa.Table
) -> None:
    app, counter = receiver()
    client = app.test_client()
    event = {"id": "evt_1", "type": "charge.refunded"}
    first = _deliver(client, event, **{"Provider-Delivery": "dlv_1"})
    assert first.status_code == 200 and "Idempotent-Replayed" not in first.headers
    for delivery in ("dlv_2", "dlv_3"):
        again = _deliver(client, event, **{"Provider-Delivery": delivery, "Idempotency-Key": "x"})
        assert again.status_code == 200 and again.headers["Idempotent-Replayed"] == "true"
        assert again.data == first.data
    assert counter.calls == 1 and _effects(store, business) == 1
    assert store.get(Scope("alpha", "POST /webhooks", "evt_1")) is not None
    assert store.get(Scope("alpha", "POST /webhooks", "x")) is None, "the header is ignored"
    # Another sender's account is another scope; another body under the same id is refused.
    assert _deliver(client, event, **{"X-Tenant": "beta"}).status_code == 200
    assert problem_name(_deliver(client, {**event, "type": "other"})) == "idempotency-key-reused"
    assert counter.calls == 2


@pytest.mark.parametrize(
    ("body", "problem"),
    [
        ({"type": "charge.refunded"}, "idempotency-key-missing"),
        ({"id": None}, "idempotency-key-missing"),
        (["evt_1"], "idempotency-key-missing"),
        ({"id": "evt 1"}, "idempotency-key-invalid"),
        ({"id": "e" * 256}, "idempotency-key-invalid"),
    ],
)
def test_a_missing_or_invalid_event_id_is_400_before_any_claim(
    receiver: Receiver, store: SQLStore, body: t.Any, problem: str
) -> None:
    app, counter = receiver()
    answer = _deliver(app.test_client(), body)
    assert answer.status_code == 400 and problem_name(answer) == problem
    assert counter.calls == 0 and not store.stuck()
    with store.engine.connect() as conn:
        assert conn.exec_driver_sql("SELECT count(*) FROM idempotency_keys").scalar() == 0


def test_a_body_that_is_no_json_is_400(receiver: Receiver) -> None:
    app, counter = receiver()
    answer = app.test_client().post(
        "/webhooks", data=b"{not json", headers={"X-Signature": "valid"}
    )
    assert problem_name(answer) == "idempotency-key-missing" and counter.calls == 0


def test_a_bad_signature_never_claims(receiver: Receiver, store: SQLStore) -> None:
    app, counter = receiver()
    client = app.test_client()
    assert _deliver(client, {"id": "evt_1"}, signature="forged").status_code == 401
    assert store.get(Scope("alpha", "POST /webhooks", "evt_1")) is None
    assert _deliver(client, {"id": "evt_1"}).status_code == 200
    assert counter.calls == 1


def test_concurrent_deliveries_of_one_event_are_one_effect(
    receiver: Receiver, store: SQLStore, business: sa.Table
) -> None:
    app, counter = receiver(IDEMPOTENCY_WAIT=5)
    barrier = threading.Barrier(6)

    def deliver(_: int) -> int:
        client = app.test_client()
        barrier.wait()
        return int(_deliver(client, {"id": "evt_storm"}).status_code)

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        statuses = list(pool.map(deliver, range(6)))
    assert statuses == [200] * 6, statuses
    assert counter.calls == 1 and _effects(store, business) == 1


@pytest.mark.parametrize("declared", [True, False], ids=["content-length", "streamed"])
def test_a_body_over_the_limit_is_413_before_the_key_function_reads_it(
    app_factory: Factory, store: SQLStore, declared: bool
) -> None:
    """The key function parses the body (JSON): over ``IDEMPOTENCY_MAX_REQUEST_BODY`` it must
    never see it, whether the size is declared or only found by reading."""
    app, idem, _ = app_factory(IDEMPOTENCY_MAX_REQUEST_BODY=1024)
    parsed: list[int] = []

    def event_id(request: t.Any) -> t.Any:
        parsed.append(len(request.get_data()))
        return request.get_json()["id"]

    @app.post("/webhooks")
    @idem.idempotent(key=event_id)
    def receive() -> t.Any:
        return {"received": True}

    body = b'{"id": "evt_big", "padding": "' + b"x" * 4096 + b'"}'
    environ = {} if declared else {"wsgi.input_terminated": True}
    answer = app.test_client().post(
        "/webhooks",
        input_stream=io.BytesIO(body),
        content_length=len(body) if declared else None,
        content_type="application/json",
        environ_overrides=environ,
    )
    assert answer.status_code == 413 and problem_name(answer) == "request-body-too-large"
    assert parsed == [], "the key function never ran on it"
    assert store.get(Scope("alpha", "POST /webhooks", "evt_big")) is None


def test_a_signature_hook_reads_the_body_bounded_as_the_claim_does(
    app_factory: Factory, store: SQLStore
) -> None:
    """``idem.request_body()`` in a ``before_request`` hook: 413 past the limit before the
    hook can hash anything; within it, the bytes the claim and the view then see."""
    app, idem, counter = app_factory(IDEMPOTENCY_MAX_REQUEST_BODY=1024)
    hashed: list[bytes] = []

    @app.before_request
    def verify_signature() -> None:
        hashed.append(idem.request_body())

    @app.post("/webhooks")
    @idem.idempotent(key=_event_id)
    def receive() -> t.Any:
        counter.bump()
        return {"received": flask.request.get_json()["id"]}

    client = app.test_client()
    too_large = client.post("/webhooks", json={"id": "evt_big", "padding": "x" * 2048})
    assert too_large.status_code == 413 and problem_name(too_large) == "request-body-too-large"
    assert hashed == [] and counter.calls == 0
    assert store.get(Scope("alpha", "POST /webhooks", "evt_big")) is None
    assert client.post("/webhooks", json={"id": "evt_small"}).json == {"received": "evt_small"}
    assert hashed == [b'{"id": "evt_small"}'] and counter.calls == 1


def test_a_key_function_needs_a_callable_and_cannot_be_optional(app_factory: Factory) -> None:
    _, idem, _ = app_factory()
    with pytest.raises(ConfigurationError):
        idem.idempotent(key="id")  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError):
        idem.idempotent(key=_event_id, required=False)
