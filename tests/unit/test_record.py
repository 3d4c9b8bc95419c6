"""``Record.kept_for``, the seconds ``Idempotency-Retention`` announces on a replay, counts a
record's life as the store's liveness test does: its TTL from the claim, and its TTL again from
the end of its request."""

from __future__ import annotations

import datetime as dt

from flask_idem import Record, Scope, State

CLAIMED = dt.datetime(2026, 12, 3, 12, 0, tzinfo=dt.timezone.utc)
TTL = dt.timedelta(hours=1)


def _record(
    *,
    now: dt.timedelta,
    completed: dt.timedelta | None = None,
    lease: dt.timedelta | None = None,
) -> Record:
    return Record(
        scope=Scope("alpha", "POST /payments", "k-1"),
        fingerprint=b"\0" * 32,
        state=State.COMPLETED if completed is not None else State.UNKNOWN,
        claim_token=None,
        lease_expires_at=None if lease is None else CLAIMED + lease,
        response=None,
        created_at=CLAIMED,
        completed_at=None if completed is None else CLAIMED + completed,
        expires_at=CLAIMED + TTL,
        now=CLAIMED + now,
    )


def test_a_quick_request_is_kept_one_ttl_from_its_end() -> None:
    record = _record(now=dt.timedelta(minutes=10), completed=dt.timedelta(seconds=2))
    assert record.kept_for == (TTL - dt.timedelta(minutes=10, seconds=-2)).total_seconds()


def test_a_request_that_outlived_its_ttl_is_kept_one_ttl_from_its_completion() -> None:
    record = _record(now=dt.timedelta(hours=2), completed=dt.timedelta(minutes=90))
    assert record.kept_for == dt.timedelta(minutes=30).total_seconds()


def test_an_outcome_decided_when_the_lease_ran_out_counts_from_then() -> None:
    record = _record(now=dt.timedelta(minutes=70), lease=dt.timedelta(minutes=40))
    assert record.kept_for == dt.timedelta(minutes=30).total_seconds()


def test_an_expired_record_is_kept_for_nothing() -> None:
    record = _record(now=dt.timedelta(hours=3), completed=dt.timedelta(seconds=1))
    assert record.kept_for == 0.0
