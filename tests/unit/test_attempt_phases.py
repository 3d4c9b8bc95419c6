"""The attempt's phase: the one transition table, and the moves the attempt makes along it when
its view or job ends. No database: the phase alone decides what happens next."""

from __future__ import annotations

import dataclasses
import datetime as dt
import itertools
import typing as t

import pytest

from flask_idem.attempt import (
    HOLDING,
    OUTCOMES,
    TRANSITIONS,
    Attempt,
    Failure,
    Found,
    IllegalTransition,
    Phase,
    advance,
    classify,
)
from flask_idem.core.errors import JobError
from flask_idem.core.key_digest import KeyDigest
from flask_idem.core.problem import Problem, RequestInProgress, StoreUnavailableProblem
from flask_idem.core.record import Record, Scope, State, StoredResponse
from flask_idem.state import AppState

SCOPE = Scope("alpha", "POST /payments", "k-1")
#: A store that keeps fingerprints as it is given them.
UNKEYED = KeyDigest()
LEGAL = [(source, target) for source, targets in TRANSITIONS.items() for target in targets]
ILLEGAL = [
    (source, target)
    for source, target in itertools.product(Phase, Phase)
    if target not in TRANSITIONS[source]
]


def _attempt(scope: Scope | None = SCOPE) -> Attempt:
    # The phase never reads the application's state: no store, no request.
    return Attempt(t.cast(AppState, None), scope, None)


def _running() -> Attempt:
    attempt = _attempt()
    attempt._move(Phase.RUNNING)  # what claiming the key does
    return attempt


def test_every_phase_has_a_row_in_the_table() -> None:
    assert set(TRANSITIONS) == set(Phase)


@pytest.mark.parametrize(("source", "target"), LEGAL, ids=lambda p: p.value)
def test_every_legal_move_is_made(source: Phase, target: Phase) -> None:
    assert advance(source, target) is target


@pytest.mark.parametrize(("source", "target"), ILLEGAL, ids=lambda p: p.value)
def test_every_other_move_raises(source: Phase, target: Phase) -> None:
    with pytest.raises(IllegalTransition, match=f"from {source.value} to {target.value}"):
        advance(source, target)


def test_no_phase_leads_back_and_finished_and_failed_are_ends() -> None:
    assert TRANSITIONS[Phase.FINISHED] == TRANSITIONS[Phase.FAILED] == frozenset()
    for source, target in LEGAL:
        assert source not in _reachable(target), f"{target.value} leads back to {source.value}"


def _reachable(phase: Phase) -> set[Phase]:
    found: set[Phase] = set()
    pending = list(TRANSITIONS[phase])
    while pending:
        nxt = pending.pop()
        if nxt not in found:
            found.add(nxt)
            pending.extend(TRANSITIONS[nxt])
    return found


def test_an_attempt_starts_claiming_with_a_scope_and_unclaimed_without() -> None:
    assert _attempt().phase is Phase.CLAIMING
    assert _attempt(None).phase is Phase.UNCLAIMED
    assert not _attempt().holding and not _attempt().guarding


def test_an_attempt_refuses_an_illegal_move_and_keeps_its_phase() -> None:
    attempt = _attempt(None)
    with pytest.raises(IllegalTransition):
        attempt._move(Phase.RUNNING)  # an unclaimed request never holds a key
    assert attempt.phase is Phase.UNCLAIMED


@pytest.mark.parametrize(
    ("end", "phase"),
    [
        (Attempt.mark_answered, Phase.ANSWERED),
        (Attempt.mark_refused, Phase.REFUSED),
        (Attempt.mark_crashed, Phase.CRASHED),
    ],
)
def test_the_end_of_a_claimed_view_is_its_phase(
    end: t.Callable[[Attempt], None], phase: Phase
) -> None:
    attempt = _running()
    assert attempt.holding and attempt.view_running and attempt.guarding
    end(attempt)
    assert attempt.phase is phase
    assert attempt.holding and not attempt.view_running and attempt.guarding
    assert attempt.refused is (phase is Phase.REFUSED)


def test_a_crash_is_never_undone_by_an_answer_seen_later() -> None:
    """An outer guard sees the answer the inner guard rendered from the crash (a 503): the
    attempt stays crashed."""
    attempt = _running()
    attempt.mark_crashed()
    attempt.mark_answered()
    attempt.mark_refused()
    assert attempt.phase is Phase.CRASHED


def test_an_exception_after_a_refusal_crashes_and_remembers_the_refusal() -> None:
    attempt = _running()
    attempt.mark_refused()
    attempt.mark_crashed()  # an after_request hook raised
    assert attempt.phase is Phase.CRASHED and attempt.refused


def test_an_exception_after_an_answer_is_a_crash() -> None:
    attempt = _running()
    attempt.mark_answered()
    attempt.mark_crashed()
    assert attempt.phase is Phase.CRASHED and not attempt.refused


