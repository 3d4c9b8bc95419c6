"""The audit trail (IDEMPOTENCY_AUDIT): one row per transition, in the transition's own
statement or transaction, found by key, never holding a key or a body; off, it costs nothing."""

from __future__ import annotations

import json
import typing as t

import flask
import pytest
import sqlalchemy as sa

from flask_idem import Idempotency, Scope, StoredResponse, Verdict
from flask_idem.core.idempotency_keys import key_hash
from flask_idem.core.record import Record
from flask_idem.store import SQLStore
from tests.support.answers import post
from tests.support.helpers import Counter, count_statements, shift

Factory = t.Callable[..., tuple[flask.Flask, Idempotency, Counter]]
SECRET = "audit-secret-key-0042"
#: The body every request here sends: a note that must stay out of the trail.
NOTED: t.Final = {"amount": 4200, "note": "cus_SECRET_BODY"}
ENDPOINT = "POST /payments"


def _history(app: flask.Flask, key: str = SECRET, *args: str) -> list[dict[str, t.Any]]:
    result = app.test_cli_runner().invoke(
        args=["idem", "history", "--tenant", "alpha", "--json", *args], input=f"{key}\n"
    )
    assert result.exit_code == 0, result.output
    return t.cast("list[dict[str, t.Any]]", json.loads(result.output))


def _rows(store: SQLStore) -> list[t.Any]:
    with store.engine.connect() as conn:
        return list(conn.execute(sa.text("SELECT * FROM idempotency_audit")).all())


def test_every_transition_is_one_row_and_answers_that_change_nothing_are_none(
    app_factory: Factory, store: SQLStore
) -> None:
    app, idem, _ = app_factory(IDEMPOTENCY_AUDIT=True)

    @app.post("/unknown")
    @idem.idempotent
    def unknown_view() -> t.Any:
        idem.side_effect()
        raise RuntimeError("boom")

    @idem.reconciler("POST /unknown")
    def settle(record: Record) -> Verdict:
        return Verdict.happened(({"settled": True}, 201), reason="provider shows ch_1")

    client = app.test_client()
    assert post(client, SECRET, NOTED).status_code == 201
    assert post(client, SECRET, NOTED).headers["Idempotent-Replayed"] == "true"  # no row
    assert post(client, SECRET, {**NOTED, "amount": 1}).status_code == 422  # no row
    client.post("/status/503", headers={"Idempotency-Key": SECRET})
    client.post("/unknown", headers={"Idempotency-Key": SECRET})
    assert client.post("/unknown", headers={"Idempotency-Key": SECRET}).status_code == 409
    reconciled = app.test_cli_runner().invoke(args=["idem", "reconcile"])
    assert reconciled.exit_code == 0, reconciled.output

    timeline = [
        (e["endpoint"], e["event"], e["state"], e["status"], e["actor"]) for e in _history(app)
    ]
    assert timeline == [
        (ENDPOINT, "claimed", "in_progress", None, "request"),
        (ENDPOINT, "completed", "completed", 201, "request"),
        ("POST /status/<int:code>", "claimed", "in_progress", None, "request"),
        ("POST /status/<int:code>", "released", None, None, "request"),
        ("POST /unknown", "claimed", "in_progress", None, "request"),
        ("POST /unknown", "unknown", "unknown", None, "request"),
        ("POST /unknown", "completed", "completed", 201, "reconciler"),
    ]
    (settled,) = [
        e
        for e in _history(app, SECRET, "--endpoint", "POST /unknown")
        if e["actor"] == "reconciler"
    ]
    assert settled["detail"] == "provider shows ch_1"
    # Another tenant's key of the same value has a timeline of its own.
    other = app.test_cli_runner().invoke(
        args=["idem", "history", "--tenant", "beta"], input=f"{SECRET}\n"
    )
    assert other.exit_code == 1
    dumped = repr(_rows(store))
    assert SECRET not in dumped and "cus_SECRET_BODY" not in dumped
    text = app.test_cli_runner().invoke(
        args=["idem", "history", "--tenant", "alpha"], input=f"{SECRET}\n"
    )
    assert "claimed" in text.output and "reconciler" in text.output and SECRET not in text.output
    # By key hash (as the logs carry it): one endpoint's timeline, with no key on the line.
    hashed = key_hash(Scope("alpha", "POST /unknown", SECRET))
    by_hash = app.test_cli_runner().invoke(
        args=["idem", "history", hashed, "--tenant", "alpha", "--json"]
    )
    assert by_hash.exit_code == 0, by_hash.output
    assert [(e["endpoint"], e["event"]) for e in json.loads(by_hash.stdout)] == [
        ("POST /unknown", "claimed"),
        ("POST /unknown", "unknown"),
        ("POST /unknown", "completed"),
    ]


