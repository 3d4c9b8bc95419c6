"""One execution of an operation, whoever runs it: a protected view (:mod:`.web.flow`) or a job
(:mod:`flask_idem.jobs`). Nothing here reads the request; an app context is enough.

An :class:`Attempt` holds what one execution knows of itself:

identity     the scope (tenant, endpoint, key), the options, the fingerprint;
ownership    the claim's token and record, its lease (``watch``);
transaction  the business transaction (``idem.connection()``, or ``db.session`` with ``db=``),
             and what happened to it outside flask_idem (``committed``, ``work_lost``);
phase        where it is (:class:`Phase`), moved only along :data:`TRANSITIONS`;
contacted    it declared contact with the outside world (``downstream_key()``...).

and does the three things both callers need: :meth:`~Attempt.claim` (or
:meth:`~Attempt.claim_atomic`, :meth:`~Attempt.take_over`), :meth:`~Attempt.complete` (record
the result, committed with the business transaction) and :meth:`~Attempt.give_up` (roll the
business transaction back, and release the key only when the attempt provably committed
nothing: it declared its effects, had not yet declared contact with the outside world, and
committed nothing itself; else mark it ``unknown``).

Both callers share these decisions, in the order of a run: :meth:`~Attempt.acquire` (claim,
or what the record holding the key answers: :meth:`~Attempt.meet`; a view waits for a running
owner, a job never does), :meth:`~Attempt.run_ended` (how the view or job ended: returned,
refused, crashed), :meth:`~Attempt.end_run` (then: give the key up, or record) and
:meth:`~Attempt.record_result` (record it, or name the failure); a run that claimed nothing has
its business transaction settled by :meth:`~Attempt.settle_unclaimed`. What a found record or a
failure after the run leads to is one table, :data:`OUTCOMES`: its event, its HTTP answer (a
view) and its job answer (a job). The callers translate: they render the row (a refusal of
:class:`Acquired`, a failure of :class:`Recording`), replay a completed record (the
:attr:`Acquired.replay`), or answer what the run produced. A run that ends without reaching
:meth:`~Attempt.end_run` (a view's teardown, a job's ``finally``) is decided by
:meth:`~Attempt.abandon`; a 4xx too large to store is given back by
:meth:`~Attempt.record_result`: the callers give no key up themselves.

A completed record and a re-run are met by :meth:`~Attempt.meet`, not rows of
:data:`OUTCOMES`, because neither is a refusal, and every row is one: constants a view renders
(a problem, its ``Retry-After``) and a job raises (its error, its countdown), with the event
they report. A completed record's answer is the record itself: a view rebuilds the stored
response (the stored headers it keeps, ``replay=``, ``Idempotency-Retention`` from the
record), a job decodes the stored JSON (and refuses one that is not); as a row it would fill
none of the columns, only name a branch each adapter keeps anyway. A re-run is no answer but
a takeover, a store call whose result is the case: the winner holds the key and runs (an
:class:`Acquired` with neither a replay nor a refusal), the loser is the row
:attr:`Found.OVERTAKEN`. So the table covers every case that refuses, and only those (a unit
test holds it to every other :class:`Found` and every :class:`Failure`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import logging
import time
import typing as t
import weakref

import sqlalchemy as sa
from blinker import NamedSignal
from flask import g

from . import events
from .commits import (
    committed_elsewhere,
    count_commits_from_now,
    count_ends_from_start,
    ended_outside,
)
from .core import signals
from .core.errors import (
    JobError,
    JobInProgress,
    JobKeyReused,
    JobOutcomePending,
    JobResultNotStored,
    JobResultUnreadable,
    StoreUnavailable,
)
from .core.idempotency_keys import key_hash
from .core.key_digest import KeyDigest
from .core.options import JobOptions, Recovery, ViewOptions
from .core.problem import (
    InternalError,
    KeyReused,
    KeyUsedElsewhere,
    OutcomePending,
    Problem,
    RequestInProgress,
    ResponseNotStored,
    StoredResponseUnreadable,
    StoreUnavailableProblem,
)
from .core.record import (
    STORABLE_STATUSES,
    ClaimResult,
    Record,
    Reservation,
    Scope,
    State,
    StoredResponse,
)
from .core.scopes import used_elsewhere
from .lease import Watch
from .observers import call_observer
from .sessions import replaced, roll_back_fresh
from .state import ATTEMPT_SLOT, SESSION_ATTEMPT, AppState, Trace, current_attempt
from .store import OneDeadline, Tally, redacted, resynchronise, translate_errors

log = logging.getLogger("flask_idem")

#: 409 ``request-in-progress`` hints this many seconds: the lease says when an owner counts
#: as gone, not when it finishes, and most requests finish within a second.
IN_FLIGHT_RETRY_AFTER = 1
#: The attribute of a refusal naming the attempt that raised it (:meth:`Attempt.note_refusal`).
_REFUSED_BY = "_flask_idem_refused_by"
#: Seconds between two claims of a view waiting for the owner of its key (``IDEMPOTENCY_WAIT``).
_WAIT_STEP = 0.05


class Phase(enum.Enum):
    """Where an attempt is. What happens next is decided by the phase, and by the few facts
    the phase does not carry (``work_lost``, ``rolled_back``, ``committed``, ``contacted``)."""

    #: It holds no key and will claim none: an unprotected view's or job's business
    #: transaction (``idem.connection()``), or a protected request that claims nothing.
    UNCLAIMED = "unclaimed"
    #: It knows its scope and has not taken the key (yet): claiming, or answered from the
    #: record that holds it (a replay, a 409, a 422).
    CLAIMING = "claiming"
    #: It holds the key; the view or job runs.
    RUNNING = "running"
    #: It holds the key; the view answered (returned, or raised an ``HTTPException``).
    ANSWERED = "answered"
    #: It holds the key; ``idem.refuse()`` ended the view or job: it did nothing.
    REFUSED = "refused"
    #: It holds the key; the view or job raised (whoever rendered the exception afterwards).
    CRASHED = "crashed"
    #: It holds no key and its view raised or refused: its business transaction rolls back.
    FAILED = "failed"
    #: Its result is recorded, or its key given up: nothing is left to decide.
    FINISHED = "finished"


#: The one transition table: every move an attempt may make. Any other raises.
TRANSITIONS: t.Final[t.Mapping[Phase, frozenset[Phase]]] = {
    Phase.UNCLAIMED: frozenset({Phase.FAILED}),
    Phase.CLAIMING: frozenset({Phase.RUNNING, Phase.FAILED}),
    # RUNNING -> FINISHED: a run given up before its end was told (:meth:`Attempt.abandon`).
    Phase.RUNNING: frozenset({Phase.ANSWERED, Phase.REFUSED, Phase.CRASHED, Phase.FINISHED}),
    # An exception after the answer (an ``after_request`` hook's) is a crash too.
    Phase.ANSWERED: frozenset({Phase.CRASHED, Phase.FINISHED}),
    Phase.REFUSED: frozenset({Phase.CRASHED, Phase.FINISHED}),
    Phase.CRASHED: frozenset({Phase.FINISHED}),
    Phase.FAILED: frozenset(),
    Phase.FINISHED: frozenset(),
}

#: The phases in which the attempt holds the key and its outcome is still open.
HOLDING: t.Final = frozenset({Phase.RUNNING, Phase.ANSWERED, Phase.REFUSED, Phase.CRASHED})


class IllegalTransition(RuntimeError):
    """A move :data:`TRANSITIONS` does not allow: a bug in flask_idem, never the caller's."""


