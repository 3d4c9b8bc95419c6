"""With ``IDEMPOTENCY_KEY_SECRETS`` the operator's tools and the inspection endpoint find a
record by the raw key (they digest it as the claim did) or by the key hash of the logs, and a
rotation keeps every live record's retries answered, through the HTTP flow."""

from __future__ import annotations

import base64
import typing as t

import flask
import pytest

from flask_idem import Idempotency, create_store
from flask_idem.core.idempotency_keys import key_hash
from flask_idem.store import SQLStore

OLD = base64.b64encode(b"o" * 32).decode()
NEW = base64.b64encode(b"n" * 32).decode()
Factory = t.Callable[..., tuple[flask.Flask, Idempotency, t.Any]]


def _pay(app: flask.Flask, key: str, amount: int = 4200) -> flask.Response:
    return app.test_client().post(
        "/payments", json={"amount": amount}, headers={"Idempotency-Key": key}
    )


def test_lookups_digest_the_raw_key_they_are_given(app_factory: Factory, store: SQLStore) -> None:
    app, _, _ = app_factory(IDEMPOTENCY_KEY_SECRETS=f"k1:{NEW}")
    assert _pay(app, "order-42").status_code == 201
    [record] = store.find("alpha", "order-42")
    assert record.scope.key.startswith("$k1$"), "the table holds the keyed digest"
    runner = app.test_cli_runner()
    shown = runner.invoke(args=["idem", "show", "--tenant", "alpha"], input="order-42\n")
    assert shown.exit_code == 0, shown.output
    hashed = key_hash(record.scope)
    assert f"{hashed}" in shown.stdout
    by_hash = runner.invoke(args=["idem", "show", hashed, "--tenant", "alpha"])
    assert by_hash.exit_code == 0 and "completed" in by_hash.stdout, by_hash.output
    assert "order-42" not in shown.stdout + by_hash.stdout
    asked = app.test_client().get(
        "/idempotency/requests", headers={"Idempotency-Key": "order-42", "X-Tenant": "alpha"}
    )
    assert asked.status_code == 200 and len(asked.get_json()["requests"]) == 1
    other = app.test_client().get(
        "/idempotency/requests", headers={"Idempotency-Key": "order-43", "X-Tenant": "alpha"}
    )
    assert other.status_code == 404


@pytest.fixture
def second_store(store: SQLStore) -> t.Iterator[SQLStore]:
    """Another server's store on the same database."""
    other = create_store(store.engine.url.render_as_string(hide_password=False))
    yield other
    other.engine.dispose()


def _server(store: SQLStore, secrets: str) -> flask.Flask:
    app = flask.Flask("rotated")
    app.config.update(TESTING=True, IDEMPOTENCY_KEY_SECRETS=secrets)
    idem = Idempotency(app, store=store, tenant=lambda: "alpha")

    @app.post("/payments")
    @idem.idempotent(exclude=["client_ts"])
    def create_payment() -> t.Any:
        return flask.jsonify(id="pay_rotated"), 201

    return app


def test_a_rotation_replays_and_refuses_as_before(
    app_factory: Factory, second_store: SQLStore
) -> None:
    """A request answered by a server of the old secret replays on a server that lists the new
    one first, a different request with its key is refused with 422 (its fingerprint checked
    under the old secret), and the view never runs again."""
    old, _, counter = app_factory(IDEMPOTENCY_KEY_SECRETS=f"old:{OLD}")
    first = _pay(old, "rotate-1")
    assert first.status_code == 201 and counter.calls == 1
    new = _server(second_store, f"new:{NEW},old:{OLD}")
    replay = _pay(new, "rotate-1")
    assert replay.status_code == 201 and replay.get_json() == first.get_json()
    assert _pay(new, "rotate-1", amount=1).status_code == 422
    assert _pay(new, "rotate-2").status_code == 201, "a new key is claimed under the new secret"
    assert counter.calls == 1
