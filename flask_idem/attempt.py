"""One execution of an operation, whoever runs it: a protected view (``flow``) or a job (``jobs``).

Nothing here reads the request; an app context is enough. Both callers take the same decisions
from here, so a view and a job share one outcome model:

:func:`classify`  what a claim that found a record leads to (refuse, replay, wait, re-run);
:func:`own`       the claim is ours: watch its lease;
:func:`store_result`  record the result, committed with the business transaction;
:func:`note_ended_below`  a business transaction ended below SQLAlchemy: never stored;
:func:`give_up`   roll the business transaction back and release the key only when the attempt
                  provably committed nothing (it declared its effects, had not yet declared
                  contact with the outside world, and committed nothing itself), else mark it
                  ``unknown``.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import time
import typing as t

import sqlalchemy as sa

from .commits import committed_elsewhere, count_commits_from_now, ended_outside
from .core import signals
from .core.errors import StoreUnavailable
from .core.options import Recovery
from .core.record import ClaimResult, Record, State, StoredResponse
from .events import emit as emit
from .sessions import replaced, roll_back_fresh
from .state import AppState, RequestState
from .store.messages import redacted
from .store.sql import translate_errors

log = logging.getLogger("flask_idem")


class Found(enum.Enum):
    """What an existing record means for a new attempt with the same key."""

    #: The key came back with another request: refuse (a caller bug, never a retry).
    MISMATCH = "mismatch"
    #: The operation completed: replay its stored result.
    COMPLETED = "completed"
    #: The operation ran but its result could not be stored: refuse, never run it again.
    UNSTORED = "unstored"
    #: Its owner is alive (the lease is held): wait, or tell the caller to retry later.
    RUNNING = "running"
    #: Nobody owns the outcome and ``recovery="fail"``: wait for a reconciler or an operator.
    PENDING = "pending"
    #: Nobody owns the outcome and the attempt may run it again as the same operation (a
    #: ``reexecute`` view or job, or a reopened record: an operator's release or a
    #: reconciler's "not happened"): take it over.
    RERUN = "rerun"


def classify(record: Record, digest: bytes, recovery: Recovery) -> Found:
    """The decision for an attempt whose claim found ``record``."""
    if record.fingerprint != digest:
        return Found.MISMATCH
    if record.state is State.COMPLETED:
        return Found.COMPLETED
    if record.state is State.UNSTORED:
        return Found.UNSTORED
    if record.state is State.IN_PROGRESS and not record.lease_expired:
        return Found.RUNNING
    # Unknown, reopened, or in progress past the lease: nobody owns the outcome.
    if record.state is not State.REOPENED and recovery != "reexecute":
        return Found.PENDING
    return Found.RERUN


def take_over(app_state: AppState, record: Record, lease: float) -> ClaimResult | None:
    """Claim a :attr:`Found.RERUN` record: one winner, the same row, so the same downstream
    keys. None for a loser (it finds the winner's record in progress on its next claim)."""
    assert record.claim_token is not None
    taken = app_state.store.take_over(record.scope, record.claim_token, lease=lease)
    return None if taken is None else dataclasses.replace(taken, taken_over=True)


def own(app_state: AppState, state: RequestState, claim: ClaimResult, lease: float) -> None:
    """The attempt holds the key: remember the token and keep renewing the lease."""
    assert state.scope is not None
    state.token = claim.token
    state.record = claim.record
    count_commits_from_now(state)  # a connection opened before the claim (a hook's)
    if claim.taken_over:
        # An earlier attempt of this operation may have had its effect: this one can never
        # prove that nothing happened. Releasing would delete the record, and the next retry
        # would run under a new one, with new downstream keys: a second charge. A failure of
        # a re-run (a refusal included) leaves the record unknown, the same row and keys.
        state.contacted = True
    state.watch = app_state.keeper.watch(claim.record, lease)
    if app_state.sessions is not None:
        app_state.attach_session(state)  # db.session carries the business writes
    emit(signals.taken_over if claim.taken_over else signals.claimed, state.scope)
    state.view_started = time.monotonic()


class CommitUncertain(StoreUnavailable):
    """The COMMIT of the result failed: it may have gone through before the answer was lost."""


def store_result(app_state: AppState, state: RequestState, snapshot: StoredResponse | None) -> bool:
    """Complete the record with ``snapshot`` (None: ran, not storable) and commit the business
    transaction with it, or roll that back when the token lost the record to a takeover.

    :returns: False when the lease was lost (the attempt's business writes rolled back).
    :raises StoreUnavailable: nothing was committed; the caller gives up.
    :raises CommitUncertain: the commit itself failed and may have gone through.
    """
    assert state.scope is not None and state.token is not None
    if state.session is not None:
        app_state.begin(state)  # the completion joins the session's transaction
    if state.reservation is not None:
        # An atomic claim's record: written once, completed, by the transaction holding it.
        stored = state.reservation.complete(snapshot)
    else:
        stored = app_state.store.complete(
            state.scope,
            state.token,
            snapshot,
            connection=state.connection,
            created_at=created_at(state),
        )
    if state.connection is not None:
        if stored:
            state.finished = True  # from here the commit is ours (see flow's atomic guard)
            try:
                state.commit()
            except sa.exc.SQLAlchemyError as exc:
                raise CommitUncertain(f"commit failed: {type(exc).__name__}") from exc
        else:
            with translate_errors():
                state.rollback()
    state.finished = True
    return stored


def give_up(app_state: AppState, state: RequestState, reason: str) -> None:
    """Roll the business transaction back; release the key only when the attempt provably
    committed nothing, else mark it ``unknown``."""
    assert state.scope is not None and state.token is not None
    state.finished = True
    stop_watching(app_state, state)
    if ended_outside(state) or committed_elsewhere(state):
        state.committed = True  # a driver committed below the commit guard
    note_replaced_session(app_state, state)
    rollback(state)
    store = app_state.store
    if state.releasable and state.atomic:
        # The claim rolled back with the business transaction: nothing is left to give back.
        emit(signals.released, state.scope, reason=reason)
        return
    try:
        if state.atomic:
            # Its rows may be committed without their answer: the key must stay taken.
            done = _record_unknown(app_state, state)
            signal = signals.unknown
        elif state.releasable:
            done = store.release(state.scope, state.token, created_at=created_at(state))
            signal = signals.released
        else:
            done = store.mark_unknown(state.scope, state.token, created_at=created_at(state))
            signal = signals.unknown
    except StoreUnavailable:
        # The lease runs out on its own; the record then counts as unknown, never free. A
        # store failure this request already reported (its completion) is not counted twice.
        if not state.store_failed:
            emit(signals.store_unavailable, state.scope, stage="give_up", reason=reason)
        return
    # The token no longer owns the record (a retry took it over): nothing changed here.
    emit(signal if done else signals.lease_lost, state.scope, reason=reason)


def note_ended_below(state: RequestState) -> bool:
    """The view ended its business transaction below SQLAlchemy (the driver's ``commit()`` or
    ``rollback()``, a ``COMMIT`` through a raw cursor): its rows did not commit with its
    answer (rolled back, or committed before it), so that answer must never be stored, and
    the attempt can never prove it committed nothing."""
    if not ended_outside(state):
        return False
    state.work_lost = state.committed = True
    return True


def note_replaced_session(app_state: AppState, state: RequestState) -> None:
    """``db.session.remove()`` in the view: its writes in the removed session are gone, and
    the fresh ``db.session`` it got is no business transaction of this attempt, so its
    commits are neither refused nor seen. The attempt can never prove it committed nothing.

    (A ``close()`` or a caught refusal keeps the same session, whose next transaction is
    still the business transaction, guarded: nothing more than ``work_lost``.)
    """
    if state.session is None or app_state.sessions is None:
        return
    if replaced(app_state.sessions.scoped, state.session):
        state.work_lost = state.crashed = state.committed = True
        try:
            roll_back_fresh(app_state.sessions.scoped)
        except sa.exc.SQLAlchemyError:
            log.warning("rollback of the view's fresh db.session failed", exc_info=True)


def _record_unknown(app_state: AppState, state: RequestState) -> bool:
    """Leave an atomic attempt that committed on its own ``unknown``: its record, if the commit
    published one (SQLite writes it at the claim), else a new one claimed for the purpose."""
    assert state.scope is not None and state.fingerprint is not None
    settings = app_state.settings
    ttl = getattr(state.options, "ttl", None) or settings.ttl
    store = app_state.store
    result = store.claim(state.scope, state.fingerprint, ttl=ttl, lease=settings.lease)
    token = result.token if result.claimed else state.token
    assert token is not None
    return store.mark_unknown(state.scope, token, created_at=result.record.created_at)


def created_at(state: RequestState) -> t.Any:
    # Tells PostgreSQL which partition holds the record (see ``Store.complete``).
    return None if state.record is None else state.record.created_at


def stop_watching(app_state: AppState, state: RequestState) -> None:
    if state.watch is not None:
        app_state.keeper.unwatch(state.watch)
        state.watch = None


def rollback(state: RequestState) -> None:
    # The session may hold a transaction (and SQLite's write lock) of its own before the
    # store's connection was ever asked for: roll it back too.
    if state.connection is not None or state.session is not None:
        try:
            state.rollback()
        except sa.exc.SQLAlchemyError as exc:
            log.warning("rollback of the business transaction failed", exc_info=redacted(exc))
