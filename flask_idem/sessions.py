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
is given up as for any exception). ``db.session.flush()`` is fine. A protected view's
unclaimed requests (switched off, an optional key left out, a method outside
``IDEMPOTENCY_METHODS``) have the session settled the same way by flask_idem, and may also
commit it themselves; unprotected requests commit as usual.

Flask-SQLAlchemy is an optional extra (``pip install 'flask-idem[flask-sqlalchemy]'``); this
module never imports it.
"""

from __future__ import annotations

import dataclasses
import os
import typing as t

import sqlalchemy as sa
from flask import Flask

from .errors import ConfigurationError, IdempotencyError
from .state import SESSION_STATE, RequestState
from .store import normalize_url

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
        """Whether ``url`` names the database of this bind (a SQLite file by its absolute
        path: Flask-SQLAlchemy puts relative ones in the instance folder)."""
        try:
            mine = self.engine(app).url
        except ConfigurationError:
            return False
        other = normalize_url(url)
        if mine.get_backend_name() != other.get_backend_name():
            return False
        if mine.get_backend_name() == "sqlite":
            return _sqlite_path(mine) == _sqlite_path(other)
        fields = ("host", "port", "database", "username")
        return all(getattr(mine, name) == getattr(other, name) for name in fields)

    def install(self) -> None:
        """Refuse commits and rollbacks of the session by the protected view (once per db)."""
        scoped = self.scoped
        if not sa.event.contains(scoped, "before_commit", _refuse_commit):
            sa.event.listen(scoped, "before_commit", _refuse_commit)
            sa.event.listen(scoped, "after_soft_rollback", _refuse_rollback)


def _sqlite_path(url: sa.URL) -> str | None:
    if url.database in (None, "", ":memory:"):
        return None  # an in-memory database is never another engine's
    return os.path.abspath(url.database)


def resolve(app: Flask, db: t.Any, bind_key: str | None) -> FlaskSQLAlchemySessions | None:
    """The sessions to use: ``db`` when given, else Flask-SQLAlchemy's registered ``db``."""
    if db is None:
        db = app.extensions.get(EXTENSION_KEY)
        if db is None:
            return None
    return FlaskSQLAlchemySessions(db, bind_key)


def _claimed(session: t.Any) -> RequestState | None:
    state = t.cast("RequestState | None", session.info.get(SESSION_STATE))
    if state is None or state.settling or state.token is None or state.finished:
        return None
    return state


def _refuse_commit(session: t.Any) -> None:
    # Releasing a savepoint (``begin_nested()``) commits nothing: only the outer commit is ours.
    if _claimed(session) is not None and not session.in_nested_transaction():
        raise SessionSettled(
            "db.session.commit() in a protected view: flask_idem commits the session together "
            "with the stored response; use db.session.flush() to write early"
        )


def _refuse_rollback(session: t.Any, previous_transaction: t.Any) -> None:
    state = _claimed(session)
    if previous_transaction.parent is None and state is not None and not state.answered:
        raise SessionSettled(
            "db.session.rollback() in a protected view: raise an exception (or return an "
            "error response) instead, and flask_idem rolls the transaction back"
        )
