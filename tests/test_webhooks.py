"""``@idem.idempotent(key=...)``: views whose requests carry their own key (a webhook's event
id), in-process on both databases. The same scope, replay, 409 and 422 rules as a header key;
a missing or invalid id is a 400 before any claim; a signature check before the claim."""

from __future__ import annotations

import concurrent.futures
import threading
import typing as t

import flask
import pytest
import sqlalchemy as sa

from flask_idem import ConfigurationError, Idempotency, Scope
from flask_idem.store import SQLStore

from .conftest import Counter
from .test_outcomes import _problem, business

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
    assert _problem(_deliver(client, {**event, "type": "other"})) == "idempotency-key-reused"
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
    assert answer.status_code == 400 and _problem(answer) == problem
    assert counter.calls == 0 and not store.stuck()
    with store.engine.connect() as conn:
        assert conn.exec_driver_sql("SELECT count(*) FROM idempotency_keys").scalar() == 0


def test_a_body_that_is_no_json_is_400(receiver: Receiver) -> None:
    app, counter = receiver()
    answer = app.test_client().post(
        "/webhooks", data=b"{not json", headers={"X-Signature": "valid"}
    )
    assert _problem(answer) == "idempotency-key-missing" and counter.calls == 0


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


def test_a_key_function_needs_a_callable_and_cannot_be_optional(app_factory: Factory) -> None:
    _, idem, _ = app_factory()
    with pytest.raises(ConfigurationError):
        idem.idempotent(key="id")  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError):
        idem.idempotent(key=_event_id, required=False)
