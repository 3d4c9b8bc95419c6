"""What every engine flask_idem builds carries: fork safety, time bounds and a quiet server log.

Fork safety
    A pooled connection inherited across ``fork()`` (``gunicorn --preload`` after the start-up
    partition check, ``multiprocessing``) is one socket shared by several processes: their
    answers interleave and a request can read another request's row. After a fork the child
    drops every inherited pool (:meth:`sqlalchemy.engine.Engine.dispose` with ``close=False``)
    and opens its own connections. An inherited psycopg2 or psycopg 3 socket is first replaced by
    ``/dev/null`` in the child, so that garbage-collecting the connection sends its
    ``Terminate`` message nowhere instead of ending the parent's session.

Time bounds (PostgreSQL)
    ``statement_timeout`` and ``lock_timeout`` are sent in the start-up packet (no round trip),
    so a slow or lock-blocked statement fails on the server after :data:`STATEMENT_TIMEOUT`.
    A *silent* server (frozen, ``SIGSTOP``, a hung host behind a live TCP stack) never sends
    that error, and TCP keepalives cannot notice because the kernel still acknowledges. So
    every call of a store connection that waits for the server (statements, named-cursor
    fetches, commit, rollback: also the pool's pings and resets, SQLAlchemy's first-connect
    queries and :func:`quiet_server_log`) is armed with the :class:`Watchdog` for the
    statement timeout plus :data:`DEADLINE_GRACE`. When that passes, the watchdog shuts the
    connection's socket down, the blocked libpq call returns, and the caller gets
    :class:`DeadlineExceeded` (an ``OperationalError`` on a closed connection: SQLAlchemy
    sees a disconnect, the pool discards it): the store answers 503 instead of hanging a
    worker. Connecting is bounded by libpq's own ``connect_timeout``.

    A new connection's setup waits at most one deadline in all, counted from when it
    connected (:func:`end_of_setup`), and one store operation (a claim, a completion, the
    business connection's checkout: see
    :class:`OneDeadline`) waits for the server at most one deadline in all, counted from its
    start: a wait before its first armed call (the pool's queue, or SQLAlchemy's lock around a
    new engine's first connection setup, which other threads hold while their own setup waits
    on the silent server) shortens the calls after it instead of adding to them.

    Only connections of engines built by :func:`flask_idem.store.create_engine` with a
    statement timeout are armed (:func:`connection_factory`); psycopg2 stays in its blocking
    mode, no process-wide state is touched, and every other connection of the process (the
    application's own, the migrations') keeps COPY, large objects and no deadline at all.
    COPY and large objects on a store connection itself run without the client-side deadline.

Server log (PostgreSQL)
    psycopg2 interpolates parameters on the client, so a failing statement reaches the
    server's log (``STATEMENT:`` lines, ``log_min_error_statement``) with the raw key, the
    claim token and the response body in clear. Each new connection switches statement
    logging off for its own session (:data:`QUIET_LOG`). Those settings are superuser-only:
    other roles need ``GRANT SET ON PARAMETER`` (PostgreSQL 15+) or ``ALTER ROLE ... SET``
    (README, "Timeouts, limits and logging"); without either a warning is logged once.
"""

from __future__ import annotations

import contextlib
import contextvars
import itertools
import logging
import math
import os
import socket
import sys
import threading
import time
import typing as t
import weakref

import psycopg2
import psycopg2.extensions
import sqlalchemy as sa

from . import pooler
from .commit_count import counting, psycopg2_cursor_factory

log = logging.getLogger("flask_idem")

#: Seconds a store statement may run (server ``statement_timeout`` and ``lock_timeout``).
STATEMENT_TIMEOUT = 4.0
#: Seconds past the statement timeout after which a silent server is given up on: a store
#: operation answers within 5 s, even when the server never answers at all.
DEADLINE_GRACE = 1.0
#: Seconds to open a connection (libpq ``connect_timeout``, enforced by libpq itself).
CONNECT_TIMEOUT = 5

