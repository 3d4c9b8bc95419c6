"""Driver connections that count their own commits, so that one made below SQLAlchemy shows.

A view can reach the driver's connection under ``idem.connection()`` (or ``db.session``'s) and
call its ``commit()``. psycopg2 and psycopg 3 then leave nothing to tell that commit from a
transaction that never started, and a statement after it begins a new one, so the transaction
status at the end of the attempt says nothing. (SQLite's store connections begin every
transaction with an explicit ``BEGIN``, so sqlite3 shows one ended below SQLAlchemy as no
transaction at all.) So the PostgreSQL store engine's connections are opened from subclasses
whose ``commit()`` counts each commit that went through
(:data:`ATTRIBUTE`): :mod:`flask_idem.commits` zeroes the count when an attempt claims or
opens its business transaction, and reads it when the attempt gives up. The cost is one
Python call per commit; statements are untouched.

:func:`open_counting` opens them for an engine flask_idem did not build (Flask-SQLAlchemy's,
``IDEMPOTENCY_ENGINE``) unless its ``connect_args`` name a connection class of their own; the
client-side deadline's connection classes (:mod:`.guards`, :mod:`.deadline_psycopg`) count too.
"""

from __future__ import annotations

import functools
import typing as t

import psycopg2.extensions
import sqlalchemy as sa

#: The attribute holding a connection's count of commits since it was last zeroed.
ATTRIBUTE = "flask_idem_commits"
_OPENS_COUNTING = "flask_idem_opens_counting"

_Commit = t.TypeVar("_Commit", bound=t.Callable[..., t.Any])


def counting(commit: _Commit) -> _Commit:
    """``commit`` (a driver connection's method) counting each commit that went through."""

    def commit_and_count(self: t.Any) -> t.Any:
        result = commit(self)
        self.flask_idem_commits += 1
        return result

    commit_and_count.__name__ = commit.__name__
    commit_and_count.__doc__ = commit.__doc__
    return t.cast(_Commit, commit_and_count)


class Psycopg2Connection(psycopg2.extensions.connection):  # type: ignore[misc]
    """A psycopg2 connection that counts its commits."""

    flask_idem_commits = 0
    commit = counting(psycopg2.extensions.connection.commit)


@functools.cache
def psycopg_class() -> type[t.Any]:
    """The psycopg 3 connection class that counts its commits (psycopg 3 is optional)."""
    import psycopg

    return type(
        "CountingConnection",
        (psycopg.Connection,),
        {ATTRIBUTE: 0, "commit": counting(psycopg.Connection.commit)},
    )


def open_counting(engine: sa.Engine) -> None:
    """Open ``engine``'s new PostgreSQL connections from the counting classes (once per
    dialect)."""
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


def zero(connection: sa.Connection) -> None:
    """Count the commits of ``connection``'s driver connection from now on."""
    dbapi = connection.connection.dbapi_connection
    if getattr(dbapi, ATTRIBUTE, None):
        setattr(dbapi, ATTRIBUTE, 0)


def committed(connection: sa.Connection) -> bool:
    """Whether ``connection``'s driver connection committed since :func:`zero`."""
    return bool(getattr(connection.connection.dbapi_connection, ATTRIBUTE, 0))
