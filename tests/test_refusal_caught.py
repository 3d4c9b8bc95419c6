"""A refusal counts only when it ends the view: a view that catches what ``idem.refuse()``
raised (a fail-open quota helper under ``except Exception``) and goes on to charge and answer
201 keeps its rows and its stored answer, and its key is never given back.
"""

from __future__ import annotations

import typing as t

import pytest
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


class Charge(db.Model):  # type: ignore[name-defined,misc]
    __tablename__ = "review_refuse_charges"
    id: Mapped[int] = mapped_column(primary_key=True)


@pytest.fixture
def app(db_url: str) -> t.Iterator[tuple[Flask, list[int]]]:
    app = Flask("refuse-swallowed")
    app.config.update(
        SQLALCHEMY_DATABASE_URI=normalize_url(db_url).render_as_string(hide_password=False),
        PROPAGATE_EXCEPTIONS=False,
    )
    db.init_app(app)
    idem = Idempotency(app, db=db, tenant=lambda: "alpha")
    empty_store(app.extensions["idempotency"].store)
    provider: list[int] = []

    def check_quota() -> None:
        idem.refuse(({"error": "daily limit"}, 429))

    @app.post("/charges")
    @idem.idempotent
    def charge() -> t.Any:
        try:
            check_quota()
        except Exception:
            pass  # the quota service is best effort: fail open
        provider.append(1)  # the provider charges the card
        db.session.add(Charge())
        return {"charged": True}, 201

    with app.app_context():
        db.create_all()
    yield app, provider
    with app.app_context():
        db.session.remove()
        db.drop_all()
        db.engine.dispose()


def test_a_caught_refusal_does_not_give_up_the_answer_that_followed(
    app: tuple[Flask, list[int]],
) -> None:
    flask_app, provider = app
    client = flask_app.test_client()
    first = client.post("/charges", headers={"Idempotency-Key": "swallowed-1"})
    assert first.status_code == 201
    retry = client.post("/charges", headers={"Idempotency-Key": "swallowed-1"})
    with flask_app.app_context():
        rows = db.session.scalar(sa.select(sa.func.count()).select_from(Charge))
        db.session.remove()
    assert len(provider) == 1, f"charged {len(provider)} times under one key"
    assert retry.headers.get("Idempotent-Replayed") == "true"
    assert rows == 1, "the 201's row was rolled back"