#: Per-session logging settings that keep statement texts (and so parameters) out of the
#: PostgreSQL log: on errors, on slow statements, on sampled ones and on ``log_statement``.
QUIET_LOG = (
    "SET log_min_error_statement = panic; SET log_min_duration_statement = -1; "
    "SET log_min_duration_sample = -1; SET log_transaction_sample_rate = 0; "
    "SET log_statement = 'none'"
)

# -- fork safety ------------------------------------------------------------------------------

_engines: weakref.WeakSet[sa.Engine] = weakref.WeakSet()
_connections: weakref.WeakSet[t.Any] = weakref.WeakSet()
#: Inherited non-psycopg2 connections, kept referenced in the child so that they are never
#: closed (closing could act on the parent's files): a few descriptors per fork at most.
_inherited: list[t.Any] = []
_lock = threading.Lock()


def make_fork_safe(engine: sa.Engine) -> None:
    """Give a forked child fresh connections instead of the parent's (idempotent)."""
    with _lock:
        if engine in _engines:
            return
        _engines.add(engine)
    sa.event.listen(engine, "connect", _remember)


def _remember(dbapi_connection: t.Any, _record: t.Any) -> None:
    try:
        _connections.add(dbapi_connection)
    except TypeError:  # not weak-referenceable: keep no record, the pool is dropped anyway
        pass


def _driver(dbapi_connection: t.Any) -> t.Any:
    """The psycopg module (psycopg2 or psycopg 3) of a driver connection, else None."""
    for cls in type(dbapi_connection).__mro__:
        package = cls.__module__.partition(".")[0]
        if package in ("psycopg2", "psycopg"):
            return sys.modules[package]
    return None


def _after_fork_in_child() -> None:
    inherited = list(_connections)
    _connections.clear()
    for connection in inherited:
        if _driver(connection) is not None:
            if not connection.closed:
                devnull = os.open(os.devnull, os.O_RDWR)
                try:
                    os.dup2(devnull, connection.fileno())
                finally:
                    os.close(devnull)
        else:
            _inherited.append(connection)
    for engine in list(_engines):
        engine.dispose(close=False)


os.register_at_fork(after_in_child=_after_fork_in_child)


# -- deadlines (PostgreSQL) -----------------------------------------------------------------


class DeadlineExceeded(psycopg2.OperationalError):  # type: ignore[misc]
    """The server did not answer a store connection within its deadline (a disconnect)."""


def _shut_down(fd: int) -> None:
    """Make a call blocked on socket ``fd`` return: the peer seems to have hung up.

    ``shutdown`` acts on the socket, not on the descriptor, so a duplicate does it without
    closing libpq's descriptor under it (libpq still owns and later closes that one).
    """
    try:
        dup = os.dup(fd)
    except OSError:
        return
    try:
        sock = socket.socket(fileno=dup)
    except OSError:
        os.close(dup)
        return
    with sock, contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)


_R = t.TypeVar("_R")


