"""The one place flask_idem reaches below SQLAlchemy's public API, behind one switch.

Two shortcuts live here, and nowhere else:

- **The driver cursor** (:func:`observed`, :func:`autocommitted`, :func:`on_cursor`): the
  PostgreSQL store sends its hottest statements (the claim, the completion, a release) on the
  driver's cursor of a pooled connection instead of through ``exec_driver_sql``. SQLAlchemy's
  result machinery around a one-row answer was a fifth of a replay's Python calls
  (``python -m bench profile``). Keeping what ``exec_driver_sql`` does besides needs the pool's
  private ``_invalidate`` (a disconnect marks every older connection of the pool stale, as
  ``Connection._handle_dbapi_exception`` does) and the engine's event ``dispatch``.
- **The wrapped dialect** (:func:`wrap_dialect`): the commit guard (:mod:`flask_idem.commits`)
  sees the store engine's commits, rollbacks and statements by replacing that dialect's
  ``do_commit``, ``do_rollback``, ``do_execute`` and ``do_execute_no_params`` on the instance
  instead of listening to connection events: any connection event on an engine makes
  SQLAlchemy dispatch events around every statement, transaction and checkout of it, which
  cost a protected request 6% of its instructions (``valgrind --tool=callgrind``).

The switch, ``IDEMPOTENCY_SQLALCHEMY_FAST_PATH`` (default True), is read by ``init_app``
(:meth:`flask_idem.store.base.RequestStore.use_fast_path`). Off, the store runs every statement
through ``Connection.exec_driver_sql`` (public API): a claim costs SQLAlchemy's execution and
result machinery again, and failures go through SQLAlchemy's own disconnect handling.

Off, the commit guard listens to SQLAlchemy's connection and pool events instead of wrapping
the dialect (:func:`flask_idem.commits.guard_commits`): the same refusals and the same notes,
paying for the event dispatch.

:class:`Autocommit` (the driver's autocommit flag for a block) is here for the driver cursor,
and the public path uses it too (a release or an upkeep statement in autocommit, without
SQLAlchemy's round trip to reset the isolation level).

One patch is not behind the switch, because no public API does its job: **the counting
connect** (:func:`open_counting`). The counting driver connections (:mod:`.commit_count`),
which see a transaction ended below SQLAlchemy, are what the commit guard reads on both paths,
so an engine flask_idem did not build opens them through its dialect's ``connect``, replaced on
that dialect instance. SQLAlchemy's public ``do_connect`` event cannot replace it: psycopg 3
has no connect argument naming a connection class, so a listener would have to open the
connection itself, and a listener that returns a connection ends the chain, pre-empting every
listener registered after it (the pooler's, :mod:`.pooler`, which retries without refused
start-up options and itself calls the dialect's ``connect``: it would then open connections
that do not count, or never run). Wrapping ``connect`` counts every connection whichever
listener opens it, in any order of registration.
"""

from __future__ import annotations

import contextlib
import logging
import typing as t

import sqlalchemy as sa

from .commit_count import Psycopg2Connection, psycopg_class

_WRAPPED = "flask_idem_commit_guard"
_OPENS_COUNTING = "flask_idem_opens_counting"


def open_counting(engine: sa.Engine) -> None:
    """Open ``engine``'s new PostgreSQL connections from the counting classes of
    :mod:`.commit_count` (once per dialect; on both paths of the switch, see the module's
    docstring)."""
    dialect = engine.dialect
    if dialect.name != "postgresql" or getattr(dialect.connect, _OPENS_COUNTING, False):
        return
    connect = dialect.connect
    driver = dialect.driver

    def connect_counting(*cargs: t.Any, **cparams: t.Any) -> t.Any:
        if driver == "psycopg2":
            cparams.setdefault("connection_factory", Psycopg2Connection)
        elif driver == "psycopg":
            return psycopg_class().connect(*cargs, **cparams)
        return connect(*cargs, **cparams)

    setattr(connect_counting, _OPENS_COUNTING, True)
    dialect.connect = connect_counting  # type: ignore[method-assign]


