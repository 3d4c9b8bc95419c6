"""Defects fixed in the past, re-created as small mutations of today's code.

Each mutation puts one function back to what it did before its fix (read from the fixing
commit), so that a test can show the explorer finds the defect, with its shortest trace.
Applied with pytest's ``monkeypatch``; the unmutated code must pass the same exploration.
"""

from __future__ import annotations

import typing as t

import pytest
import sqlalchemy as sa

from flask_idem.attempt import Attempt
from flask_idem.core.idempotency_keys import derive_key
from flask_idem.core.key_digest import KeyDigest
from flask_idem.core.record import ClaimResult, Record, Scope, State
from flask_idem.store.sql import (
    RECORD_COLUMNS,
    SQLStore,
    _aware,
    lease_start,
    new_token,
    record_from_row,
)
from flask_idem.store.table import idempotency_keys as table
from flask_idem.web import extension


def reopen_deletes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before fb247f7 a "not happened" verdict (the reconciler's, ``flask idem release
    --not-happened``) forgot the stuck record, fenced by its token, instead of reopening it:
    the next retry claimed a new record, so new downstream keys, while the owner was perhaps
    only frozen past its lease."""

    def reopen(self: SQLStore, scope: Scope, *, token: str | None) -> bool:
        settle = sa.and_(
            self._live(scope), self._stuck(), table.c.claim_token == sa.bindparam("p_token")
        )
        deleted = self._write(
            table.delete().where(settle), {"p_token": token}, scope=scope, event="released"
        )
        return deleted.rowcount == 1

    monkeypatch.setattr(SQLStore, "reopen", reopen)


def release_after_commit(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before b14e6da a failure gave the key back whatever the view had committed itself: a
    ``release_before_contact`` view that committed its rows and then failed was released, and
    every retry committed another row."""

    def releasable(self: Attempt) -> bool:
        if self.atomic:
            return True
        if self.contacted or self.options is None:
            return False
        return self.refused or self.options.release_before_contact

    monkeypatch.setattr(Attempt, "releasable", property(releasable))


def rerun_not_contacted(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before 8cc5518 a re-run of a stuck record (a takeover) counted as not contacted yet: its
    failure before contact released the record an earlier attempt had charged under, and the
    next retry charged again under new downstream keys."""
    take_over = Attempt.take_over

    def forgetful(self: Attempt, record: Record) -> bool:
        taken = take_over(self, record)
        if taken:
            self.contacted = False
        return taken

    monkeypatch.setattr(Attempt, "take_over", forgetful)


def key_per_attempt(monkeypatch: pytest.MonkeyPatch) -> None:
    """Not a past defect: a downstream key that depends on the attempt (its claim token) and not
    on the operation alone. A re-run of the same record then charges under another key; the
    "one charge" invariant counts keys, not records, to see it."""

    def per_attempt(record: Record, step: str) -> str:
        return derive_key(record, f"{step}/{record.claim_token}")

    monkeypatch.setattr(extension, "derive_key", per_attempt)


def live_lease_taken(monkeypatch: pytest.MonkeyPatch) -> None:
    """Not a past defect: a running owner treated as abandoned, by the claim's reading of the
    record and by the store's takeover alike (the lease not compared with the clock). A retry
    then takes over a request that is still running: two holders of one key."""
    monkeypatch.setattr(
        Record,
        "lease_expired",
        property(lambda record: record.state is State.IN_PROGRESS),
    )

    def eager(self: SQLStore, scope: Scope, token: str, *, lease: float) -> ClaimResult | None:
        # SQLStore.take_over with its condition on the lease left out.
        takeable = [State.UNKNOWN.value, State.REOPENED.value, State.IN_PROGRESS.value]
        statement = (
            table.update()
            .where(
                table.c.tenant == sa.bindparam("p_tenant"),
                table.c.endpoint == sa.bindparam("p_endpoint"),
                table.c.key == sa.bindparam("p_key"),
                table.c.claim_token == sa.bindparam("p_token"),
                table.c.state.in_(takeable),
                self._alive(),
            )
            .values(
                state=State.IN_PROGRESS.value,
                claim_token=new_token(),
                lease_expires_at=self.now_plus(lease),
            )
        )
        row = self._write(
            statement,
            self._owner(scope, token, None),
            scope=scope,
            event="taken_over",
            returning=RECORD_COLUMNS,
        ).first
        if row is None:
            return None
        now = lease_start(_aware(row.lease_expires_at), lease)
        return ClaimResult(record_from_row(scope, row, self.sealer, now), claimed=True)

    monkeypatch.setattr(SQLStore, "take_over", eager)


def fingerprint_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    """Not a past defect: the claim's comparison of the request with the stored fingerprint
    left out. Another request under the same key then gets the first one's answer (its own
    amount never charged: a lost write) instead of 422."""
    monkeypatch.setattr(KeyDigest, "same_request", lambda self, record, digest: True)


MUTATIONS: dict[str, t.Callable[[pytest.MonkeyPatch], None]] = {
    "reopen_deletes": reopen_deletes,
    "release_after_commit": release_after_commit,
    "rerun_not_contacted": rerun_not_contacted,
    "key_per_attempt": key_per_attempt,
    "live_lease_taken": live_lease_taken,
    "fingerprint_skipped": fingerprint_skipped,
}