def advance(phase: Phase, to: Phase) -> Phase:
    """``to``, when :data:`TRANSITIONS` allows the move from ``phase``.

    :raises IllegalTransition: it does not.
    """
    if to not in TRANSITIONS[phase]:
        raise IllegalTransition(f"an attempt cannot move from {phase.value} to {to.value}")
    return to


# -- what a found record or a failure leads to ------------------------------------------------


class Found(enum.Enum):
    """What an existing record means for a new attempt with the same key."""

    #: The row cannot be read at all: neither replayed, compared nor taken over, until an
    #: operator repairs or deletes it.
    DAMAGED = "damaged"
    #: The key came back with another request: refuse (a caller bug, never a retry).
    MISMATCH = "mismatch"
    #: An account-wide key came back on another endpoint: refuse (never that one's answer).
    ELSEWHERE = "elsewhere"
    #: The operation completed: replay its stored result.
    COMPLETED = "completed"
    #: The operation completed but its stored result cannot be decrypted here: never a replay
    #: of garbage, never a second run; wait for the key to be configured.
    UNREADABLE = "unreadable"
    #: The operation ran but its result could not be stored: refuse, never run it again.
    UNSTORED = "unstored"
    #: Its owner is alive (the lease is held): wait, or tell the caller to retry later.
    RUNNING = "running"
    #: Nobody owns the outcome and ``recovery="fail"``: wait for a reconciler or an operator.
    PENDING = "pending"
    #: Nobody owns the outcome and the attempt may run it again as the same operation (a
    #: ``reexecute`` view or job, or a reopened record: an operator's release or a
    #: reconciler's "not happened"): take it over. (:meth:`Attempt.meet` returns it only to
    #: the winner of the takeover.)
    RERUN = "rerun"
    #: A re-run another attempt took over first (never :func:`classify`'s: what
    #: :meth:`Attempt.meet` says to a takeover's loser): the winner runs it now.
    OVERTAKEN = "overtaken"


class Failure(enum.Enum):
    """How a run that held the key failed to be recorded."""

    #: The lease expired and a re-run took the record over: its writes rolled back.
    LEASE_LOST = "lease_lost"
    #: Its business transaction ended before its answer, not through flask_idem (closed,
    #: removed, ended below SQLAlchemy): its answer does not stand for what committed.
    WORK_LOST = "work_lost"
    #: The store failed while committing the result: it may or may not be recorded.
    COMMIT_UNCERTAIN = "commit_uncertain"
    #: The store failed before the commit, and the attempt provably committed nothing.
    STORE_FAILED_UNCHANGED = "store_failed_unchanged"
    #: The store failed before the commit, after what may have had an effect.
    STORE_FAILED_UNKNOWN = "store_failed_unknown"


def classify(record: Record, digest: bytes, recovery: Recovery, keys: KeyDigest) -> Found:
    """The decision for an attempt whose claim found ``record``.

    :param digest: the request's SHA-256 fingerprint; ``keys`` compares it with the stored one
        (keyed with the secret the record's key was digested with).
    """
    if record.damaged is not None:
        return Found.DAMAGED
    if not keys.same_request(record, digest):
        stored = keys.as_stored(record, digest)
        elsewhere = stored is not None and used_elsewhere(record, stored)
        return Found.ELSEWHERE if elsewhere else Found.MISMATCH
    if record.state is State.COMPLETED:
        return Found.UNREADABLE if record.unreadable is not None else Found.COMPLETED
    if record.state is State.UNSTORED:
        return Found.UNSTORED
    if record.state is State.IN_PROGRESS and not record.lease_expired:
        return Found.RUNNING
    # Unknown, reopened, or in progress past the lease: nobody owns the outcome.
    if record.state is not State.REOPENED and recovery != "reexecute":
        return Found.PENDING
    return Found.RERUN


@dataclasses.dataclass(frozen=True, kw_only=True)
class Outcome:
    """One row of the outcome table: the event, the log record, the HTTP answer and the job
    answer."""

    #: A view's answer: the problem and its detail.
    problem: type[Problem]
    detail: str
    #: The ``Retry-After`` seconds the problem hints (None: none).
    retry_after: int | None = None
    #: The transition it is (None: no event; giving the key up reports its own).
    signal: NamedSignal | None = None
    #: The event carries the found record's state.
    with_state: bool = False
    #: A job's answer: the error it raises (None: the store's own error, raised again) and
    #: what it says of the message (``{reason}``: what is wrong with the record).
    job_error: type[JobError] | None = None
    job_says: str = ""
    #: A job's countdown whatever the lease says (an operator's repair takes its time).
    job_retry_after: float | None = None
    #: An error logged with the record's reason (``%s``), for a record nobody can act on
    #: until an operator does.
    log: str | None = None
    #: A view claims again at once instead of answering (no event): it then finds what the
    #: winner left, its record in progress, completed or given back. A job answers the row.
    claims_again: bool = False
    #: The run's answer may be recorded after all (a commit that failed may have gone
    #: through): a view's problem makes no promise that no retry gets it back.
    may_be_recorded: bool = False

    def http(self) -> Problem:
        """The problem a view answers."""
        if self.retry_after is None:
            return self.problem(self.detail)
        # The problems that hint a retry take it as a keyword (see :mod:`.core.problem`).
        hinting = t.cast("t.Callable[..., Problem]", self.problem)
        return hinting(self.detail, retry_after=self.retry_after)

    def job(
        self, scope: Scope, *, reason: str | None = None, retry_after: float | None = None
    ) -> JobError:
        """The error a job raises for the message of ``scope``."""
        assert self.job_error is not None
        says = self.job_says if reason is None else self.job_says.format(reason=reason)
        message = f"{scope.endpoint} message {key_hash(scope)} {says}"
        if self.job_retry_after is not None:
            retry_after = self.job_retry_after
        if retry_after is None:
            return self.job_error(message)
        return self.job_error(message, retry_after=retry_after)

    def job_for(self, record: Record) -> JobError:
        """The error a job raises for the record its claim found: what is wrong with the
        record, and a countdown of the record's lease (an owner keeps it at least that long;
        a second at the least)."""
        return self.job(
            record.scope, reason=reason(record), retry_after=max(1.0, record.lease_remaining)
        )


class Ending(enum.Enum):
    """What the end of a run that held the key leads to (:meth:`Attempt.end_run`)."""

    #: Record its result (:meth:`Attempt.record_result`).
    RECORD = "record"
    #: The key is given up; the run's own answer (an error, a refusal, a never-stored status)
    #: goes out unstored, or the job's exception is raised again.
    GIVEN_UP = "given_up"
    #: The key is given up, and the run's answer does not stand for what committed (its
    #: business transaction ended under it): the row :attr:`Failure.WORK_LOST` answers.
    WORK_LOST = "work_lost"


