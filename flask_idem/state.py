"""Per-application and per-request state, importable by every module of the package.

``init_app`` keeps an :class:`AppState` in ``app.extensions["idempotency"]``; the request flow
keeps a :class:`RequestState` on ``flask.g``, and so does a job (``flask.g`` lives on the app
context, so ``idem.downstream_key()`` and ``idem.connection()`` work in a job as in a view).
This module imports nothing above the store, so the CLI, the blueprint, reconcilers, jobs and
the flow can all use it without an import cycle.
"""

from __future__ import annotations

import dataclasses
import time
import typing as t

import sqlalchemy as sa
from flask import current_app, g

from .core.config import Settings
from .core.options import JobOptions, ViewOptions
from .core.record import Record, Reservation, Scope
from .lease import LeaseKeeper, Watch
from .observers import call_observer
from .store import RequestStore, commit_count
from .store.sql import translate_errors

if t.TYPE_CHECKING:
    from .web.extension import Idempotency

EXTENSION_NAME = "idempotency"
_REQUEST_STATE = "_flask_idem"
#: ``session.info`` key of the request state whose business transaction a session carries.
SESSION_STATE = "flask_idem.request"


class Trace(t.Protocol):
    """One attempt as a tracer follows it (:mod:`flask_idem.ops.otel`). The transitions reach it
    as signals; these are the moments no signal marks."""

    def completing(self) -> None:
        """The view or job is over: its result is being recorded, or its key given up."""

    def failed(self, error: BaseException) -> None:
        """The view or job raised ``error``."""

    def end(self) -> None:
        """The attempt is over (its request torn down, its job returned or raised)."""


class SessionSource(t.Protocol):
    """Where the business sessions come from (see :mod:`flask_idem.sqlalchemy`)."""

    @property
    def scoped(self) -> t.Any:
        """The application's ``db.session`` (a ``scoped_session``)."""


@dataclasses.dataclass
class AppState:
    """What ``init_app`` keeps per application in ``app.extensions["idempotency"]``."""

    extension: Idempotency
    settings: Settings
    store: RequestStore
    keeper: LeaseKeeper
    #: The application's Flask-SQLAlchemy session (``Idempotency(db=...)``): the business
    #: transaction of every protected request, None for the store's own connections.
    sessions: SessionSource | None = None
    #: The application keeps Flask's own ``ensure_sync`` (which returns a plain function as
    #: it is), so a guard may skip asking it for a view that is not a coroutine function.
    plain_ensure_sync: bool = True
    #: A Flask-SQLAlchemy registered on the app whose session flask_idem does not settle (the
    #: store runs on another database): its writes left uncommitted by a view are warned of.
    unmanaged_db: t.Any = None
    #: Starts the trace of an attempt (``IDEMPOTENCY_OPENTELEMETRY``); None: nothing traced,
    #: and an attempt costs one attribute test.
    tracer: t.Callable[[RequestState], Trace] | None = None

    def start_trace(self, state: RequestState) -> None:
        """Follow the claimed attempt ``state`` in the tracer, when there is one."""
        tracer = self.tracer
        if tracer is not None:

            def begin() -> None:
                state.trace = tracer(state)

            call_observer("flask_idem tracer: begin", begin)

    #: Endpoints whose view guard was entered under the outer guard's claim (logged once).
    guards_not_found: set[str] = dataclasses.field(default_factory=set)

    def begin(self, state: RequestState) -> sa.Connection:
        """The request's business transaction, opened on first use: the connection of the
        application's ``db.session`` (with ``db=``), else one of its own on the store."""
        if self.sessions is not None:
            # Also for a connection taken over from an earlier state (a hook's
            # idem.connection()): the session's guards must see this request.
            session = self.attach_session(state)
            if state.connection is None:
                with translate_errors():
                    state.connection = session.connection(
                        bind_arguments={"bind": self.store.engine}
                    )
        elif state.connection is None:
            state.connection = self.store.begin()
            commit_count.zero(state.connection)  # a commit below it counts from its start
        return state.connection

    def attach_session(self, state: RequestState) -> t.Any:
        """Make ``db.session`` the claimed request's business transaction without opening it
        yet: SQLite has one writer, so its lock must not be taken before the view writes (a
        provider's own connection to the same file would wait for it)."""
        assert self.sessions is not None
        if state.session is None:
            state.session = self.sessions.scoped()
        # Also for a session taken over from an earlier state (a hook's idem.connection()):
        # the commit guard must see the claimed request, not the hook's unprotected one.
        state.session.info[SESSION_STATE] = state
        return state.session

    @classmethod
    def current(cls) -> AppState:
        """The state of ``current_app`` (for hooks, the CLI, the blueprint and reconcilers)."""
        return t.cast(AppState, current_app.extensions[EXTENSION_NAME])


