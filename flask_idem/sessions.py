"""Flask-SQLAlchemy integration: the application's ``db.session`` is the business transaction.

With ``Idempotency(app, db=db)`` (or with Flask-SQLAlchemy registered on the app and no other
database configured) the store runs on the application's engine (``db.engines[bind_key]``) and
the business transaction of a protected request is ``db.session``'s: what the view adds to the
session commits in the same transaction as the stored response, through ``session.commit()``,
and rolls back with it when the attempt fails. In an atomic view the claim itself is in that
transaction.

A protected view must not settle the session itself: ``db.session.commit()`` there would
commit the business rows before their stored response (the crash window this closes), and
``db.session.rollback()`` would undo work, or an atomic claim, behind the extension's back.
Both raise :class:`SessionSettled` (a crash of the view: the transaction rolls back, the key
is given up as for any exception). ``db.session.flush()`` is fine. Ending the transaction in
a way that cannot be refused (``close()``, ``remove()``, catching the refusal of a rollback,
which has happened) loses the view's rows: its answer is never stored (``work_lost``). Commits
of the session's connection and ``COMMIT`` statements are refused by :mod:`flask_idem.commits`.
A protected view's unclaimed requests (switched off, an optional key left out, a method outside
``IDEMPOTENCY_METHODS``) have the session settled the same way by flask_idem, and may also
commit it themselves; unprotected requests commit as usual.

Flask-SQLAlchemy is an optional extra (``pip install 'flask-idem[flask-sqlalchemy]'``); this
module never imports it.
"""

from __future__ import annotations

import dataclasses
import getpass
import os
import typing as t

import sqlalchemy as sa
from flask import Flask

from .core.errors import ConfigurationError, IdempotencyError
from .state import SESSION_ATTEMPT
from .store import commit_count, normalize_url

if t.TYPE_CHECKING:
    from .attempt import Attempt

#: ``app.extensions`` key of Flask-SQLAlchemy.
EXTENSION_KEY = "sqlalchemy"


class SessionSettled(IdempotencyError, RuntimeError):
    """A protected view committed or rolled back the session flask_idem settles for it."""


@dataclasses.dataclass(frozen=True)
class FlaskSQLAlchemySessions:
    """The sessions of one Flask-SQLAlchemy ``db`` and the engine of its bind."""

    db: t.Any
    bind_key: str | None = None

    @property
    def scoped(self) -> t.Any:
        return self.db.session

    def engine(self, app: Flask) -> sa.Engine:
        registered: object = app.extensions.get(EXTENSION_KEY)
        db: t.Any = self.db
        if id(registered) != id(db):  # identity, without narrowing db's type
            raise ConfigurationError(
                "Idempotency(db=db) needs db.init_app(app) (Flask-SQLAlchemy) to run before "
                "the idempotency extension's init_app"
            )
        with app.app_context():
            engines = db.engines
            if self.bind_key not in engines:
                raise ConfigurationError(
                    f"Flask-SQLAlchemy has no bind {self.bind_key!r}: set SQLALCHEMY_BINDS, or "
                    "pass bind_key=None for SQLALCHEMY_DATABASE_URI"
                )
            return t.cast(sa.Engine, engines[self.bind_key])

    def same_database(self, app: Flask, url: str | sa.URL) -> bool:
        """Whether ``url`` names the database of this bind, in whatever spelling: a SQLite file
        by its real path (a relative one also as Flask-SQLAlchemy reads it, in the instance
        folder), a PostgreSQL database by server, port, user and name, libpq's query
        parameters and defaults included (``localhost`` and ``127.0.0.1`` are one host)."""
        try:
            mine = self.engine(app).url
        except ConfigurationError:
            return False
        other = normalize_url(url)
        if mine.get_backend_name() != other.get_backend_name():
            return False
        if mine.get_backend_name() == "sqlite":
            path = _sqlite_path(mine)
            return path is not None and path in _sqlite_paths(app, other)
        return _server_identity(mine) == _server_identity(other)

    def install(self) -> None:
        """Refuse commits and rollbacks of the session by the protected view (once per db)."""
        scoped = self.scoped
        if not sa.event.contains(scoped, "before_commit", _refuse_commit):
            sa.event.listen(scoped, "before_commit", _refuse_commit)
            sa.event.listen(scoped, "after_soft_rollback", _refuse_rollback)
            sa.event.listen(scoped, "after_begin", _note_connection)
            sa.event.listen(scoped, "after_transaction_end", _note_end)


def _sqlite_path(url: sa.URL) -> str | None:
    if url.database in (None, "", ":memory:"):
        return None  # an in-memory database is never another engine's
    return os.path.realpath(url.database)


def _sqlite_paths(app: Flask, url: sa.URL) -> set[str]:
    """The files ``url`` may mean: from the working directory, and, relative, where
    Flask-SQLAlchemy puts it (the instance folder) when the same text is its URI."""
    path = _sqlite_path(url)
    if path is None:
        return set()
    paths = {path}
    assert url.database is not None
    if not os.path.isabs(url.database):
        paths.add(os.path.realpath(os.path.join(app.instance_path, url.database)))
    return paths


_LOCAL_HOSTS = {"localhost", "127.0.0.1", "::1"}


