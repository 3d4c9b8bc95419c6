"""SQLiteStore.use_clock: a test's clock moves every record through time at once, and the
keeper's renewal (LeaseKeeper.renew) is the thread's."""

from __future__ import annotations

import datetime as dt
import typing as t

import pytest

from flask_idem.core.record import Scope
from flask_idem.lease import LeaseKeeper, Watch
from flask_idem.store import SQLiteStore, create_store
from flask_idem.testing import empty_store

START = dt.datetime(2031, 5, 1, 12, 0, tzinfo=dt.timezone.utc)
SCOPE = Scope("t", "POST /clock", "k")


@pytest.fixture
def clocked(sqlite_url: str) -> t.Iterator[tuple[SQLiteStore, list[dt.datetime]]]:
    store = create_store(sqlite_url)
    assert isinstance(store, SQLiteStore)
    now = [START]
    store.use_clock(lambda: now[0])
    empty_store(store)
    yield store, now
    empty_store(store)
    store.engine.dispose()


def test_records_carry_the_given_clock(clocked: tuple[SQLiteStore, list[dt.datetime]]) -> None:
    """Every timestamp and every comparison with "now" reads the given clock."""
    store, now = clocked
    claim = store.claim(SCOPE, b"f" * 32, ttl=100, lease=10)
    assert claim.record.created_at == START
    assert claim.record.lease_expires_at == START + dt.timedelta(seconds=10)
    assert claim.record.now == START
    now[0] = START + dt.timedelta(seconds=11)
    record = store.get(SCOPE)
    assert record is not None and record.lease_expired
    assert [r.created_at for r in store.stuck()] == [START]
    now[0] = START + dt.timedelta(seconds=200)
    assert store.get(SCOPE) is None
    assert store.maintain(ahead=0).purged == 1


def test_the_clock_comes_before_the_first_statement(sqlite_url: str) -> None:
    """The statements compiled once carry the clock they were built with."""
    store = create_store(sqlite_url)
    try:
        store.claim(SCOPE, b"f" * 32, ttl=100, lease=10)
        store.complete(SCOPE, "no such token", None)
        with pytest.raises(RuntimeError, match="before the store's first statement"):
            store.use_clock(lambda: START)
    finally:
        empty_store(store)
        store.engine.dispose()


def test_renew_extends_a_held_lease_and_reports_a_lost_one(
    clocked: tuple[SQLiteStore, list[dt.datetime]],
) -> None:
    store, now = clocked
    keeper = LeaseKeeper(store)
    claim = store.claim(SCOPE, b"f" * 32, ttl=100, lease=10)
    watch = Watch(claim.record, 10, due=0.0)
    now[0] = START + dt.timedelta(seconds=8)
    assert keeper.renew(watch)
    record = store.get(SCOPE)
    assert record is not None and record.lease_expires_at == now[0] + dt.timedelta(seconds=10)
    assert claim.token is not None and store.release(SCOPE, claim.token)
    assert not keeper.renew(watch)