@pytest.mark.parametrize("end", [Attempt.mark_refused, Attempt.mark_crashed])
@pytest.mark.parametrize("scope", [SCOPE, None], ids=["claiming", "unclaimed"])
def test_a_failure_without_the_key_rolls_back(
    end: t.Callable[[Attempt], None], scope: Scope | None
) -> None:
    attempt = _attempt(scope)
    end(attempt)
    assert attempt.phase is Phase.FAILED and not attempt.holding


@pytest.mark.parametrize("scope", [SCOPE, None], ids=["claiming", "unclaimed"])
def test_an_answer_without_the_key_changes_nothing(scope: Scope | None) -> None:
    attempt = _attempt(scope)
    before = attempt.phase
    attempt.mark_answered()
    assert attempt.phase is before


def test_lost_work_is_no_phase_the_view_runs_on() -> None:
    """The transaction ended under the view: its answer is refused at the end, but while it
    runs its session stays guarded (a rollback it tries next is still refused)."""
    attempt = _running()
    attempt.lose_work()
    assert attempt.work_lost and attempt.view_running and attempt.guarding


def test_the_holding_phases_are_those_between_the_claim_and_the_end() -> None:
    assert HOLDING == _reachable(Phase.RUNNING) - {Phase.FINISHED} | {Phase.RUNNING}


@pytest.mark.parametrize("row", list(OUTCOMES), ids=lambda row: row.value)
def test_every_outcome_has_an_http_and_a_job_answer(row: Found | Failure) -> None:
    outcome = OUTCOMES[row]
    problem = outcome.http()
    assert isinstance(problem, Problem) and problem.description == outcome.detail
    if outcome.job_error is None:
        # The store failed: a job raises the store's own error again, whatever its row says.
        assert isinstance(problem, StoreUnavailableProblem)
        return
    error = outcome.job(SCOPE, reason="a bad column", retry_after=7.0)
    assert isinstance(error, JobError)
    assert error.retry_after == (outcome.job_retry_after or 7.0)
    assert str(error).startswith("POST /payments message ") and SCOPE.key not in str(error)
    assert "{reason}" not in str(error)
    if outcome.log is not None:
        assert "a bad column" in str(error), "the job names what is wrong with the record"


def test_the_outcome_table_covers_every_found_record_neither_replayed_nor_taken_over() -> None:
    assert {row for row in OUTCOMES if isinstance(row, Found)} == set(Found) - {
        Found.COMPLETED,
        Found.RERUN,
    }
    assert set(Failure) <= set(OUTCOMES)
    assert isinstance(OUTCOMES[Found.RUNNING].http(), RequestInProgress)


def test_a_takeovers_loser_is_answered_as_in_progress_by_a_job_and_claims_again_in_a_view() -> None:
    overtaken, running = OUTCOMES[Found.OVERTAKEN], OUTCOMES[Found.RUNNING]
    assert overtaken.claims_again and not running.claims_again
    assert dataclasses.replace(overtaken, claims_again=False) == running
    assert not any(OUTCOMES[row].claims_again for row in OUTCOMES if row is not Found.OVERTAKEN)
    assert Found.OVERTAKEN not in {
        classify(_record(state), b"fp", "reexecute", UNKEYED) for state in State
    }


def test_a_refusal_code_around_the_guard_went_on_from_no_longer_stands() -> None:
    attempt = _running()
    attempt.mark_refused()
    attempt.went_on()  # a decorator above the guard caught it
    attempt.mark_crashed()
    assert attempt.phase is Phase.CRASHED and not attempt.refused


def _record(state: State, fingerprint: bytes = b"fp", **problems: str) -> Record:
    moment = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)
    response = StoredResponse(201, (), b"{}") if state is State.COMPLETED else None
    return Record(
        SCOPE, fingerprint, state, None, None, response, moment, None, moment, moment, **problems
    )


def test_a_damaged_record_is_neither_compared_nor_replayed() -> None:
    # Its fingerprint may be the damaged part: another request must not read it as a reuse.
    damaged = _record(State.COMPLETED, b"other", damaged="created_at holds no timestamp")
    assert classify(damaged, b"fp", "reexecute", UNKEYED) is Found.DAMAGED


def test_a_completed_record_that_cannot_be_decrypted_is_never_replayed() -> None:
    unreadable = _record(State.COMPLETED, unreadable="its key is not configured")
    assert classify(unreadable, b"fp", "fail", UNKEYED) is Found.UNREADABLE
    # Another request with the key is still a reuse, told as such.
    assert classify(unreadable, b"other", "fail", UNKEYED) is Found.MISMATCH
    assert classify(_record(State.COMPLETED), b"fp", "fail", UNKEYED) is Found.COMPLETED