def test_operator_actions_are_audited(app_factory: Factory, store: SQLStore) -> None:
    app, _, _ = app_factory(IDEMPOTENCY_AUDIT=True, IDEMPOTENCY_LEASE=5)
    scope = Scope("alpha", ENDPOINT, SECRET)
    claim = store.claim(scope, b"f" * 32, ttl=600, lease=5)
    store.mark_unknown(scope, claim.token)
    runner = app.test_cli_runner()
    done = runner.invoke(
        args=["idem", "release", "--tenant", "alpha", "--endpoint", ENDPOINT, "--yes"],
        input=f"{SECRET}\n",
    )
    assert done.exit_code == 0, done.output
    assert [(e["event"], e["actor"], e["detail"]) for e in _history(app)] == [
        ("claimed", "request", None),
        ("unknown", "request", None),
        ("reopened", "operator", "flask idem release"),
    ]


def test_the_audit_row_commits_or_rolls_back_with_its_transition(store: SQLStore) -> None:
    store.use_audit(True)
    scope = Scope("alpha", ENDPOINT, SECRET)
    claim = store.claim(scope, b"f" * 32, ttl=600, lease=30)
    conn = store.begin()
    try:
        assert store.complete(scope, claim.token, StoredResponse(201, (), b"{}"), connection=conn)
        conn.rollback()  # the business transaction failed: neither the answer nor its row
    finally:
        conn.close()
    assert [e.event for e in store.history("alpha", SECRET)] == ["claimed"]
    assert store.release(scope, claim.token)
    taken = store.history("alpha", SECRET)
    assert [e.event for e in taken] == ["claimed", "released"]
    assert taken[0].fingerprint == b"f" * 32 and taken[0].record_created_at is not None


@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
def test_off_costs_nothing_and_on_costs_no_statement(app_factory: Factory, store: SQLStore) -> None:
    counts = []
    for audit in (False, True):
        app, _, _ = app_factory(IDEMPOTENCY_AUDIT=audit)
        store._audit_configured = False  # one store, two applications in turn
        client = app.test_client()
        key = f"cost-{audit}"
        with count_statements(store.engine) as new:
            assert post(client, key, NOTED).status_code == 201
        with count_statements(store.engine) as replay:
            assert post(client, key, NOTED).status_code == 201
        if not audit:
            assert not any("idempotency_audit" in s for s in new + replay), new + replay
            assert _rows(store) == []
        counts.append((len(new), len(replay)))
    assert counts[0] == counts[1] == (2, 1), counts


def test_retention_is_the_only_delete(store: SQLStore) -> None:
    store.use_audit(True, retention=86400)
    scope = Scope("alpha", ENDPOINT, SECRET)
    store.claim(scope, b"f" * 32, ttl=600, lease=30)
    store.claim(Scope("alpha", ENDPOINT, "recent"), b"f" * 32, ttl=600, lease=30)
    old = {"key_hash": store.history("alpha", SECRET)[0].key_hash}
    with store.engine.begin() as conn:
        if store.dialect == "postgresql":
            # A month of 2010 in its own partition, and an old row that fell into DEFAULT.
            conn.exec_driver_sql(
                "CREATE TABLE idempotency_audit_p201001 PARTITION OF idempotency_audit "
                "FOR VALUES FROM ('2010-01-01 00:00+00') TO ('2010-02-01 00:00+00')"
            )
            conn.execute(
                sa.text(
                    "INSERT INTO idempotency_audit_default SELECT gen_random_uuid(),"
                    " timestamptz '2009-06-01 00:00+00', tenant, endpoint, key_hash, lookup,"
                    " record_created_at, event, state, status, fingerprint, actor, detail"
                    " FROM idempotency_audit WHERE key_hash = :key_hash"
                ),
                old,
            )
        else:
            conn.execute(
                sa.text(
                    "UPDATE idempotency_audit SET occurred_at = '2009-06-01 00:00:00.000000' "
                    "WHERE key_hash = :key_hash"
                ),
                old,
            )
    report = store.maintain(ahead=1)
    assert report.audit_purged == 1
    if store.dialect == "postgresql":
        assert report.audit_dropped == ("idempotency_audit_p201001",)
        assert [e.event for e in store.history("alpha", SECRET)] == ["claimed"]
    else:
        assert store.history("alpha", SECRET) == []
    assert [e.event for e in store.history("alpha", "recent")] == ["claimed"]
    assert store.maintain(ahead=1).audit_purged == 0


def test_takeovers_and_evictions_are_audited(store: SQLStore) -> None:
    store.use_audit(True)
    scope = Scope("alpha", ENDPOINT, SECRET)
    first = store.claim(scope, b"f" * 32, ttl=600, lease=30)
    shift(store, scope, 60, "lease_expires_at")
    again = store.take_over(scope, first.token, lease=30)
    assert again is not None and again.record.created_at == first.record.created_at
    assert store.evict(scope)
    events = store.history("alpha", SECRET, ENDPOINT)
    assert [(e.event, e.state) for e in events] == [
        ("claimed", "in_progress"),
        ("taken_over", "in_progress"),
        ("evicted", None),
    ]
    assert {e.record_created_at for e in events} == {first.record.created_at}