def observed(engine: sa.Engine) -> bool:
    """Whether anything watches ``engine``'s statements and their failures: cursor listeners
    (tracing, statement counters), ``handle_error`` listeners (failover rules that mark more
    errors as disconnects, error reporting), or statement logging (``echo``). Statements then
    go through ``exec_driver_sql``, where all of them see it (see :func:`on_cursor`)."""
    dispatch = engine.dispatch
    return bool(
        dispatch.before_cursor_execute
        or dispatch.after_cursor_execute
        or engine.dialect.dispatch.handle_error
        or engine.logger.isEnabledFor(logging.INFO)
    )


class Autocommit:
    """The driver's autocommit flag on for a block, then back as it was: SQLAlchemy's
    ``AUTOCOMMIT`` isolation level would cost a round trip (``SET
    default_transaction_isolation``) when the connection returns to the pool, and an
    application's engine kept in autocommit stays so."""

    __slots__ = ("connection", "previous")

    def __init__(self, dbapi_connection: t.Any) -> None:
        self.connection = dbapi_connection

    def __enter__(self) -> None:
        self.previous = self.connection.autocommit
        self.connection.autocommit = True

    def __exit__(self, *_exc: object) -> None:
        if self.connection.closed:
            return
        try:
            self.connection.autocommit = self.previous
        except Exception:
            # psycopg 3 refuses while a statement still runs (an exception raised by a signal
            # handler interrupted its wait): the connection is fit for neither mode. Closed,
            # it is a disconnect to SQLAlchemy, and never goes back to the pool.
            self.connection.close()
            raise


def dbapi_error(
    engine: sa.Engine,
    exc: BaseException,
    statement: str | None,
    parameters: t.Any,
    *,
    invalidated: bool,
) -> sa.exc.DBAPIError:
    """SQLAlchemy's exception for a driver error (parameters hidden as the engine says)."""
    dialect = engine.dialect
    return t.cast(
        sa.exc.DBAPIError,
        sa.exc.DBAPIError.instance(
            statement,
            parameters,
            t.cast(Exception, exc),
            dialect.loaded_dbapi.Error,
            hide_parameters=engine.hide_parameters,
            connection_invalidated=invalidated,
            dialect=dialect,
        ),
    )


@contextlib.contextmanager
def checked_out(engine: sa.Engine) -> t.Iterator[t.Any]:
    """A pooled connection of ``engine`` (no SQLAlchemy ``Connection`` around it), checked in
    after the block; a failed checkout is SQLAlchemy's exception for it."""
    try:
        pooled = engine.raw_connection()
    except engine.dialect.loaded_dbapi.Error as exc:
        raise dbapi_error(engine, exc, None, None, invalidated=False) from exc
    try:
        yield pooled
    finally:
        pooled.close()


def autocommitted(
    engine: sa.Engine, statement: str, parameters: t.Any, read: t.Callable[[t.Any], t.Any]
) -> t.Any:
    """``read`` of ``statement`` on a pooled connection in autocommit (:func:`on_cursor`)."""
    with checked_out(engine) as pooled:
        return on_cursor(engine, pooled, None, statement, parameters, read, autocommit=True)