@dataclasses.dataclass(frozen=True)
class Recording:
    """What recording a run's result came to (:meth:`Attempt.record_result`)."""

    #: The result is recorded (as unstored, when there was no snapshot to store). False with
    #: no failure: the run's answer goes out unrecorded, its key given back (a 4xx too large
    #: to store) or kept taken (the store failed after effects outside a business transaction).
    recorded: bool
    #: The row of :data:`OUTCOMES` that answers instead of the run (None: the run's answer
    #: goes out, recorded or not).
    failure: Failure | None = None
    #: The store's error, when the store failed (a job raises it again).
    error: StoreUnavailable | None = None


def reason(record: Record) -> str | None:
    """What is wrong with a record that cannot be acted on (damaged, or unreadable here)."""
    return record.damaged if record.damaged is not None else record.unreadable


_IN_PROGRESS = "A request with this idempotency key is still being processed; retry later."
_UNREADABLE = (
    "The original request completed, but its stored response cannot be read on this "
    "server; it was not executed again. Retry later with the same key."
)

_RUNNING = Outcome(
    signal=signals.conflict,
    problem=RequestInProgress,
    detail=_IN_PROGRESS,
    retry_after=IN_FLIGHT_RETRY_AFTER,
    job_error=JobInProgress,
    job_says="is being run by another worker",
)

#: What a found record that is neither replayed nor taken over, and a failure after the run,
#: lead to. (A completed record is replayed by the caller; a re-run is taken over by
#: :meth:`Attempt.meet`: why neither is a row, see the module's docstring.)
OUTCOMES: t.Final[t.Mapping[Found | Failure, Outcome]] = {
    Found.DAMAGED: Outcome(
        problem=StoredResponseUnreadable,
        detail=_UNREADABLE,
        job_error=JobResultUnreadable,
        job_says=(
            "has a stored record that is damaged ({reason}); redeliver once an operator has "
            "repaired or deleted it"
        ),
        job_retry_after=30,
        log="stored record damaged: %s",
    ),
    Found.UNREADABLE: Outcome(
        problem=StoredResponseUnreadable,
        detail=_UNREADABLE,
        job_error=JobResultUnreadable,
        job_says=(
            "ran, but its stored result cannot be decrypted here ({reason}); redeliver once "
            "the key is configured"
        ),
        job_retry_after=30,
        log="stored result unreadable: %s",
    ),
    Found.MISMATCH: Outcome(
        signal=signals.mismatch,
        with_state=True,
        problem=KeyReused,
        detail=(
            "This idempotency key was already used with a different request; "
            "use a new key for a new operation."
        ),
        job_error=JobKeyReused,
        job_says="was already used with other arguments",
    ),
    Found.ELSEWHERE: Outcome(
        signal=signals.mismatch,
        with_state=True,
        problem=KeyUsedElsewhere,
        detail=(
            "This idempotency key was already used on another endpoint; a key names one "
            "operation of your account: use a new key for a new operation."
        ),
        job_error=JobKeyReused,
        job_says="was already used on another endpoint",
    ),
    Found.UNSTORED: Outcome(
        signal=signals.not_stored,
        problem=ResponseNotStored,
        detail=(
            "The original request ran and completed, but its response was streamed or larger "
            "than this endpoint stores (IDEMPOTENCY_MAX_BODY), so it cannot be replayed; it "
            "was not executed again. Look its result up instead of retrying: a new key would "
            "run the operation a second time."
        ),
        job_error=JobResultNotStored,
        job_says="ran, but its result was not storable",
    ),
    Found.RUNNING: _RUNNING,
    # The winner of the takeover is running it: a job is told so; a view claims again, and
    # gets what the winner left (a wait and 409 while it runs, its replay once it completed).
    Found.OVERTAKEN: dataclasses.replace(_RUNNING, claims_again=True),
    Found.PENDING: Outcome(
        signal=signals.pending,
        with_state=True,
        problem=OutcomePending,
        detail=(
            "The original request may have taken effect but its outcome is not known; it "
            "will not be executed again automatically and is being reconciled."
        ),
        job_error=JobOutcomePending,
        job_says="may have run but its outcome is unknown",
    ),
    Failure.LEASE_LOST: Outcome(
        signal=signals.lease_lost,
        problem=RequestInProgress,
        detail=(
            "This request lost its claim on the idempotency key to a retry; retry to get the "
            "result."
        ),
        retry_after=IN_FLIGHT_RETRY_AFTER,
        job_error=JobInProgress,
        job_says="lost its lease to a re-run; its writes were rolled back",
    ),
    Failure.WORK_LOST: Outcome(
        problem=InternalError,
        detail=(
            "The request's database transaction ended before the server answered, so its "
            "work was not recorded. "
        ),
        job_error=JobOutcomePending,
        job_says=(
            "ended its database transaction itself: its result was not recorded and its "
            "effect is unknown"
        ),
    ),
    Failure.COMMIT_UNCERTAIN: Outcome(
        problem=StoreUnavailableProblem,
        detail=(
            "The database failed while committing the result, which may or may not have been "
            "recorded. Retry with the same key: the retry replays it or finishes the operation, "
            "never runs it twice."
        ),
        may_be_recorded=True,
    ),
    Failure.STORE_FAILED_UNCHANGED: Outcome(
        problem=StoreUnavailableProblem,
        detail=(
            "The idempotency store failed before the result was committed; nothing was "
            "changed. Retry with the same key."
        ),
    ),
    Failure.STORE_FAILED_UNKNOWN: Outcome(
        problem=StoreUnavailableProblem,
        detail=(
            "The idempotency store failed before the result was recorded. The operation may "
            "have taken effect outside this service; retry with the same key, never a new one."
        ),
    ),
}


@dataclasses.dataclass(frozen=True)
class Acquired:
    """What a claim came to (:meth:`Attempt.acquire`).

    The attempt runs (neither ``replay`` nor ``refusal``: it holds the key), replays, or is
    refused.
    """

    #: The completed record whose result answers (its ``replayed`` event sent).
    replay: Record | None = None
    #: The row of :data:`OUTCOMES` that answers instead of a run (its event sent).
    refusal: Outcome | None = None
    #: The record the refusal is about (None: a duplicate held an atomic view's scope).
    record: Record | None = None
    #: The key was free and a new record holds it now (a takeover is no new key): what a
    #: tenant's key limit counts.
    new: bool = False


class CommitUncertain(StoreUnavailable):
    """The COMMIT of the result failed: it may have gone through before the answer was lost."""


# -- the attempt -----------------------------------------------------------------------------