@dataclasses.dataclass
class RequestState:
    """One protected request's (or job's) progress through the state machine (on ``flask.g``)."""

    scope: Scope | None
    options: ViewOptions | JobOptions | None
    token: str | None = None
    #: The record this request owns (claimed or taken over).
    record: Record | None = None
    #: Set when ``record`` is reserved, not written yet (see :attr:`ClaimResult.reservation`).
    reservation: Reservation | None = None
    watch: Watch | None = None
    connection: sa.Connection | None = None
    #: The view or job declared contact with the outside world (``downstream_key()``...).
    contacted: bool = False
    #: The view or job raised (whoever rendered the exception afterwards).
    crashed: bool = False
    #: The view ended with ``idem.refuse()`` (not caught): it did nothing, the key goes back.
    refused: bool = False
    #: The view returned or raised: an error handler's ``db.session.rollback()`` (a common
    #: habit) then undoes nothing flask_idem still needs, so it is allowed.
    answered: bool = False
    #: The business transaction ended before the view answered, and not through flask_idem
    #: (``db.session.close()``, ``remove()``, a rollback whose refusal the view caught): the
    #: view's writes are gone, so its answer must never be stored or sent.
    work_lost: bool = False
    #: The attempt's business transaction was committed, or ended by a statement of the view's
    #: own (``COMMIT``, ``END``), outside flask_idem: it can never prove it committed nothing.
    committed: bool = False
    finished: bool = False
    #: A store failure was already reported for this attempt (events count it once).
    store_failed: bool = False
    #: What to echo in the key header when there is no valid key (see ``echo_of_invalid``).
    echo: str | None = None
    #: The request's fingerprint, once computed (events carry a prefix of it).
    fingerprint: bytes | None = None
    #: When the attempt started (``time.monotonic()``): events of the claim measure from here.
    started: float = dataclasses.field(default_factory=time.monotonic)
    #: When the attempt got the key: events ending the attempt measure the view from here.
    view_started: float | None = None
    #: The Flask-SQLAlchemy session whose transaction ``connection`` is (``db=``), if any.
    session: t.Any = None
    #: True while flask_idem itself commits or rolls the session back.
    settling: bool = False
    #: The tracer's view of this attempt, when one follows it (:meth:`AppState.start_trace`).
    trace: Trace | None = None
    #: The claim was made by the outer guard around the whole view function (not by the
    #: view's own ``@idem.idempotent``, which the guard search did not find).
    claimed_around_view: bool = False
    #: The driver-level commits this attempt's context made on the store's engine, counted
    #: from its claim (:mod:`.store.commit_count`).
    tally: commit_count.Tally | None = None

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
        self.settling = True
        try:
            getattr(target, how)()
        finally:
            self.settling = False

    def close(self) -> None:
        """End the request's use of the business transaction. A session's connection is the
        session's to close (Flask-SQLAlchemy removes the session at app context teardown)."""
        try:
            if self.session is not None:
                self.session.info.pop(SESSION_STATE, None)
                if self.session.in_transaction():
                    self.rollback()
            elif self.connection is not None:
                self.connection.close()
        finally:
            if self.trace is not None:
                self._tell_trace("end", self.trace.end)
                self.trace = None

    def completing(self) -> None:
        """The view or job is over; tell the trace, if any."""
        if self.trace is not None:
            self._tell_trace("completing", self.trace.completing)

    def failed(self, error: BaseException) -> None:
        """The view or job raised ``error``; tell the trace, if any."""
        if self.trace is not None:
            trace = self.trace
            self._tell_trace("failed", lambda: trace.failed(error))

    def _tell_trace(self, moment: str, call: t.Callable[[], None]) -> None:
        """A trace that raises never changes the attempt (see :mod:`flask_idem.observers`)."""
        call_observer(f"flask_idem tracer: {moment}", call)

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
    def atomic(self) -> bool:
        """The claim lives in the business transaction (``@idem.idempotent(atomic=True)``)."""
        return bool(getattr(self.options, "atomic", False))

    @classmethod
    def current(cls) -> RequestState | None:
        # The proxy's object once (not a proxied g.get()): a request looks its state up often.
        state: RequestState | None = g._get_current_object().__dict__.get(_REQUEST_STATE)
        return state

    @classmethod
    def ensure(cls) -> RequestState:
        """The request's state, created unprotected (for ``idem.connection()`` in any view)."""
        state = cls.current()
        if state is None:
            state = cls(scope=None, options=None)
            state.attach()
        return state

    def attach(self) -> None:
        setattr(g, _REQUEST_STATE, self)

    @staticmethod
    def detach() -> None:
        g.pop(_REQUEST_STATE, None)