def on_cursor(
    engine: sa.Engine,
    pooled: t.Any,
    owner: sa.Connection | None,
    statement: str,
    parameters: t.Any,
    read: t.Callable[[t.Any], t.Any],
    *,
    autocommit: bool = False,
) -> t.Any:
    """``read(cursor)`` after ``statement``, on the driver's cursor of ``pooled`` (a pooled
    connection, checked out by ``owner`` when it is a ``Connection``'s).

    What ``exec_driver_sql`` does besides is kept, as ``Connection._handle_dbapi_exception``
    does it: a failure is SQLAlchemy's exception for it (:func:`dbapi_error`), a disconnect
    invalidates the whole pool (every connection older than it is replaced), and an
    interrupted statement (``SystemExit`` from a worker timeout) its connection, so the pool
    never hands a dead or half-read connection out again. Whatever watches the engine gets
    these statements through ``exec_driver_sql`` instead (:func:`observed`).
    """
    dbapi_connection = pooled.dbapi_connection
    cursor = None
    try:
        # ``autocommit``: the statement is its own transaction (a closed connection or an
        # open transaction fails when the flag is switched).
        with Autocommit(dbapi_connection) if autocommit else contextlib.nullcontext():
            cursor = dbapi_connection.cursor()
            cursor.execute(statement, parameters)
            result = read(cursor)
            cursor.close()
    except BaseException as exc:
        interrupted = not isinstance(exc, Exception)
        invalidated = interrupted or (
            isinstance(exc, engine.dialect.loaded_dbapi.Error)
            and engine.dialect.is_disconnect(exc, dbapi_connection, cursor)
        )
        if invalidated and not interrupted:
            engine.pool._invalidate(pooled, exc)
        if invalidated and owner is not None:
            owner.invalidate(exc)
        elif invalidated and pooled.is_valid:
            pooled.invalidate(exc)
        if interrupted:
            raise
        raise dbapi_error(engine, exc, statement, parameters, invalidated=invalidated) from exc
    return result


class DialectGuard(t.Protocol):
    """What :func:`wrap_dialect` asks the commit guard (:mod:`flask_idem.commits`)."""

    def before_commit(self, dbapi_connection: t.Any, rollback: t.Callable[[], None]) -> None:
        """SQLAlchemy is about to commit on ``dbapi_connection``: raise to refuse it (after
        ``rollback()``, since SQLAlchemy counts a failed commit's transaction as over)."""

    def before_rollback(self, dbapi_connection: t.Any) -> None:
        """SQLAlchemy is about to roll back on ``dbapi_connection``."""

    def ending(self, statement: str, connection: sa.Connection) -> bool:
        """Refuse (raise) or note a statement of ``connection`` that ends its transaction;
        True when it ends one (the driver's count then leaves it out)."""

    def through_sqlalchemy(self, end: t.Callable[[], t.Any]) -> t.Any:
        """Run SQLAlchemy's own end of a transaction, uncounted by the driver's count."""


def wrap_dialect(engine: sa.Engine, guard: DialectGuard) -> None:
    """Replace ``engine``'s dialect's ``do_commit``, ``do_rollback``, ``do_execute`` and
    ``do_execute_no_params`` with ones that ask ``guard`` first (once per dialect, which one
    engine shared by several applications has once)."""
    dialect = engine.dialect
    if getattr(dialect.do_commit, _WRAPPED, False):
        return
    commit = dialect.do_commit
    rollback = dialect.do_rollback
    execute = dialect.do_execute
    execute_no_params = dialect.do_execute_no_params
    through = guard.through_sqlalchemy

    def do_commit(dbapi_connection: t.Any) -> None:
        guard.before_commit(dbapi_connection, lambda: do_rollback(dbapi_connection))
        through(lambda: commit(dbapi_connection))

    def do_rollback(dbapi_connection: t.Any) -> None:
        guard.before_rollback(dbapi_connection)
        through(lambda: rollback(dbapi_connection))

    def ends(statement: str, context: t.Any) -> bool:
        return context is not None and guard.ending(statement, context.root_connection)

    def do_execute(cursor: t.Any, statement: str, parameters: t.Any, context: t.Any = None) -> None:
        if ends(statement, context):
            through(lambda: execute(cursor, statement, parameters, context))
        else:
            execute(cursor, statement, parameters, context)

    def do_execute_no_params(cursor: t.Any, statement: str, context: t.Any = None) -> None:
        if ends(statement, context):
            through(lambda: execute_no_params(cursor, statement, context))
        else:
            execute_no_params(cursor, statement, context)

    setattr(do_commit, _WRAPPED, True)
    dialect.do_commit = do_commit  # type: ignore[method-assign]
    dialect.do_rollback = do_rollback  # type: ignore[method-assign]
    dialect.do_execute = do_execute  # type: ignore[method-assign]
    dialect.do_execute_no_params = do_execute_no_params  # type: ignore[method-assign]
