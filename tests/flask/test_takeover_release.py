"""A re-run of a record a previous attempt may have charged (a ``recovery="reexecute"``
takeover, a record an operator reopened, a redelivered job) never releases it: a refusal or a
failure before its own contact leaves it ``unknown``, the same row, so the next run derives the
same downstream keys and the provider charges once.
"""

from __future__ import annotations

import typing as t

import flask
import pytest

from flask_idem import Idempotency, Scope
from flask_idem.core.record import State
from flask_idem.store import SQLStore


class Provider:
    """A payment provider that deduplicates on the idempotency key it is sent."""

    def __init__(self) -> None:
        self.charges: dict[str, int] = {}

    def charge(self, key: str, amount: int) -> None:
        self.charges.setdefault(key, amount)


def _app(store: SQLStore, recovery: str) -> tuple[flask.Flask, Provider, dict[str, t.Any]]:
    app = flask.Flask("refuse-takeover")
    app.config.update(PROPAGATE_EXCEPTIONS=False)
    idem = Idempotency(app, store=store, tenant=lambda: "alpha")
    provider = Provider()
    control: dict[str, t.Any] = {"crash_after_charge": True, "quota": True}

    @app.post("/pay")
    @idem.idempotent(recovery=recovery)  # type: ignore[arg-type]
    def pay() -> t.Any:
        if not control["quota"]:
            # decided before any contact *in this attempt*: the documented use of refuse()
            return idem.refuse(({"error": "daily limit"}, 429))
        provider.charge(idem.downstream_key("charge"), 100)
        if control["crash_after_charge"]:
            raise RuntimeError("connection reset after the provider charged")
        return {"paid": True}, 201

    return app, provider, control


SCOPE = Scope("alpha", "POST /pay", "k-refuse")


def test_refuse_on_a_reexecute_takeover_keeps_the_downstream_key(store: SQLStore) -> None:
    app, provider, control = _app(store, "reexecute")
    client = app.test_client()
    headers = {"Idempotency-Key": SCOPE.key}

    assert client.post("/pay", headers=headers).status_code == 500  # charged, outcome unknown
    record = store.get(SCOPE)
    assert record is not None and record.state is State.UNKNOWN
    created = record.created_at

    control["quota"] = False  # the retry takes the record over, then refuses before contact
    assert client.post("/pay", headers=headers).status_code == 429

    after = store.get(SCOPE)
    assert after is not None, "the refusal deleted a record whose first attempt charged"
    assert after.created_at == created

    control.update(quota=True, crash_after_charge=False)
    assert client.post("/pay", headers=headers).status_code == 201
    assert len(provider.charges) == 1, f"charged twice: {provider.charges}"


def test_refuse_on_an_operator_reopened_record_keeps_the_downstream_key(store: SQLStore) -> None:
    app, provider, control = _app(store, "fail")
    client = app.test_client()
    headers = {"Idempotency-Key": SCOPE.key}

    assert client.post("/pay", headers=headers).status_code == 500
    record = store.get(SCOPE)
    assert record is not None and record.state is State.UNKNOWN
    # `flask idem release` (no --not-happened): "the next retry runs it again as the same
    # operation, with the same downstream keys"
    assert store.reopen(SCOPE, token=record.claim_token)

    control["quota"] = False
    assert client.post("/pay", headers=headers).status_code == 429
    after = store.get(SCOPE)
    assert after is not None, "the refusal deleted a reopened record"
    assert after.state is State.UNKNOWN and after.created_at == record.created_at

    control.update(quota=True, crash_after_charge=False)
    assert client.post("/pay", headers=headers).status_code == 409, "back to the operator"
    assert store.reopen(SCOPE, token=after.claim_token)
    assert client.post("/pay", headers=headers).status_code == 201
    assert len(provider.charges) == 1, f"charged twice: {provider.charges}"


@pytest.mark.parametrize("how", ["crash", "never-stored"])
def test_release_before_contact_on_a_takeover_keeps_the_downstream_key(
    store: SQLStore, how: str
) -> None:
    """The same through release_before_contact=True (formerly declares_effects=): a re-run that
    fails before its own downstream_key() keeps the record of the charged attempt."""
    app = flask.Flask("rbc-takeover")
    app.config.update(PROPAGATE_EXCEPTIONS=False)
    idem = Idempotency(app, store=store, tenant=lambda: "alpha")
    provider = Provider()
    control = {"attempt": 0}

    @app.post("/pay")
    @idem.idempotent(recovery="reexecute", release_before_contact=True)
    def pay() -> t.Any:
        control["attempt"] += 1
        if control["attempt"] == 2:  # fails before contact, in this attempt
            if how == "crash":
                raise RuntimeError("the fraud service timed out")
            return {"error": "fraud service down"}, 503
        provider.charge(idem.downstream_key("charge"), 100)
        if control["attempt"] == 1:
            raise RuntimeError("connection reset after the provider charged")
        return {"paid": True}, 201

    client = app.test_client()
    headers = {"Idempotency-Key": SCOPE.key}
    assert client.post("/pay", headers=headers).status_code == 500
    assert client.post("/pay", headers=headers).status_code in (500, 503)
    assert store.get(SCOPE) is not None, "the re-run's failure deleted a charged record"
    assert client.post("/pay", headers=headers).status_code == 201
    assert len(provider.charges) == 1, f"charged twice: {provider.charges}"


def test_a_redelivered_job_that_fails_before_contact_keeps_the_downstream_key(
    store: SQLStore,
) -> None:
    """sample_app/jobs.py's renew_subscription shape (reexecute, release_before_contact): its
    ``current_provider()`` is evaluated before ``idem.downstream_key("charge")`` in the call."""
    app = flask.Flask("rbc-job")
    idem = Idempotency(app, store=store)
    provider = Provider()
    deliveries = {"n": 0}

    def current_provider() -> Provider:
        if deliveries["n"] == 2:
            raise ConnectionError("provider client could not be configured")
        return provider

    @idem.job(
        "renew", key="period", tenant="tenant", recovery="reexecute", release_before_contact=True
    )
    def renew(tenant: str, period: str) -> dict[str, t.Any]:
        deliveries["n"] += 1
        current_provider().charge(idem.downstream_key("charge"), 100)
        if deliveries["n"] == 1:
            raise ConnectionError("worker lost the provider's answer after the charge")
        return {"renewed": period}

    with app.app_context():
        for _ in range(2):
            with pytest.raises(ConnectionError):
                renew("alpha", "2026-12")
        assert store.get(Scope("alpha", "JOB renew", "2026-12")) is not None, (
            "the redelivery's failure deleted the record of a charged run"
        )
        assert renew("alpha", "2026-12") == {"renewed": "2026-12"}
    assert len(provider.charges) == 1, f"charged twice: {provider.charges}"