class Watchdog:
    """Gives blocked libpq calls an end: one daemon thread per process, a dict of deadlines.

    :meth:`arm` before a call that waits for the server, :meth:`disarm` after it: a clock
    read, a dict entry in and out, no lock and nothing for the garbage collector to track.
    While calls come, the thread looks at the armed ones every :attr:`poll` seconds, or at the
    earliest deadline if that is sooner, and shuts the socket of every call past its deadline
    down; after a look that found no call armed and none made since the look before, it
    sleeps until the next :meth:`arm` wakes it. An arm wakes it too when its deadline comes
    before the thread's next look (a budget shorter than :attr:`poll`).

    An entry is taken out of the dict exactly once (``dict.pop`` is atomic): by
    :meth:`disarm`, and the thread then leaves it alone, or by the thread, which shuts its
    socket down under its lock; :meth:`disarm` then finds it gone and waits for that lock, so
    once it returned the thread never touches that descriptor again (it cannot act on a
    descriptor closed and reused meanwhile).
    """

    #: Seconds between two looks while calls come (an arm with a longer budget never wakes
    #: the thread).
    poll = 1.0
    #: The thread sleeps at least this long between two looks at the armed calls (seconds).
    granularity = 0.05

    def __init__(self) -> None:
        self._reset()
        os.register_at_fork(after_in_child=self._reset)

    def _reset(self) -> None:
        # Also in a forked child: the parent's thread is gone and its lock may be held.
        # Re-entrant: a garbage-collected connection's rollback, run by a finalizer in the
        # thread that holds it (the watchdog's own, or one waking it), arms a call too.
        self._lock = threading.RLock()
        self._condition = threading.Condition(self._lock)
        self._armed: dict[int, tuple[int, float]] = {}  # token: (descriptor, deadline)
        self._tokens = itertools.count().__next__
        #: When the thread looks next (infinity: it sleeps until woken).
        self._wake_at = math.inf
        #: The token of the latest arm: tells the thread whether calls came since its last look.
        self._latest = -1
        self._started = False

    def arm(self, fd: int, budget: float, not_after: float = math.inf) -> int:
        """Shut socket ``fd`` down unless :meth:`disarm` comes within ``budget`` seconds, or
        by ``not_after`` or the end of the :class:`OneDeadline` operation it is part of, if
        sooner."""
        deadline = min(time.monotonic() + budget, not_after)
        operation = _operation.get()
        if operation is not None:
            if operation[1] == math.inf:
                operation[1] = operation[0] + budget  # the operation's first armed call
            deadline = min(deadline, operation[1])
        token = self._latest = self._tokens()
        self._armed[token] = (fd, deadline)
        # Read after the entry is in: the thread looks at the entries again after it set its
        # wake-up time, so either it sees this one or this call sees that time and wakes it.
        if deadline < self._wake_at:
            self._wake()
        return token

    def disarm(self, token: int) -> bool:
        """Stop watching; True if the deadline had passed (the socket is shut down)."""
        if self._armed.pop(token, None) is not None:
            return False
        with self._lock:  # the thread took it: wait until it is done with the descriptor
            return True

    def bound(
        self,
        connection: t.Any,
        fd: int,
        exceeded: type[Exception],
        call: t.Callable[..., _R],
        /,
        *args: t.Any,
        **kwargs: t.Any,
    ) -> _R:
        """``call(*args, **kwargs)`` armed with ``connection``'s deadline on socket ``fd``
        (its ``flask_idem_deadline`` budget, its ``flask_idem_setup_ends``): the one way both
        drivers' deadline connections wait for the server.

        :raises exceeded: the deadline passed and shut the socket down; ``connection`` is then
            closed, so SQLAlchemy sees a disconnect and the pool drops it.
        """
        budget = connection.flask_idem_deadline
        token = self.arm(fd, budget, connection.flask_idem_setup_ends)
        try:
            result = call(*args, **kwargs)
        except BaseException as exc:
            if self.disarm(token):
                connection.close()
                raise exceeded(
                    f"flask_idem: the database did not answer within {budget:g} s"
                ) from exc
            raise
        self.disarm(token)
        return result

    def _wake(self) -> None:
        with self._condition:
            if not self._started:
                self._start()
            self._condition.notify()

    def _start(self) -> None:
        try:
            threading.Thread(target=self._run, name="flask-idem-deadline", daemon=True).start()
        except RuntimeError:  # interpreter shutdown: no thread, so this call gets no deadline
            return
        self._started = True

    def _run(self) -> None:
        armed, condition = self._armed, self._condition
        seen = -2
        with condition:
            while True:
                now = time.monotonic()
                for token, (fd, deadline) in armed.copy().items():
                    if deadline <= now and armed.pop(token, None) is not None:
                        _shut_down(fd)
                earliest = _earliest(armed)
                idle = earliest == math.inf and self._latest == seen
                seen = self._latest
                wake_at = math.inf if idle else min(earliest, now + self.poll)
                self._wake_at = wake_at
                if _earliest(armed) < wake_at:
                    continue  # armed since the look, sooner, by a call that read the old time
                if idle:
                    condition.wait()
                else:
                    condition.wait(max(wake_at - now, self.granularity))


