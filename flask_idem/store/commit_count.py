"""Driver connections that count the ends of their transactions, so that one made below
SQLAlchemy shows.

A view can reach the driver's connection under ``idem.connection()`` (or ``db.session``'s) and
call its ``commit()`` or ``rollback()``, or send ``COMMIT`` through a raw driver cursor.
psycopg2 and psycopg 3 then leave nothing to tell that end from a transaction that never
started, and a statement after it begins a new one, so the transaction status at the end of
the attempt says nothing. So the PostgreSQL store engine's connections are opened from
subclasses that count (:data:`ATTRIBUTE`) each ``commit()`` and ``rollback()`` SQLAlchemy did
not make itself (:func:`through_sqlalchemy`), and each statement of their cursors that ends
the transaction (:mod:`.statements`; one anchored prefilter match per statement).
:mod:`flask_idem.commits` zeroes the count when an attempt claims or opens its business
transaction, and reads it when the attempt answers or gives up.

A commit on *any* connection of the engine, while an attempt runs in this context, also counts
for that attempt (:class:`Tally`, :func:`tally_attempt`): writes committed through another
connection (``with db.engine.begin()``) stay whatever the attempt does next. flask_idem's own
store primitives run under :func:`store_own` and count for nobody.

:func:`flask_idem.store.fast_path.open_counting` opens them for an engine flask_idem did not
build (Flask-SQLAlchemy's, ``IDEMPOTENCY_ENGINE``) unless its ``connect_args`` name a
connection class of their own; the client-side deadline's connection classes (:mod:`.engines`,
:mod:`.deadline_psycopg`) count too.
SQLite needs none of it: its store transactions all begin with an explicit ``BEGIN``, so
sqlite3's ``in_transaction`` shows one ended below SQLAlchemy (see :func:`ended_below`, what
:func:`flask_idem.commits.ended_outside` asks).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import typing as t

import psycopg2.extensions
import sqlalchemy as sa

from .statements import ends_transaction, may_end

#: The attribute holding a connection's count of ends since it was last zeroed.
ATTRIBUTE = "flask_idem_ends"
#: Marks an end of the transaction SQLAlchemy announced (:func:`sqlalchemy_ends_next`).
_ANNOUNCED = "flask_idem_sqlalchemy_ends_next"

#: True while SQLAlchemy itself commits or rolls back (its ``do_commit``, ``do_rollback``).
_SQLALCHEMY_ENDS: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "flask_idem_sqlalchemy_ends", default=False
)
#: True while a store primitive of flask_idem's own runs.
_STORE_OWN: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "flask_idem_store_own", default=False
)


@dataclasses.dataclass
class Tally:
    """The commits a running attempt's context made on any connection of the store's engine,
    flask_idem's own store primitives aside."""

    commits: int = 0


_ATTEMPT: contextvars.ContextVar[Tally | None] = contextvars.ContextVar(
    "flask_idem_attempt_tally", default=None
)


def tally_attempt() -> Tally:
    """Count this context's commits for the attempt that just claimed, from now on."""
    tally = Tally()
    _ATTEMPT.set(tally)
    return tally


def note_commit() -> None:
    """A commit in this context: the running attempt's, unless a store primitive made it."""
    tally = _ATTEMPT.get()
    if tally is not None and not _STORE_OWN.get():
        tally.commits += 1


def in_store_primitive() -> bool:
    """Whether a store primitive of flask_idem's own runs in this context."""
    return _STORE_OWN.get()


@contextlib.contextmanager
def store_own() -> t.Iterator[None]:
    """A store primitive of flask_idem's runs: its commits are no attempt's."""
    token = _STORE_OWN.set(True)
    try:
        yield
    finally:
        _STORE_OWN.reset(token)


_Result = t.TypeVar("_Result")


def through_sqlalchemy(end: t.Callable[[], _Result]) -> _Result:
    """Run SQLAlchemy's own commit or rollback (or a statement its guard already looked at):
    the driver's count leaves it out."""
    token = _SQLALCHEMY_ENDS.set(True)
    try:
        return end()
    finally:
        _SQLALCHEMY_ENDS.reset(token)