def _server_identity(url: sa.URL) -> tuple[str, int, str, str]:
    """(host, port, user, database) as libpq resolves them: URL, then query, then PG*."""
    query = url.query

    def pick(value: t.Any, name: str, variable: str, default: str) -> str:
        given = value or query.get(name) or os.environ.get(variable) or default
        return str(given[0] if isinstance(given, tuple) else given)

    host = pick(url.host, "host", "PGHOST", "localhost")
    user = pick(url.username, "user", "PGUSER", getpass.getuser())
    return (
        "localhost" if host in _LOCAL_HOSTS else host,
        int(pick(url.port, "port", "PGPORT", "5432")),
        user,
        pick(url.database, "dbname", "PGDATABASE", user),
    )


def resolve(app: Flask, db: t.Any, bind_key: str | None) -> FlaskSQLAlchemySessions | None:
    """The sessions to use: ``db`` when given, else Flask-SQLAlchemy's registered ``db``."""
    if db is None:
        db = app.extensions.get(EXTENSION_KEY)
        if db is None:
            return None
    return FlaskSQLAlchemySessions(db, bind_key)


#: ``session.info`` key set by a flush of a session flask_idem does not settle.
_FLUSHED = "flask_idem.flushed"


def watch_unmanaged(db: t.Any) -> None:
    """Note flushes of a Flask-SQLAlchemy session that is *not* the business transaction (the
    store runs on another database), so that :func:`has_unmanaged_writes` can tell."""
    scoped = db.session
    if not sa.event.contains(scoped, "after_flush", _note_flush):
        sa.event.listen(scoped, "after_flush", _note_flush)
        sa.event.listen(scoped, "after_commit", _forget_flush)
        sa.event.listen(scoped, "after_soft_rollback", _forget_rollback)


def has_unmanaged_writes(db: t.Any) -> bool:
    """Whether this context's ``db.session`` holds writes nobody committed yet."""
    registry = db.session.registry
    if not registry.has():
        return False
    session = registry()
    return bool(session.new or session.dirty or session.deleted or session.info.get(_FLUSHED))


def _note_flush(session: t.Any, _context: t.Any) -> None:
    session.info[_FLUSHED] = True


def _forget_flush(session: t.Any) -> None:
    session.info.pop(_FLUSHED, None)


def _forget_rollback(session: t.Any, _previous: t.Any) -> None:
    session.info.pop(_FLUSHED, None)


def _claimed(session: t.Any) -> Attempt | None:
    """The attempt holding a key whose business transaction the session is, while its view or
    job may write it (not while flask_idem itself settles it)."""
    attempt = t.cast("Attempt | None", session.info.get(SESSION_ATTEMPT))
    if attempt is None or not attempt.guarding:
        return None
    return attempt


#: ``session.info`` key: the connections of the session's current (outermost) transaction.
_CONNECTIONS = "flask_idem.connections"


def business_connections(session: t.Any) -> tuple[sa.Connection, ...]:
    """The connections the session's current transaction runs on (one per bind it used)."""
    return tuple(session.info.get(_CONNECTIONS, ()))


def replaced(scoped: t.Any, session: t.Any) -> bool:
    """Whether ``scoped`` (``db.session``) no longer hands out ``session``: the view removed
    it (``db.session.remove()``), and may have committed through the fresh one since."""
    registry = scoped.registry
    return not registry.has() or registry() is not session


def roll_back_fresh(scoped: t.Any) -> None:
    """Roll back what the view left uncommitted in the fresh ``db.session`` it got after
    removing the business one: the failed attempt's writes, which teardown would roll back a
    moment later, after the key is given up (on SQLite its write lock would hold that back)."""
    registry = scoped.registry
    if registry.has():
        registry().rollback()


def _note_connection(session: t.Any, _transaction: t.Any, connection: sa.Connection) -> None:
    session.info.setdefault(_CONNECTIONS, []).append(connection)
    commit_count.zero(connection)  # a commit below the session counts from its start


def _note_end(session: t.Any, transaction: t.Any) -> None:
    """The outermost transaction ended: if the claimed view ended it itself before answering
    (``close()``, ``remove()``, a refused rollback it caught), its writes are gone."""
    if transaction.parent is not None:
        return  # a savepoint: the business transaction goes on
    session.info.pop(_CONNECTIONS, None)
    attempt = _claimed(session)
    if attempt is not None and attempt.view_running:
        attempt.lose_work()


def _refuse_commit(session: t.Any) -> None:
    # Releasing a savepoint (``begin_nested()``) commits nothing: only the outer commit is ours.
    if _claimed(session) is not None and not session.in_nested_transaction():
        raise SessionSettled(
            "db.session.commit() in a protected view: flask_idem commits the session together "
            "with the stored response; use db.session.flush() to write early"
        )


def _refuse_rollback(session: t.Any, previous_transaction: t.Any) -> None:
    attempt = _claimed(session)
    if previous_transaction.parent is None and attempt is not None and attempt.view_running:
        raise SessionSettled(
            "db.session.rollback() in a protected view: raise an exception (or return an "
            "error response) instead, and flask_idem rolls the transaction back"
        )