@dataclasses.dataclass(eq=False)
class Attempt:
    """One protected request's (or job's) execution, on ``flask.g`` while it runs (``flask.g``
    lives on the app context, so ``idem.downstream_key()`` and ``idem.connection()`` work in
    a job as in a view)."""

    app_state: AppState
    scope: Scope | None
    options: ViewOptions | JobOptions | None
    #: What to echo in the key header when there is no valid key (see ``echo_of_invalid``);
    #: :attr:`echoed_key` is what its answers echo.
    echo: str | None = None
    #: The request's fingerprint, once computed (events carry a prefix of it).
    fingerprint: bytes | None = None
    #: The endpoint the request runs (``POST /v1/payments``): what events and spans name,
    #: also when the scope's endpoint column does not say it (account-wide: ``*``) or says
    #: more (a principal's). None: the scope's, principal left out (a job's).
    endpoint: str | None = None
    phase: Phase = dataclasses.field(init=False)
    token: str | None = None
    #: The record this attempt owns (claimed or taken over).
    record: Record | None = None
    #: Set when ``record`` is reserved, not written yet (see :attr:`ClaimResult.reservation`).
    reservation: Reservation | None = None
    watch: Watch | None = None
    connection: sa.Connection | None = None
    #: The Flask-SQLAlchemy session whose transaction ``connection`` is (``db=``), if any.
    session: t.Any = None
    #: The view or job declared contact with the outside world (``downstream_key()``...).
    contacted: bool = False
    #: The business transaction ended before the view answered, and not through flask_idem
    #: (``db.session.close()``, ``remove()``, a rollback whose refusal the view caught): the
    #: view's writes are gone, so its answer must never be stored or sent.
    work_lost: bool = False
    #: The status of the ``HTTPException`` the view raised as its answer, if it did.
    raised_status: int | None = None
    #: The business transaction was rolled back while the attempt held the key, by the view
    #: or a hook, not by flask_idem (``idem.connection().rollback()``, a hook's
    #: ``db.session.rollback()``): what it wrote before is gone, so a success answer does not
    #: stand for what committed and is never stored (an error answer is).
    rolled_back: bool = False
    #: The attempt's business transaction was committed, or ended by a statement of the view's
    #: own (``COMMIT``, ``END``), outside flask_idem: it can never prove it committed nothing.
    committed: bool = False
    #: A store failure was already reported for this attempt (events count it once).
    store_failed: bool = False
    #: When the attempt started (``time.monotonic()``): events of the claim measure from here.
    started: float = dataclasses.field(default_factory=time.monotonic)
    #: When the attempt got the key: events ending the attempt measure the view from here.
    view_started: float | None = None
    #: The tracer's view of this attempt, when one follows it (:meth:`start_trace`).
    trace: Trace | None = None
    #: Its claim is made by the outer guard around the whole view function (blueprint-wide or
    #: app-wide protection), not by a view's own ``@idem.idempotent``: a guard of the view's
    #: found under it refuses to run (the decorators between them would come too late).
    claimed_around_view: bool = False
    #: The driver-level commits this attempt's context made on the store's engine, counted
    #: from its claim (:mod:`.store.commit_count`).
    tally: Tally | None = None
    #: How its view or job ended: the phase it left :attr:`Phase.RUNNING` for (``ANSWERED``,
    #: ``REFUSED``, ``CRASHED``), or ``CRASHED`` once code around the guard went on from its
    #: refusal (:meth:`went_on`); None while it runs, and for a run abandoned before its end
    #: was told (:meth:`run_ended`). A later move (an exception after the answer) keeps it.
    ended: Phase | None = dataclasses.field(default=None, init=False)
    #: True while flask_idem itself commits or rolls the business transaction back: the
    #: commit guard and the session's listeners leave that to it.
    _settling: bool = dataclasses.field(default=False, init=False)

    def __post_init__(self) -> None:
        self.phase = Phase.UNCLAIMED if self.scope is None else Phase.CLAIMING

    # -- the phase ---------------------------------------------------------------------

    def _move(self, to: Phase) -> None:
        if self.phase is Phase.RUNNING and to is not Phase.FINISHED:
            self.ended = to
        self.phase = advance(self.phase, to)

    @property
    def holding(self) -> bool:
        """It holds the key and its outcome is still open."""
        return self.phase in HOLDING

    @property
    def view_running(self) -> bool:
        """It holds the key and its view or job has not ended yet."""
        return self.phase is Phase.RUNNING

    @property
    def guarding(self) -> bool:
        """Its business transaction is the view's or job's to write, not to end: the commit
        guard and the session's listeners watch it (not flask_idem's own commit or rollback)."""
        return self.phase in HOLDING and not self._settling

    @property
    def claimed(self) -> bool:
        """It took the key at some point (it may have given it up since)."""
        return self.token is not None

    @property
    def refused(self) -> bool:
        """``idem.refuse()`` ended its view or job, which therefore did nothing."""
        return self.ended is Phase.REFUSED

    def mark_answered(self, raised: int | None = None) -> None:
        """The view returned, or raised an ``HTTPException`` with status ``raised``."""
        if self.phase is Phase.RUNNING:
            self._move(Phase.ANSWERED)
            self.raised_status = raised

    def mark_rendered(self, status: int) -> None:
        """The answer that goes out has ``status``. An error handler that turned the view's
        raised ``HTTPException`` (a 400 of ``request.get_json()``) into a server error
        (``errorhandler(Exception)`` answering 500) answered a failure, not the view: a crash,
        never stored and replayed as if the operation had answered it."""
        raised = self.raised_status
        if self.phase is Phase.ANSWERED and raised is not None and raised < 500 <= status:
            self._move(Phase.CRASHED)

    def mark_refused(self) -> None:
        """``idem.refuse()`` ended the view or job."""
        if self.phase is Phase.RUNNING:
            self._move(Phase.REFUSED)
        elif self.phase in (Phase.UNCLAIMED, Phase.CLAIMING):
            self._move(Phase.FAILED)

    def went_on(self) -> None:
        """Code around the guard (a decorator above ``@idem.idempotent``) went on after the
        view: when the view refused, that code caught the refusal and returned, aborted or
        raised on its own, after a call nobody declared, perhaps. Then the refusal is an
        exception someone else rendered: ``REFUSED -> CRASHED``, given up, and no longer
        proof that the attempt did nothing, so it no longer gives the key back. (Its answer is
        never stored: it answers for code around the operation, not for the operation.) An
        exception after the answer (an ``after_request`` hook) is no such thing: it leaves the
        refusal standing (:meth:`mark_crashed`)."""
        if self.phase is Phase.REFUSED:
            self._move(Phase.CRASHED)
            self.ended = Phase.CRASHED

    def mark_crashed(self) -> None:
        """The view or job raised, or an exception followed its answer (never undone: a
        later answer of the same failure, seen by an outer guard, is no success)."""
        if self.phase in (Phase.RUNNING, Phase.ANSWERED, Phase.REFUSED):
            self._move(Phase.CRASHED)
        elif self.phase in (Phase.UNCLAIMED, Phase.CLAIMING):
            self._move(Phase.FAILED)

    def note_refusal(self, refusal: BaseException) -> None:
        """``idem.refuse()`` raises ``refusal`` in this attempt's run: mark it as this
        attempt's (a weak reference, so that an exception kept by the application keeps no
        attempt alive). A refusal marked by another attempt, a job run inline inside this run,
        that escapes is this run's crash (:meth:`run_ended`): the run may have had effects
        before it called the job, so it never gives its key back."""
        setattr(refusal, _REFUSED_BY, weakref.ref(self))

    def run_ended(
        self,
        error: BaseException | None = None,
        *,
        refused: bool = False,
        answered: bool = False,
        status: int | None = None,
    ) -> None:
        """Tell the attempt how its view or job ended: one call for both adapters.

        :param error: what it raised; None: it returned. Any exception that is neither a
            refusal nor an answer is a crash, also when an error handler renders it afterwards.
        :param refused: ``error`` is the adapter's refusal (``idem.refuse()``'s exception):
            the run's own, unless another attempt marked it (:meth:`note_refusal`); one raised
            where no attempt was current (a helper thread, a ``JobRefused`` raised directly)
            is the run's.
        :param answered: ``error`` is the view's answer (an ``HTTPException``).
        :param status: that answer's status.
        """
        if refused:
            owner = getattr(error, _REFUSED_BY, None)
            if owner is None or owner() is self:
                self.mark_refused()
                return
        self.went_on()
        if error is None or answered:
            self.mark_answered(raised=status)
        else:
            self.mark_crashed()
            self.trace_failure(error)

    def contact(self) -> None:
        """The view or job is about to contact the outside world (``downstream_key()``,
        ``side_effect()``): from now on a failure never gives the key back."""
        self.contacted = True

    def note_committed(self) -> None:
        """Its business transaction committed (or may have) outside flask_idem: what it wrote
        stays whatever happens next, so the key is never given back."""
        self.committed = True

    def note_rolled_back(self) -> None:
        """Its business transaction was rolled back outside flask_idem (see
        :attr:`rolled_back`)."""
        self.rolled_back = True

    def lose_work(self) -> None:
        """Its business transaction ended under the view, not through flask_idem."""
        self.work_lost = True

    def _finish(self) -> None:
        if self.phase is not Phase.FINISHED:
            self._move(Phase.FINISHED)

    # -- on flask.g --------------------------------------------------------------------

    @classmethod
    def current(cls) -> Attempt | None:
        """The attempt of this context, or None."""
        return current_attempt()

    @classmethod
    def ensure(cls) -> Attempt:
        """The context's attempt, created unprotected (for ``idem.connection()`` in any view)."""
        attempt = cls.current()
        if attempt is None:
            attempt = cls(AppState.current(), scope=None, options=None)
            attempt.attach()
        return attempt

    def attach(self) -> None:
        setattr(g, ATTEMPT_SLOT, self)

    @staticmethod
    def detach() -> None:
        g.pop(ATTEMPT_SLOT, None)

    # -- events and the trace ----------------------------------------------------------

    def emit(self, signal: NamedSignal, **extra: t.Any) -> None:
        """Send ``signal`` for this attempt: its duration from the attempt's own clock (the
        claim's start, or the view's once it holds the key), its fingerprint's prefix."""
        assert self.scope is not None
        since = self.started if self.view_started is None else self.view_started
        events.emit(
            signal,
            self.scope,
            fingerprint=self.fingerprint,
            since=since,
            endpoint=self.endpoint,
            **extra,
        )

    def emit_found(self, found: Found | Failure, record: Record | None = None) -> Outcome:
        """Send the event (and log the error) of ``found``'s row of :data:`OUTCOMES`, and
        return the row."""
        outcome = OUTCOMES[found]
        if outcome.log is not None:
            assert record is not None
            log.error(outcome.log, reason(record), extra={"key_hash": key_hash(record.scope)})
        if outcome.signal is not None:
            if outcome.with_state:
                assert record is not None
                self.emit(outcome.signal, state=record.state.value)
            else:
                self.emit(outcome.signal)
        return outcome

    def start_trace(self) -> None:
        """Follow the attempt in the tracer, when there is one."""
        tracer = self.app_state.tracer
        if tracer is not None:

            def begin() -> None:
                self.trace = tracer(self)

            call_observer("flask_idem tracer: begin", begin)

    def trace_completing(self) -> None:
        """The view or job is over; tell the trace, if any."""
        if self.trace is not None:
            self._tell_trace("completing", self.trace.completing)

    def trace_failure(self, error: BaseException) -> None:
        """The view or job raised ``error``; tell the trace, if any."""
        if self.trace is not None:
            trace = self.trace
            self._tell_trace("failed", lambda: trace.failed(error))

    def _tell_trace(self, moment: str, call: t.Callable[[], None]) -> None:
        """A trace that raises never changes the attempt (see :mod:`flask_idem.observers`)."""
        call_observer(f"flask_idem tracer: {moment}", call)

    # -- the business transaction ------------------------------------------------------

    def begin(self) -> sa.Connection:
        """The business transaction, opened on first use: the connection of the application's
        ``db.session`` (with ``db=``), else one of its own on the store."""
        app_state = self.app_state
        if app_state.sessions is not None:
            # Also for a connection taken over from an earlier attempt (a hook's
            # idem.connection()): the session's guards must see this attempt.
            session = self.attach_session()
            if self.connection is None:
                with translate_errors():
                    self.connection = session.connection(
                        bind_arguments={"bind": app_state.store.engine}
                    )
        elif self.connection is None:
            self.connection = app_state.store.begin()
            count_ends_from_start(self.connection)
        if not (self.connection.closed or self.connection.invalidated):
            # A hook's COMMIT sent as SQL, which psycopg2 does not see.
            resynchronise(self.connection.connection.dbapi_connection)
        return self.connection

    def attach_session(self) -> t.Any:
        """Make ``db.session`` the attempt's business transaction without opening it yet:
        SQLite has one writer, so its lock must not be taken before the view writes (a
        provider's own connection to the same file would wait for it)."""
        assert self.app_state.sessions is not None
        if self.session is None:
            self.session = self.app_state.sessions.scoped()
        # Also for a session taken over from an earlier attempt (a hook's idem.connection()):
        # the commit guard must see the claimed attempt, not the hook's unprotected one.
        self.session.info[SESSION_ATTEMPT] = self
        return self.session

    def flush(self) -> None:
        """Write the session's pending ORM changes into the business transaction."""
        if self.session is not None:
            self.session.flush()

    def commit(self) -> None:
        """Commit the business transaction (through the session: pending changes included)."""
        self._settle("commit")

    def rollback(self) -> None:
        """Roll the business transaction back (through the session, if any)."""
        self._settle("rollback")

    def _settle(self, how: str) -> None:
        target = self.session if self.session is not None else self.connection
        if target is None:
            return
        self._settling = True
        try:
            getattr(target, how)()
        finally:
            self._settling = False
        if target is self.session:
            # Settled, the session let its connection go: the next begin() asks it for a new
            # one (an atomic claim that waited for a duplicate claims again). A failed settle
            # keeps it: what the failure means is read off it (a commit that may have landed).
            self.connection = None

    def rollback_quietly(self) -> None:
        """Roll back, logging a failure. The session may hold a transaction (and SQLite's
        write lock) of its own before the store's connection was ever asked for: it too."""
        if self.connection is not None or self.session is not None:
            try:
                self.rollback()
            except sa.exc.SQLAlchemyError as exc:
                log.warning("rollback of the business transaction failed", exc_info=redacted(exc))

    def close(self) -> None:
        """End the attempt's use of the business transaction. A session's connection is the
        session's to close (Flask-SQLAlchemy removes the session at app context teardown)."""
        try:
            if self.session is not None:
                self.session.info.pop(SESSION_ATTEMPT, None)
                if self.session.in_transaction():
                    self.rollback()
            elif self.connection is not None:
                self.connection.close()
        finally:
            if self.trace is not None:
                self._tell_trace("end", self.trace.end)
                self.trace = None

    def settle_unclaimed(self, status: int | None = None) -> None:
        """Settle the business transaction of a run that claimed nothing as a claimed one's.

        Rolled back after an exception or a refusal, and on a protected view after a status
        that is never stored; committed otherwise (the view or job is written for flask_idem
        to commit it).

        :param status: the status of a view's answer; None: a job's end.
        :raises StoreUnavailable: the commit failed (nothing was committed).
        """
        if self.connection is None and self.session is None:
            return
        never_stored = status in self.app_state.settings.never_store
        if self.phase is Phase.FAILED or (self.options is not None and never_stored):
            self.rollback_quietly()
            return
        with translate_errors():
            self.commit()

    @property
    def releasable(self) -> bool:
        """Whether a failure now provably committed nothing, so the key may be given back."""
        if self.committed:
            return False  # whatever it committed stays: a re-run would commit it again
        if self.atomic:
            return True  # the claim itself rolls back with everything else
        if self.contacted or self.options is None:
            return False
        return self.refused or self.options.release_before_contact

    @property
    def crash_advice(self) -> str:
        """What the client of a failed run should do next, from what the attempt may have
        done (a 500's detail)."""
        if not self.claimed:
            return "Retry with the same key."  # it failed answering from the record
        if self.releasable:
            return "Nothing was recorded for this key; retry with the same key."
        return "It may have had an effect; retry with the same key, never a new one."

    @property
    def echoed_key(self) -> str | None:
        """The key its answers echo: the one it claims with, else the request's invalid key
        as it may be echoed (:attr:`echo`)."""
        return self.scope.key if self.scope is not None else self.echo

    @property
    def ttl(self) -> float:
        """Seconds the key lives: the view's or job's ``ttl=``, else ``IDEMPOTENCY_TTL``."""
        return getattr(self.options, "ttl", None) or self.app_state.settings.ttl

    @property
    def lease(self) -> float:
        """Seconds before an owner that stopped renewing counts as gone: a job's ``lease=``,
        else ``IDEMPOTENCY_LEASE`` (a view's lease is the application's)."""
        return getattr(self.options, "lease", None) or self.app_state.settings.lease

    @property
    def in_transaction(self) -> bool:
        """Its business transaction is open (a rollback ends it; the next statement opens
        another)."""
        if self.session is not None:
            return bool(self.session.in_transaction())
        return self.connection is not None and self.connection.in_transaction()

    @property
    def atomic(self) -> bool:
        """The claim lives in the business transaction (``@idem.idempotent(atomic=True)``)."""
        return bool(getattr(self.options, "atomic", False))

    @property
    def created_at(self) -> t.Any:
        # Tells PostgreSQL which partition holds the record (see ``Store.complete``).
        return None if self.record is None else self.record.created_at

    # -- claim ---------------------------------------------------------------------------

    def claim(self, digest: bytes) -> Record | None:
        """Claim the key for :attr:`ttl`, under :attr:`lease`: None when the attempt now holds
        it, else the record holding it.

        :raises StoreUnavailable: the store failed (reported and answered by the adapter).
        """
        assert self.scope is not None
        self.fingerprint = digest
        ttl, lease = self.ttl, self.lease
        try:
            result = self.app_state.store.claim(self.scope, digest, ttl=ttl, lease=lease)
        except StoreUnavailable as exc:
            if exc.unanswered_claim is not None:
                # Nothing runs after this failure: a claim that lands later is given back.
                self.app_state.keeper.give_back(*exc.unanswered_claim, ttl=ttl, lease=lease)
            raise
        if not result.claimed:
            return result.record
        self._own(result)
        return None

    def take_over(self, record: Record) -> bool:
        """Claim a :attr:`Found.RERUN` record: one winner, the same row, so the same
        downstream keys. False for a loser (:attr:`Found.OVERTAKEN`)."""
        assert record.claim_token is not None
        taken = self.app_state.store.take_over(record.scope, record.claim_token, lease=self.lease)
        if taken is None:
            return False
        self._own(dataclasses.replace(taken, taken_over=True))
        return True

    def claim_atomic(self, digest: bytes) -> ClaimResult | None:
        """The claim of an atomic view, inside the business transaction it opens: the
        result (claimed: the attempt holds the key; else the record holding it, after the
        empty transaction is rolled back), or None when a duplicate holds the scope."""
        assert self.scope is not None
        self.fingerprint = digest
        store = self.app_state.store
        with OneDeadline():  # the checkout and the claim: one wait for the server
            connection = self.begin()
            completed = store.completed_before_claim(self.scope, connection)
            if completed is not None:
                return ClaimResult(completed, claimed=False)  # a replay: no transaction
            result = store.claim_atomic(connection, self.scope, digest, ttl=self.ttl)
        if result is not None and result.claimed:
            self.token, self.record = result.token, result.record
            self.scope = result.record.scope  # with the digest its record carries
            self.reservation = result.reservation
            count_commits_from_now(self)  # a connection opened before the claim
            self._move(Phase.RUNNING)
            self.emit(signals.claimed)
            self.view_started = time.monotonic()
        return result

    def _own(self, claim: ClaimResult) -> None:
        """The attempt holds the key: remember the token and keep renewing the lease."""
        assert self.scope is not None
        self.token = claim.token
        self.record = claim.record
        # With the digest its record carries: every later write targets that row.
        self.scope = claim.record.scope
        count_commits_from_now(self)  # a connection opened before the claim (a hook's)
        if claim.taken_over:
            # An earlier attempt of this operation may have had its effect: this one can never
            # prove that nothing happened. Releasing would delete the record, and the next retry
            # would run under a new one, with new downstream keys: a second charge. A failure of
            # a re-run (a refusal included) leaves the record unknown, the same row and keys.
            self.contacted = True
        # Holding from here: if what follows raises, abandon() gives the key up.
        self._move(Phase.RUNNING)
        self.watch = self.app_state.keeper.watch(claim.record, self.lease)
        if self.app_state.sessions is not None:
            self.attach_session()  # db.session carries the business writes
        self.emit(signals.taken_over if claim.taken_over else signals.claimed)
        self.view_started = time.monotonic()

    # -- what a found record means --------------------------------------------------------

    def meet(self, record: Record) -> Found:
        """What the record its claim found means for this attempt, decided once for a view and
        a job: a completed record's replay is reported (its answer is the adapter's: the
        stored response, the stored value); a re-run is taken over (:attr:`Found.RERUN`: this
        attempt won and holds the key; :attr:`Found.OVERTAKEN`: another attempt won); any other
        is a row of :data:`OUTCOMES` (the loser's too), whose event the adapter sends when it
        answers (:meth:`emit_found`)."""
        assert self.fingerprint is not None and self.options is not None
        keys = self.app_state.store.keys
        found = classify(record, self.fingerprint, self.options.recovery, keys)
        if found is Found.COMPLETED:
            assert record.response is not None
            self.emit(signals.replayed, status=record.response.status)
        elif found is Found.RERUN and not self.take_over(record):
            return Found.OVERTAKEN  # one winner, the same row: the same downstream keys
        return found

    def acquire(self, digest: bytes, *, until: float | None) -> Acquired:
        """Claim the key, or say what answers instead, once for a view and a job.

        The answer is a replay, or a refusal (a row of :data:`OUTCOMES`, its event sent).

        :param digest: the request's fingerprint.
        :param until: a view waits for an owner that still runs, claiming again every
            ``_WAIT_STEP`` until this ``time.monotonic()``, then answers 409; a job (None)
            never waits: it is told at once, and its queue delivers the message again later.
        :raises StoreUnavailable: the store failed; nothing runs (the adapter reports it
            through :meth:`reporting_claim_failure`).
        """
        while True:
            if self.atomic:
                assert until is not None
                acquired = self._acquire_atomic(digest, until)
            else:
                record = self.claim(digest)
                if record is None:
                    return Acquired(new=True)
                acquired = self.answer_found(record, until=until)
            if acquired is not None:
                return acquired

    def _acquire_atomic(self, digest: bytes, until: float) -> Acquired | None:
        """One claim of an atomic view, inside the business transaction it opens. A duplicate
        holding the scope (PostgreSQL's try-lock) is waited for until ``until``, then answered
        409; an existing record answers as for any view, after the empty transaction is
        rolled back. None: claim again."""
        result = self.claim_atomic(digest)
        if self.holding:
            return Acquired(new=True)
        self.rollback_quietly()
        if result is not None:
            acquired = self.answer_found(result.record, until=until)
            if acquired is not None:
                return acquired  # a reopened record taken over runs again, durably owned
        if time.monotonic() >= until:
            return Acquired(refusal=self.emit_found(Found.RUNNING))
        _wait(until)
        return None

    def answer_found(self, record: Record, *, until: float | None) -> Acquired | None:
        """What the record its claim found answers (:meth:`meet`), or None: claim again.

        A view claims again at once when another attempt took the record over first, and
        after a short wait while its owner runs (:meth:`emit_found` sends the row's event and
        logs what it logs once it answers instead).

        :param record: the record holding the key.
        :param until: the view's deadline (see :meth:`acquire`); None: a job, answered at once.
        """
        found = self.meet(record)
        if found is Found.COMPLETED:
            return Acquired(replay=record)
        if found is Found.RERUN:
            return Acquired()  # this attempt won the takeover: it runs
        if until is not None:
            if OUTCOMES[found].claims_again:
                return None
            if found is Found.RUNNING and time.monotonic() < until:
                _wait(until)
                return None
        return Acquired(refusal=self.emit_found(found, record), record=record)

    def holds_record(self) -> bool:
        """Whether the store already holds a record for the scope.

        A tenant's key limit lets a known key through to the answer its record gives.

        :raises StoreUnavailable: the store failed.
        """
        assert self.scope is not None
        return self.app_state.store.get(self.scope) is not None

    @contextlib.contextmanager
    def reporting_claim_failure(self) -> t.Iterator[None]:
        """Report a store failure of the claim step once (``store_unavailable``, stage
        ``claim``), and raise it again for the adapter to answer: around everything an
        adapter does before the run (its key limit, :meth:`acquire`, a view's ``replay=``)."""
        try:
            yield
        except StoreUnavailable:
            self.emit(signals.store_unavailable, stage="claim")
            raise

    # -- the end of the run --------------------------------------------------------------

    def end_run(self, ran: str, *, status: int | None = None) -> Ending:
        """The view or job that held the key is over: decide, once for both, whether its
        result is recorded, and give the key up when it is not.

        :param ran: who ran (``"view"``, ``"job"``), for the reason given.
        :param status: the status of the answer going out (a view's); None for a job.
        """
        self.trace_completing()
        self.stop_watching()
        self.note_replaced_session()
        if status is not None:
            self.mark_rendered(status)
        if self.work_lost:
            # It ended its own business transaction before answering: its rows are gone, so
            # its answer (a 201, say) would be a lie, stored or not.
            return self._end(Ending.WORK_LOST, f"the {ran} ended its business transaction itself")
        if self.phase is Phase.CRASHED:
            return self._end(Ending.GIVEN_UP, f"the {ran} raised an exception")
        if self.phase is Phase.REFUSED:
            return self._end(Ending.GIVEN_UP, f"the {ran} refused to run")
        if self._rolled_back_before_success(status):
            # The run (or a hook) rolled back what it wrote, then answered a success: the
            # answer does not stand for what committed. (An error answer after a rollback does.)
            reason = "the business transaction was rolled back before a success"
            return self._end(Ending.WORK_LOST, reason)
        never_store = self.app_state.settings.never_store
        if status is not None and (status in never_store or status not in STORABLE_STATUSES):
            return self._end(Ending.GIVEN_UP, f"status {status} is never stored")
        if self.atomic and self.session is not None and not self.session.in_transaction():
            # An error handler rolled db.session back after the view raised an HTTPException:
            # the atomic claim went with it, and nothing of the attempt is left. Its answer goes
            # out unstored; the key is free, so a retry runs the view again.
            reason = "the business transaction was rolled back before the answer"
            return self._end(Ending.GIVEN_UP, reason)
        if self.note_ended_below():
            # The driver committed or rolled back under the run: its rows did not commit with
            # its answer, so that answer must never be stored (nor the key given back).
            reason = f"the {ran} ended its business transaction below SQLAlchemy"
            return self._end(Ending.WORK_LOST, reason)
        return Ending.RECORD

    def _rolled_back_before_success(self, status: int | None) -> bool:
        if not self.rolled_back or (status is not None and status >= 400):
            return False
        # An atomic view that went on in a new transaction lost its claim with the old one: its
        # completion finds the reservation gone (409 lease lost, its later writes roll back).
        return not (self.atomic and self.in_transaction)

    def _end(self, ending: Ending, reason: str) -> Ending:
        self.give_up(reason)
        return ending

    def record_result(self, snapshot: StoredResponse | None, *, ran: str, status: int) -> Recording:
        """Record the run's result (:meth:`complete`; ``snapshot`` None: ran, not storable),
        and say what answers it: the run's own answer, or a row of :data:`OUTCOMES` (its
        event sent) when the lease was lost or the store failed.

        A client error too large to keep (``snapshot`` None, a 4xx), from an attempt that
        provably committed nothing (a validation answer before any contact), is given back, not
        recorded: kept as unstored, it would answer 409 to every retry of a request that only
        needs fixing; given back, a retry gets it again.

        :param ran: who ran (``"view"``, ``"job"``), for the reason given.
        :param status: the status the completion event reports.
        """
        if snapshot is None and 400 <= status < 500 and self.releasable:
            self.give_up("its 4xx answer is too large to store")
            return Recording(False)
        try:
            stored = self.complete(snapshot)
        except StoreUnavailable as exc:
            return Recording(False, self._record_failed(exc, ran=ran), exc)
        if not stored:
            # The lease expired and a retry took the record over: the run's writes in the
            # business transaction are rolled back and the operation belongs to the new owner.
            self.emit_found(Failure.LEASE_LOST)
            return Recording(False, Failure.LEASE_LOST)
        self.emit(signals.completed, status=status, stored=snapshot is not None)
        return Recording(True)

    def abandon(self) -> None:
        """The request or the job is over and its run never reached a recorded end (a view's
        teardown after ``SystemExit`` from gunicorn's worker timeout or SIGQUIT,
        ``KeyboardInterrupt``, a propagated exception; a job's ``finally`` after a failure
        between its claim and its end). Decided from the phase and the lease: nothing when the
        attempt no longer holds the key (recorded, or given up already); a job whose lease is
        no longer renewed (its end was reached) is left to that lease, which runs out on its
        own (the record then counts as unknown, never free); any other gives the key up
        (:meth:`give_up`: released when releasable, else unknown)."""
        if not self.holding:
            return
        if isinstance(self.options, JobOptions):
            if self.watch is not None:
                # A lease renewed for as long as the worker lives would refuse every
                # redelivery until the queue drops the message.
                self.give_up("the job ended before its outcome was recorded")
            return
        self.trace_completing()
        self.give_up("the request ended without an answer")

    def note_ended_below(self) -> bool:
        """The view ended its business transaction below SQLAlchemy (the driver's ``commit()``
        or ``rollback()``, a ``COMMIT`` through a raw cursor): its rows did not commit with its
        answer (rolled back, or committed before it), so that answer must never be stored, and
        the attempt can never prove it committed nothing."""
        if not ended_outside(self):
            return False
        self.work_lost = self.committed = True
        return True

    def complete(self, snapshot: StoredResponse | None) -> bool:
        """Complete the record with ``snapshot`` (None: ran, not storable) and commit the
        business transaction with it, or roll that back when the token lost the record to a
        takeover.

        :returns: False when the lease was lost (the attempt's business writes rolled back).
        :raises StoreUnavailable: nothing was committed; the caller gives up.
        :raises CommitUncertain: the commit itself failed and may have gone through.
        """
        assert self.scope is not None and self.token is not None
        if self.session is not None:
            self.begin()  # the completion joins the session's transaction
        if self.reservation is not None:
            # An atomic claim's record: written once, completed, by the transaction holding it.
            stored = self.reservation.complete(snapshot)
        else:
            stored = self.app_state.store.complete(
                self.scope,
                self.token,
                snapshot,
                connection=self.connection,
                created_at=self.created_at,
            )
        if self.connection is not None:
            if stored:
                self._finish()  # from here the commit is ours (see flow's atomic guard)
                try:
                    self.commit()
                except sa.exc.SQLAlchemyError as exc:
                    raise CommitUncertain(f"commit failed: {type(exc).__name__}") from exc
            else:
                with translate_errors():
                    self.rollback()
        self._finish()
        return stored

    def give_up(self, reason: str) -> None:
        """Roll the business transaction back; release the key only when the attempt provably
        committed nothing, else mark it ``unknown``."""
        assert self.scope is not None and self.token is not None
        self._finish()
        self.stop_watching()
        if ended_outside(self) or committed_elsewhere(self):
            self.committed = True  # a driver committed below the commit guard
        self.note_replaced_session()
        self.rollback_quietly()
        store = self.app_state.store
        if self.releasable and self.atomic:
            # The claim rolled back with the business transaction: nothing is left to give back.
            self.emit(signals.released, reason=reason)
            return
        try:
            if self.atomic:
                # Its rows may be committed without their answer: the key must stay taken.
                done = self._record_unknown()
                signal = signals.unknown
            elif self.releasable:
                done = store.release(self.scope, self.token, created_at=self.created_at)
                signal = signals.released
            else:
                done = store.mark_unknown(self.scope, self.token, created_at=self.created_at)
                signal = signals.unknown
        except StoreUnavailable:
            # The lease runs out on its own; the record then counts as unknown, never free. A
            # store failure this attempt already reported (its completion) is not counted twice.
            if not self.store_failed:
                self.emit(signals.store_unavailable, stage="give_up", reason=reason)
            return
        # The token no longer owns the record (a retry took it over): nothing changed here.
        self.emit(signal if done else signals.lease_lost, reason=reason)

    def _record_failed(self, error: StoreUnavailable, *, ran: str) -> Failure | None:
        """The result could not be recorded (:meth:`complete` raised ``error``): report it
        once, give the key up, and say which row of :data:`OUTCOMES` answers it.

        :param ran: who ran (``"view"``, ``"job"``), for the reason given.
        :returns: None when its effects happened outside the business transaction (there was
            none): the key stays taken, and the caller still gets what the run produced.
        """
        self.emit(signals.store_unavailable, stage="complete")
        self.store_failed = True
        if self.connection is None:
            # Its effects happened outside our transaction: the key must stay taken.
            self.contacted = True
            self.give_up(f"the store failed after the {ran} ran")
            return None
        unchanged = self.releasable
        if isinstance(error, CommitUncertain):
            # The commit itself failed: it may have gone through before the answer was lost.
            self.give_up("the store failed while committing: the result may or may not be recorded")
            return Failure.COMMIT_UNCERTAIN
        self.give_up("the store failed before the commit")
        return Failure.STORE_FAILED_UNCHANGED if unchanged else Failure.STORE_FAILED_UNKNOWN

    def note_replaced_session(self) -> None:
        """``db.session.remove()`` in the view: its writes in the removed session are gone, and
        the fresh ``db.session`` it got is no business transaction of this attempt, so its
        commits are neither refused nor seen. The attempt can never prove it committed nothing.

        (A ``close()`` or a caught refusal keeps the same session, whose next transaction is
        still the business transaction, guarded: nothing more than ``work_lost``.)
        """
        sessions = self.app_state.sessions
        if self.session is None or sessions is None:
            return
        if replaced(sessions.scoped, self.session):
            self.work_lost = self.committed = True
            try:
                roll_back_fresh(sessions.scoped)
            except sa.exc.SQLAlchemyError:
                log.warning("rollback of the view's fresh db.session failed", exc_info=True)

    def _record_unknown(self) -> bool:
        """Leave an atomic attempt that committed on its own ``unknown``: its record, if the
        commit published one (SQLite writes it at the claim), else a new one claimed for the
        purpose."""
        assert self.scope is not None and self.fingerprint is not None
        store = self.app_state.store
        result = store.claim(self.scope, self.fingerprint, ttl=self.ttl, lease=self.lease)
        token = result.token if result.claimed else self.token
        assert token is not None
        return store.mark_unknown(self.scope, token, created_at=result.record.created_at)

    def stop_watching(self) -> None:
        if self.watch is not None:
            self.app_state.keeper.unwatch(self.watch)
            self.watch = None


def _wait(until: float) -> None:
    """Sleep one step of a view's wait for the owner of its key, never past ``until``."""
    time.sleep(min(_WAIT_STEP, max(0.0, until - time.monotonic())))