def _earliest(armed: dict[int, tuple[int, float]]) -> float:
    # dict.copy() takes the entries at once, allocating nothing per entry (so no garbage
    # collection, whose finalizers could let other threads arm and disarm, runs inside it).
    return min((deadline for _fd, deadline in armed.copy().values()), default=math.inf)


#: The process's watchdog (its thread starts on the first armed call).
WATCHDOG = Watchdog()

#: The store operation running in this context: [when it started, when its deadline ends
#: (infinity until its first armed call sets it from that connection's budget)].
_operation: contextvars.ContextVar[list[float] | None] = contextvars.ContextVar(
    "flask_idem_operation", default=None
)


class OneDeadline:
    """Bound every wait for the server inside by one deadline, counted from here (the
    budget of the first connection armed inside, whatever waited before it). Nested, the
    outer operation's deadline holds. A class, not a generator: it runs in every store
    operation."""

    __slots__ = ("_token",)

    def __enter__(self) -> None:
        outer = _operation.get()
        self._token = None if outer is not None else _operation.set([time.monotonic(), math.inf])

    def __exit__(self, *_exc: object) -> None:
        if self._token is not None:
            _operation.reset(self._token)


_F = t.TypeVar("_F", bound=t.Callable[..., t.Any])


_READY = psycopg2.extensions.STATUS_READY


def _bounded(call: _F, *, of_cursor: bool) -> _F:
    """``call`` (a connection or cursor method) with its connection's deadline.

    A connection's commit and rollback outside a transaction send nothing: not armed.
    """

    def bounded(self: t.Any, *args: t.Any, **kwargs: t.Any) -> t.Any:
        connection = self.connection if of_cursor else self
        # Closed: psycopg2 raises its own error without any wait.
        if connection.closed or (not of_cursor and connection.status == _READY):
            return call(self, *args, **kwargs)
        return WATCHDOG.bound(
            connection, connection.fileno(), DeadlineExceeded, call, self, *args, **kwargs
        )

    bounded.__name__ = call.__name__
    bounded.__doc__ = call.__doc__
    return t.cast(_F, bounded)


#: Cursor methods that wait for the server: every cursor's, and a named (server-side)
#: cursor's fetches and close too. COPY and large objects run without a deadline.
_CURSOR_CALLS: tuple[str, ...] = ("execute", "executemany", "callproc")
_NAMED_CURSOR_CALLS = (*_CURSOR_CALLS, "fetchone", "fetchmany", "fetchall", "scroll", "close")
_NAMED_CURSOR_CALLS += ("__next__",)

#: Bounded subclasses by cursor factory, for unnamed and for named cursors.
_unnamed_classes: dict[t.Any, t.Any] = {}
_named_classes: dict[t.Any, t.Any] = {}
_plain_connection_cursor = psycopg2.extensions.connection.cursor


def _bounded_class(factory: t.Any, named: bool) -> t.Any:
    """``factory`` (a psycopg2 cursor class) with the deadline on its waiting methods; a
    factory that is not a class is kept as it is (its cursors get no deadline)."""
    classes = _named_classes if named else _unnamed_classes
    if not isinstance(factory, type):
        return classes.setdefault(factory, factory)
    calls = _NAMED_CURSOR_CALLS if named else _CURSOR_CALLS
    body = {name: _bounded(getattr(factory, name), of_cursor=True) for name in calls}
    return classes.setdefault(factory, type(f"Deadline{factory.__name__}", (factory,), body))


class DeadlineConnection(psycopg2.extensions.connection):  # type: ignore[misc]
    """A psycopg2 connection whose waits for the server end after a deadline (see
    :class:`Watchdog`): statements, named-cursor fetches, commit and rollback. It counts the
    ends of its transactions (:mod:`.commit_count`)."""

    #: Seconds any one operation after connecting may wait.
    flask_idem_deadline: float
    #: When the connection's setup must be over (see :func:`end_of_setup`).
    flask_idem_setup_ends = math.inf
    flask_idem_ends = 0

    commit = _bounded(counting(psycopg2.extensions.connection.commit), of_cursor=False)
    rollback = _bounded(
        counting(psycopg2.extensions.connection.rollback, may_commit=False), of_cursor=False
    )

    def cursor(
        self, name: str | None = None, cursor_factory: t.Any = None, *args: t.Any, **kwargs: t.Any
    ) -> t.Any:
        factory = psycopg2_cursor_factory(self, cursor_factory)
        bounded = (_unnamed_classes if name is None else _named_classes).get(factory)
        if bounded is None:
            bounded = _bounded_class(factory, name is not None)
        return _plain_connection_cursor(self, name, bounded, *args, **kwargs)