def sqlalchemy_ends_next(dbapi_connection: t.Any) -> None:
    """The next end of ``dbapi_connection``'s transaction is SQLAlchemy's own, announced by an
    event before it happens (the commit guard on public API only, :mod:`flask_idem.commits`):
    the driver's count leaves it out. An end SQLAlchemy announced and then skipped (an
    invalidated connection, a pool reset after a rollback) leaves the mark until the
    connection is next checked out (:func:`forget_announced_end`)."""
    if hasattr(dbapi_connection, ATTRIBUTE):  # a counting connection (not sqlite3's)
        setattr(dbapi_connection, _ANNOUNCED, True)


def forget_announced_end(dbapi_connection: t.Any) -> None:
    """Drop an announced end that never came: the connection starts a new checkout."""
    if getattr(dbapi_connection, _ANNOUNCED, False):
        setattr(dbapi_connection, _ANNOUNCED, False)


def _sqlalchemy_own(dbapi_connection: t.Any) -> bool:
    """Whether this end of a transaction is SQLAlchemy's own (an announced one is used up)."""
    if getattr(dbapi_connection, _ANNOUNCED, False):
        setattr(dbapi_connection, _ANNOUNCED, False)
        return True
    return _SQLALCHEMY_ENDS.get()


def _no_refusal(dbapi_connection: t.Any) -> None:
    """What :data:`refuse_end` is until :mod:`flask_idem.commits` installs its check."""


#: Called before an end of a transaction below SQLAlchemy, with its driver connection:
#: :mod:`flask_idem.commits` raises there on an atomic attempt's business connection (or
#: ``db.session``'s), so that nothing is published before its record (see
#: :func:`refuse_ends_with`).
_refuse_end: list[t.Callable[[t.Any], None]] = [_no_refusal]


def refuse_ends_with(check: t.Callable[[t.Any], None]) -> None:
    """Install ``check``, run before every end of a transaction below SQLAlchemy (a driver's
    ``commit()`` or ``rollback()``, an ending statement through a raw cursor); it raises to
    refuse the end before it happens."""
    _refuse_end[0] = check


def _ended(dbapi_connection: t.Any, *, may_commit: bool) -> None:
    setattr(dbapi_connection, ATTRIBUTE, getattr(dbapi_connection, ATTRIBUTE, 0) + 1)
    if may_commit:
        note_commit()


_End = t.TypeVar("_End", bound=t.Callable[..., t.Any])


def counting(end: _End, *, may_commit: bool = True) -> _End:
    """``end`` (a driver connection's ``commit`` or ``rollback``) counting each call that went
    through and was not SQLAlchemy's own."""

    def end_and_count(self: t.Any) -> t.Any:
        if _sqlalchemy_own(self):
            return end(self)
        _refuse_end[0](self)
        result = end(self)
        _ended(self, may_commit=may_commit)
        return result

    end_and_count.__name__ = end.__name__
    end_and_count.__doc__ = end.__doc__
    return t.cast(_End, end_and_count)


def _sql_of(query: t.Any, cursor: t.Any) -> str | None:
    if isinstance(query, str):
        return query  # a subclass of str
    if isinstance(query, bytes):
        return query.decode("utf-8", "replace")
    as_string = getattr(query, "as_string", None)  # psycopg's sql.Composable
    return None if as_string is None else str(as_string(cursor.connection))


def _watching(execute: _End) -> _End:
    """A cursor's ``execute`` counting a statement that ends the transaction (before it runs:
    one that fails may still have ended it)."""

    def execute_and_watch(self: t.Any, query: t.Any, *args: t.Any, **kwargs: t.Any) -> t.Any:
        sql = query if type(query) is str else _sql_of(query, self)
        if (
            sql is not None
            and may_end(sql)
            and ends_transaction(sql)
            and not _sqlalchemy_own(self.connection)
        ):
            _refuse_end[0](self.connection)
            _ended(self.connection, may_commit=True)
        return execute(self, query, *args, **kwargs)

    execute_and_watch.__name__ = execute.__name__
    execute_and_watch.__doc__ = execute.__doc__
    return t.cast(_End, execute_and_watch)


@functools.cache
def watched_cursor_class(factory: t.Any) -> t.Any:
    """``factory`` (a driver's cursor class) whose ``execute`` and ``executemany`` count a
    statement ending the transaction; a factory that is not a class is kept as it is."""
    if not isinstance(factory, type):
        return factory
    body = {name: _watching(getattr(factory, name)) for name in ("execute", "executemany")}
    return type(f"Watched{factory.__name__}", (factory,), body)


_plain_cursor = psycopg2.extensions.cursor


