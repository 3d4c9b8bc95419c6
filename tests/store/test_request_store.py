"""A store with the request primitives only (``RequestStore``, the minimum of a custom store)
passes its contract and protects views; what reads records through the operator interface
refuses it, saying so, instead of failing with an AttributeError."""

from __future__ import annotations

import datetime as dt
import typing as t

import flask
import pytest
import sqlalchemy as sa

from flask_idem import ConfigurationError, Idempotency, RequestStore
from flask_idem.core.key_digest import KeyDigest
from flask_idem.core.record import ClaimResult, Record, Scope, StoredResponse
from flask_idem.core.sealing import Sealer
from flask_idem.ops.metrics import exposition
from flask_idem.store import SQLStore
from flask_idem.testing.contract import RequestStoreContract
from tests.support.helpers import store_on


class RequestOnly(RequestStore):
    """flask_idem's SQL store seen through the request primitives alone, as a custom store
    that implements nothing more would be."""

    def __init__(self, inner: SQLStore) -> None:
        super().__init__(inner.engine)
        self.inner = inner

    def use_audit(self, enabled: bool, retention: float | None = None) -> None:
        super().use_audit(enabled, retention)
        self.inner.use_audit(enabled, retention)

    def use_sealer(self, sealer: Sealer) -> None:
        super().use_sealer(sealer)
        self.inner.use_sealer(sealer)

    def use_keys(self, keys: KeyDigest) -> None:
        super().use_keys(keys)
        self.inner.use_keys(keys)

    def claim(self, scope: Scope, fingerprint: bytes, *, ttl: float, lease: float) -> ClaimResult:
        return self.inner.claim(scope, fingerprint, ttl=ttl, lease=lease)

    def claim_atomic(
        self, connection: sa.Connection, scope: Scope, fingerprint: bytes, *, ttl: float
    ) -> ClaimResult | None:
        return self.inner.claim_atomic(connection, scope, fingerprint, ttl=ttl)

    def complete(
        self,
        scope: Scope,
        token: str,
        response: StoredResponse | None,
        *,
        connection: sa.Connection | None = None,
        created_at: dt.datetime | None = None,
    ) -> bool:
        return self.inner.complete(
            scope, token, response, connection=connection, created_at=created_at
        )

    def release(self, scope: Scope, token: str, *, created_at: dt.datetime | None = None) -> bool:
        return self.inner.release(scope, token, created_at=created_at)

    def mark_unknown(
        self, scope: Scope, token: str, *, created_at: dt.datetime | None = None
    ) -> bool:
        return self.inner.mark_unknown(scope, token, created_at=created_at)

    def renew(
        self, scope: Scope, token: str, *, lease: float, created_at: dt.datetime | None = None
    ) -> bool:
        return self.inner.renew(scope, token, lease=lease, created_at=created_at)

    def take_over(self, scope: Scope, token: str, *, lease: float) -> ClaimResult | None:
        return self.inner.take_over(scope, token, lease=lease)

    def get(self, scope: Scope) -> Record | None:
        return self.inner.get(scope)

    def begin(self) -> sa.Connection:
        return self.inner.begin()


@pytest.fixture
def request_only(db_url: str) -> t.Iterator[RequestOnly]:
    with store_on(db_url) as inner:
        yield RequestOnly(inner)


class TestRequestOnlyStore(RequestStoreContract):
    """The request contract needs nothing of the operator interface."""

    @pytest.fixture
    def store(self, request_only: RequestOnly) -> RequestOnly:
        return request_only


def _app(store: RequestStore, **config: t.Any) -> tuple[flask.Flask, list[int]]:
    app = flask.Flask("request_only")
    app.config.update({"IDEMPOTENCY_BLUEPRINT_PREFIX": None, **config})
    idem = Idempotency(app, store=store, tenant=lambda: "alpha")
    runs: list[int] = []

    @app.post("/payments")
    @idem.idempotent
    def pay() -> t.Any:
        runs.append(1)
        return {"payment": len(runs)}, 201

    return app, runs


def test_a_request_only_store_protects_views(request_only: RequestOnly) -> None:
    app, runs = _app(request_only)
    client = app.test_client()
    first = client.post("/payments", json={"amount": 1}, headers={"Idempotency-Key": "k1"})
    again = client.post("/payments", json={"amount": 1}, headers={"Idempotency-Key": "k1"})
    assert (first.status_code, again.status_code) == (201, 201)
    assert again.get_json() == first.get_json() and len(runs) == 1, "replayed, not re-run"
    assert again.headers["Idempotent-Replayed"] == "true"


@pytest.mark.parametrize(
    ("config", "named"),
    [
        ({"IDEMPOTENCY_BLUEPRINT_PREFIX": "/idempotency"}, "IDEMPOTENCY_BLUEPRINT_PREFIX = None"),
        (
            {"IDEMPOTENCY_BLUEPRINT_PREFIX": None, "IDEMPOTENCY_ENSURE_PARTITIONS": True},
            "IDEMPOTENCY_ENSURE_PARTITIONS",
        ),
    ],
)
def test_init_app_refuses_what_reads_records_through_it(
    request_only: RequestOnly, config: dict[str, t.Any], named: str
) -> None:
    """The inspection endpoint (on by default) and start-up partition upkeep need the operator
    interface: refused at start-up, naming the setting, not at their first use."""
    app = flask.Flask("refused")
    app.config.update(config)
    with pytest.raises(ConfigurationError, match="OperatorStore") as refused:
        Idempotency(app, store=request_only)
    assert named in str(refused.value) and "RequestOnly" in str(refused.value)
    assert "idempotency" not in app.extensions, "nothing half registered"


@pytest.mark.parametrize(
    "command", [["stuck"], ["maintain"], ["reconcile"], ["keys", "status"], ["metrics"]]
)
def test_operator_commands_say_the_store_lacks_the_operator_interface(
    request_only: RequestOnly, command: list[str]
) -> None:
    app, _ = _app(request_only)
    result = app.test_cli_runner().invoke(args=["idem", *command])
    assert result.exit_code == 1, result.output
    assert "OperatorStore" in result.output and "Traceback" not in result.output


def test_metrics_have_no_table_gauges_without_the_operator_interface(
    request_only: RequestOnly, store: SQLStore
) -> None:
    assert b"idempotency_table_up 1.0" in exposition(store, None)
    assert exposition(request_only, None) == b""
