"""LeaseKeeper on a real store: claims that may have landed after their 503 are released by
their token, a process keeps a bounded number of them pending, and no error of the store ends
the thread that renews every lease."""

from __future__ import annotations

import datetime as dt
import logging
import time
import typing as t

import pytest
import sqlalchemy as sa

from flask_idem.core.record import Scope, State
from flask_idem.lease import LeaseKeeper
from flask_idem.store import SQLiteStore, create_store
from flask_idem.store.base import Store
from flask_idem.testing import empty_store


@pytest.fixture
def store(sqlite_url: str) -> t.Iterator[Store]:
    store = create_store(sqlite_url)
    empty_store(store)
    yield store
    empty_store(store)
    store.engine.dispose()


def _wait_until(condition: t.Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_past_its_bound_a_claim_is_left_to_its_lease(
    store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    """A long outage gives one claim back per 503: past ``max_give_backs`` pending, the next
    ones are logged and left in progress (their lease ends them, as without give-backs); the
    pending ones are released at their first try, and the bound counts only what is pending."""
    keeper = LeaseKeeper(store)
    keeper.max_give_backs = 3
    scopes = [Scope("t", "POST /give-back", f"k{n}") for n in range(5)]
    tokens = []
    for scope in scopes:
        claim = store.claim(scope, b"f" * 32, ttl=60, lease=30)
        assert claim.claimed and claim.token is not None
        tokens.append(claim.token)
    with caplog.at_level(logging.WARNING, logger="flask_idem"):
        for scope, token in zip(scopes, tokens, strict=True):
            keeper.give_back(scope, token, ttl=60, lease=30)
    assert keeper.giving_back == 3
    left = [r for r in caplog.records if "left to its lease" in r.getMessage()]
    assert len(left) == 2
    assert all("k3" not in r.getMessage() and "k4" not in r.getMessage() for r in left)
    _wait_until(lambda: keeper.giving_back == 0)
    assert [store.get(scope) for scope in scopes[:3]] == [None, None, None], "given back"
    for scope in scopes[3:]:
        record = store.get(scope)
        assert record is not None and record.state is State.IN_PROGRESS, "left to its lease"
    keeper.give_back(scopes[3], tokens[3], ttl=60, lease=30)
    assert keeper.giving_back == 1, "room again once the pending ones are done"
    _wait_until(lambda: store.get(scopes[3]) is None)
    _wait_until(lambda: keeper.giving_back == 0)


class _RenewRaisesOnce(SQLiteStore):
    """A store whose first renewal raises what no store translates (a custom store's bug)."""

    raised = 0

    def renew(self, scope: Scope, token: str, **kwargs: t.Any) -> bool:
        if not self.raised:
            self.raised += 1
            raise RuntimeError("a bug in the store")
        return super().renew(scope, token, **kwargs)


def test_an_unexpected_error_never_ends_the_renewals(
    sqlite_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A renewal that raises is logged and tried again at the next tick: had it ended the
    thread, the lease of a request still running would run out (and a ``reexecute`` retry
    take it over), with every other lease of the process."""
    store = _RenewRaisesOnce(sa.create_engine(sqlite_url))
    empty_store(store)
    try:
        keeper = LeaseKeeper(store)
        scope = Scope("t", "POST /renewed", "k")
        claim = store.claim(scope, b"f" * 32, ttl=60, lease=1.5)
        first_end = claim.record.lease_expires_at
        assert first_end is not None
        with caplog.at_level(logging.ERROR, logger="flask_idem"):
            watch = keeper.watch(claim.record, 1.5)

            def renewed_since_the_error() -> bool:
                record = store.get(scope)
                assert record is not None and record.lease_expires_at is not None
                return record.lease_expires_at - first_end >= dt.timedelta(seconds=1)

            # Renewed every 0.5 s: the first raises, the next ones carry the lease on.
            _wait_until(renewed_since_the_error, timeout=20)
        keeper.unwatch(watch)
        assert store.raised == 1
        assert any("lease renewal raised" in r.getMessage() for r in caplog.records)
    finally:
        empty_store(store)
        store.engine.dispose()