def psycopg2_cursor_factory(connection: t.Any, cursor_factory: t.Any) -> t.Any:
    """The watched class of the cursor factory a psycopg2 ``connection.cursor()`` call uses."""
    return watched_cursor_class(cursor_factory or connection.cursor_factory or _plain_cursor)


class Psycopg2Connection(psycopg2.extensions.connection):  # type: ignore[misc]
    """A psycopg2 connection that counts the ends of its transactions."""

    flask_idem_ends = 0
    commit = counting(psycopg2.extensions.connection.commit)
    rollback = counting(psycopg2.extensions.connection.rollback, may_commit=False)

    def cursor(
        self, name: str | None = None, cursor_factory: t.Any = None, *args: t.Any, **kwargs: t.Any
    ) -> t.Any:
        factory = psycopg2_cursor_factory(self, cursor_factory)
        return super().cursor(name, factory, *args, **kwargs)


def _watched_factory(name: str) -> property:
    """A psycopg 3 connection's ``cursor_factory`` (or ``server_cursor_factory``) that is
    always watched, whoever sets it (``__init__``, ``connect(cursor_factory=...)``)."""
    attribute = f"_flask_idem_{name}"

    def get(self: t.Any) -> t.Any:
        return getattr(self, attribute)

    def set_(self: t.Any, factory: t.Any) -> None:
        setattr(self, attribute, watched_cursor_class(factory))

    return property(get, set_)


@functools.cache
def psycopg_class() -> type[t.Any]:
    """The psycopg 3 connection class that counts the ends of its transactions (psycopg 3 is
    optional)."""
    import psycopg

    body = {
        ATTRIBUTE: 0,
        "commit": counting(psycopg.Connection.commit),
        "rollback": counting(psycopg.Connection.rollback, may_commit=False),
        "cursor_factory": _watched_factory("cursor_factory"),
        "server_cursor_factory": _watched_factory("server_cursor_factory"),
    }
    return type("CountingConnection", (psycopg.Connection,), body)


def zero(connection: sa.Connection) -> None:
    """Count the ends of ``connection``'s driver connection from now on."""
    dbapi = connection.connection.dbapi_connection
    if getattr(dbapi, ATTRIBUTE, None):
        setattr(dbapi, ATTRIBUTE, 0)


def ended(connection: sa.Connection) -> bool:
    """Whether ``connection``'s driver connection ended a transaction below SQLAlchemy since
    :func:`zero`."""
    return bool(getattr(connection.connection.dbapi_connection, ATTRIBUTE, 0))


def ended_below(connection: sa.Connection) -> bool:
    """Whether ``connection``'s transaction was committed or rolled back below SQLAlchemy
    since :func:`zero`: its driver connection counted an end (its own ``commit()`` or
    ``rollback()``, a ``COMMIT`` through a raw cursor), or SQLAlchemy still holds open a
    transaction the driver ended (a driver connection that does not count: psycopg2's status
    says so, sqlite3's ``in_transaction``)."""
    if ended(connection):
        return True
    if not connection.in_transaction():
        return False
    dbapi = connection.connection.dbapi_connection
    if hasattr(dbapi, ATTRIBUTE):
        return False  # it counts every end below SQLAlchemy, and a COMMIT statement is not one
    if isinstance(dbapi, psycopg2.extensions.connection):
        # psycopg2 began a transaction the server no longer has (a COMMIT through a cursor).
        return bool(
            dbapi.status != psycopg2.extensions.STATUS_READY
            and dbapi.info.transaction_status == psycopg2.extensions.TRANSACTION_STATUS_IDLE
        )
    return getattr(dbapi, "in_transaction", True) is False  # sqlite3


def resynchronise(dbapi_connection: t.Any) -> None:
    """Put psycopg2 back in step where it believes a transaction is open that the server has
    ended (a hook sent ``COMMIT`` or ``ROLLBACK`` as SQL, which psycopg2 does not see): it would
    send no ``BEGIN``, and each statement after would commit on its own (an atomic claim's lock
    and reservation with it, a durable view's rows apart from their record). Its rollback (the
    server has nothing left to roll back) makes the next statement begin a real transaction;
    not counted as an end of the business transaction. psycopg 3 reads the server's state."""
    if (
        isinstance(dbapi_connection, psycopg2.extensions.connection)
        and dbapi_connection.status == psycopg2.extensions.STATUS_BEGIN
        and dbapi_connection.info.transaction_status == psycopg2.extensions.TRANSACTION_STATUS_IDLE
    ):
        through_sqlalchemy(dbapi_connection.rollback)
