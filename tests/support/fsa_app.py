"""The Flask-SQLAlchemy pieces of the tests in which ``db.session`` is the business transaction:
one model, an application configured on a test database, and its cleanup."""

from __future__ import annotations

import typing as t

import sqlalchemy as sa
from flask import Flask
from flask_sqlalchemy import SQLAlchemy
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from flask_idem import Idempotency
from flask_idem.store import normalize_url
from flask_idem.testing import empty_store


class Base(DeclarativeBase):
    pass


db = SQLAlchemy(model_class=Base)


class Order(db.Model):  # type: ignore[name-defined,misc]
    """The business row: a view adds one and leaves its commit to flask_idem."""

    __tablename__ = "fsa_orders"
    id: Mapped[int] = mapped_column(primary_key=True)
    note: Mapped[str] = mapped_column(sa.String(50), default="")


def application(db_url: str, name: str, **config: t.Any) -> Flask:
    """A Flask app with Flask-SQLAlchemy on ``db_url``; exceptions become 500s, as deployed."""
    app = Flask(name)
    app.config.update(
        SQLALCHEMY_DATABASE_URI=normalize_url(db_url).render_as_string(hide_password=False),
        PROPAGATE_EXCEPTIONS=False,
        **config,
    )
    db.init_app(app)
    return app


def protected(db_url: str, name: str) -> tuple[Flask, Idempotency]:
    """:func:`application` with flask_idem on it, ``db.session`` its business transaction
    (``Idempotency(db=db)``, tenant ``alpha``), on an empty store."""
    app = application(db_url, name)
    idem = Idempotency(app, db=db, tenant=lambda: "alpha")
    empty_store(app.extensions["idempotency"].store)
    return app, idem


def create_tables(app: Flask) -> None:
    """Create the app's tables (:class:`Order`)."""
    with app.app_context():
        db.create_all()


def discard(app: Flask) -> None:
    """Drop the app's tables and close its connections (none may stay checked out)."""
    with app.app_context():
        db.session.remove()
        db.drop_all()
        db.engine.dispose()


def notes(app: Flask) -> list[str]:
    """The notes of the committed orders, sorted."""
    with app.app_context():
        found = sorted(db.session.scalars(sa.select(Order.note)))
        db.session.remove()
        return found
