"""What every engine flask_idem builds carries: fork safety, time bounds and a quiet server log.

Fork safety
    A pooled connection inherited across ``fork()`` (``gunicorn --preload`` after the start-up
    partition check, ``multiprocessing``) is one socket shared by several processes: their
    answers interleave and a request can read another request's row. After a fork the child
    drops every inherited pool (:meth:`sqlalchemy.engine.Engine.dispose` with ``close=False``)
    and opens its own connections. An inherited psycopg2 socket is first replaced by
    ``/dev/null`` in the child, so that garbage-collecting the connection sends its
    ``Terminate`` message nowhere instead of ending the parent's session.

Time bounds (PostgreSQL)
    ``statement_timeout`` and ``lock_timeout`` are sent in the start-up packet (no round trip),
    so a slow or lock-blocked statement fails on the server after :data:`STATEMENT_TIMEOUT`.
    A *silent* server (frozen, ``SIGSTOP``, a hung host behind a live TCP stack) never sends
    that error, and TCP keepalives cannot notice because the kernel still acknowledges. So
    psycopg2 runs in its "green" mode with :func:`wait`: every wait for the server (connect,
    statement, commit, rollback) has a client-side deadline, ``connect_timeout`` while
    connecting and the statement timeout plus :data:`DEADLINE_GRACE` afterwards. When it
    passes, the connection is closed and the caller gets ``OperationalError`` (a disconnect, so
    the pool discards it): the store answers 503 instead of hanging a worker.

Server log (PostgreSQL)
    psycopg2 interpolates parameters on the client, so a failing statement reaches the
    server's log (``STATEMENT:`` lines, ``log_min_error_statement``) with the raw key, the
    claim token and the response body in clear. Each new connection switches statement
    logging off for its own session (:data:`QUIET_LOG`). Those settings are superuser-only:
    other roles need ``GRANT SET ON PARAMETER`` (PostgreSQL 15+) or ``ALTER ROLE ... SET``
    (README, "Timeouts, limits and logging"); without either a warning is logged once.
"""

from __future__ import annotations

import logging
import os
import re
import select
import threading
import time
import typing as t
import weakref

import psycopg2
import psycopg2.extensions
import sqlalchemy as sa

log = logging.getLogger("flask_idem")

#: Seconds a store statement may run (server ``statement_timeout`` and ``lock_timeout``).
STATEMENT_TIMEOUT = 4.0
#: Seconds past the statement timeout after which a silent server is given up on: a store
#: operation answers within 5 s, even when the server never answers at all.
DEADLINE_GRACE = 1.0
#: Seconds to open a connection (libpq ``connect_timeout``; enforced by :func:`wait`).
CONNECT_TIMEOUT = 5

#: Per-session logging settings that keep statement texts (and so parameters) out of the
#: PostgreSQL log: on errors, on slow statements, on sampled ones and on ``log_statement``.
QUIET_LOG = (
    "SET log_min_error_statement = panic; SET log_min_duration_statement = -1; "
    "SET log_min_duration_sample = -1; SET log_transaction_sample_rate = 0; "
    "SET log_statement = 'none'"
)

_CONNECT_TIMEOUT = re.compile(r"\bconnect_timeout=(\d+)")


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


def _after_fork_in_child() -> None:
    inherited = list(_connections)
    _connections.clear()
    for connection in inherited:
        if isinstance(connection, psycopg2.extensions.connection):
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


class DeadlineConnection(psycopg2.extensions.connection):  # type: ignore[misc]
    """A psycopg2 connection whose waits for the server have a deadline (see :func:`wait`)."""

    #: Seconds any one operation after connecting may wait; None: no deadline.
    flask_idem_deadline: float | None = None


def connection_factory(deadline: float | None) -> t.Callable[..., DeadlineConnection]:
    """The ``connection_factory`` of an engine whose operations wait at most ``deadline``."""

    def connect(dsn: str, *args: t.Any, **kwargs: t.Any) -> DeadlineConnection:
        connection = DeadlineConnection(dsn, *args, **kwargs)
        connection.flask_idem_deadline = deadline
        return connection

    return connect


def install_wait_callback() -> bool:
    """Route psycopg2's waits through :func:`wait` (process-wide; idempotent).

    :returns: False when another wait callback (gevent, eventlet) is installed: it is left
        alone and connections have no client-side deadline.
    """
    current = psycopg2.extensions.get_wait_callback()
    if current is wait:
        return True
    if current is not None:
        log.warning(
            "another psycopg2 wait callback is installed; store connections get no "
            "client-side deadline (a frozen database can hang a request)"
        )
        return False
    psycopg2.extensions.set_wait_callback(wait)
    return True


def _budget(connection: t.Any) -> float | None:
    if connection.status == psycopg2.extensions.STATUS_SETUP:
        # Green mode bypasses libpq's own connect_timeout: honour it here, for every
        # connection of the process, as the blocking mode would have.
        found = _CONNECT_TIMEOUT.search(connection.dsn or "")
        return float(found.group(1)) if found else None
    return getattr(connection, "flask_idem_deadline", None)


def wait(connection: t.Any) -> None:
    """psycopg2 wait callback: ``psycopg2.extras.wait_select`` with a deadline.

    On a connection without a deadline it waits as long as the blocking mode would.
    """
    budget = _budget(connection)
    end = None if budget is None else time.monotonic() + budget
    poller = select.poll()
    while True:
        state = connection.poll()
        if state == psycopg2.extensions.POLL_OK:
            return
        if state == psycopg2.extensions.POLL_READ:
            events = select.POLLIN
        elif state == psycopg2.extensions.POLL_WRITE:
            events = select.POLLOUT
        else:  # pragma: no cover - psycopg2 only returns the three states above
            raise psycopg2.OperationalError(f"unexpected psycopg2 poll state {state}")
        remaining = None if end is None else end - time.monotonic()
        if remaining is not None and remaining <= 0:
            # psycopg2 closes a connection whose wait callback failed; the pool sees a
            # disconnect and discards it.
            raise psycopg2.OperationalError(
                f"flask_idem: the database did not answer within {budget:g} s"
            )
        poller.register(connection.fileno(), events)
        poller.poll(None if remaining is None else max(1, int(remaining * 1000) + 1))
        poller.unregister(connection.fileno())


# -- server log (PostgreSQL) ------------------------------------------------------------------

_warned = False


def quiet_server_log(dbapi_connection: t.Any, _record: t.Any) -> None:
    """``connect`` event: keep this session's statement texts out of the server log."""
    global _warned
    autocommit = dbapi_connection.autocommit
    dbapi_connection.autocommit = True
    try:
        with dbapi_connection.cursor() as cursor:
            cursor.execute(QUIET_LOG)
    except psycopg2.Error as exc:
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