def connection_factory(deadline: float) -> t.Callable[..., DeadlineConnection]:
    """The ``connection_factory`` of an engine whose operations wait at most ``deadline``.

    Connecting itself is bounded by libpq's ``connect_timeout``.
    """

    def connect(dsn: str, *args: t.Any, **kwargs: t.Any) -> DeadlineConnection:
        connection = DeadlineConnection(dsn, *args, **kwargs)
        connection.flask_idem_deadline = deadline
        connection.flask_idem_setup_ends = time.monotonic() + deadline
        return connection

    return connect


def end_of_setup(dbapi_connection: t.Any, _record: t.Any) -> None:
    """The engine's last ``connect`` listener: the new connection's setup is over.

    Its setup (SQLAlchemy's first-connect queries, :func:`quiet_server_log`, the pooler
    check) waits at most one deadline in all, counted from when it connected. SQLAlchemy runs
    a new engine's first setup under a lock: the other threads connecting meanwhile wait for
    it, and each would otherwise start its own setup with a full deadline after that wait, so
    on a silent server the n-th of them answered after n deadlines.
    """
    if getattr(dbapi_connection, "flask_idem_setup_ends", math.inf) != math.inf:
        dbapi_connection.flask_idem_setup_ends = math.inf


# -- server log (PostgreSQL) ------------------------------------------------------------------

_warned = False


def quiet_server_log(dbapi_connection: t.Any, record: t.Any) -> None:
    """``connect`` event: keep this session's statement texts out of the server log (behind a
    transaction pooler a session ``SET`` would outlive it: the claims do it for their own
    transaction instead, see :mod:`.pooler`)."""
    global _warned
    if pooler.behind_pooler(dbapi_connection, record):
        return
    autocommit = dbapi_connection.autocommit
    dbapi_connection.autocommit = True
    driver = _driver(dbapi_connection) or psycopg2
    try:
        with dbapi_connection.cursor() as cursor:
            cursor.execute(QUIET_LOG)
    except driver.Error as exc:
        if dbapi_connection.closed or isinstance(exc, driver.OperationalError):
            # The connection broke (a backend killed while the pool opened it, a silent
            # server): the pool must not keep it, and the caller fails closed (503).
            raise
        if not _warned:
            _warned = True
            log.warning(
                "could not switch statement logging off for store sessions (%s): PostgreSQL "
                "may log idempotency keys and bodies of failed statements; grant SET on "
                "log_min_error_statement (see README)",
                type(exc).__name__,
            )
    finally:
        if not dbapi_connection.closed:
            dbapi_connection.autocommit = autocommit


# -- Citus ------------------------------------------------------------------------------------

#: ``ConnectionRecord.info`` key: whether Citus is loaded on the connection's server.
CITUS_LOADED = "flask_idem.citus"
CITUS_VERSION = "SELECT current_setting('citus.version', true)"


def remember_citus(dbapi_connection: t.Any, record: t.Any) -> None:
    """``connect`` event: whether Citus is loaded, kept with the pooled connection
    (:data:`CITUS_LOADED`), where the store reads it (its completions are statements there,
    calls of functions elsewhere): one round trip per new connection, none per request."""
    autocommit = dbapi_connection.autocommit
    dbapi_connection.autocommit = True
    try:
        with dbapi_connection.cursor() as cursor:
            cursor.execute(CITUS_VERSION)
            record.info[CITUS_LOADED] = cursor.fetchone()[0] is not None
    finally:
        if not dbapi_connection.closed:
            dbapi_connection.autocommit = autocommit
