"""A claimed view's own db.session.commit() is refused also when a before_request hook used
idem.connection() first (an API-key lookup in the same database): the business rows never
commit before their stored response, whatever opened the session's transaction.
"""

from __future__ import annotations

import typing as t

import pytest
import sqlalchemy as sa
from flask import Flask

from flask_idem import Idempotency
from tests.support.fsa_app import Order, application, db, discard

pytestmark = pytest.mark.usefixtures("sqlalchemy_path")


@pytest.fixture
def app(pg_url: str) -> t.Iterator[Flask]:
    # PostgreSQL: on SQLite the hook's open session transaction holds the write lock, and
    # the claim itself waits 5 s and answers 503 (the same root cause, another symptom).
    app = application(pg_url, "settled")
    idem = Idempotency(app, db=db, tenant=lambda: "alpha")

    @app.before_request
    def authenticate() -> None:
        idem.connection().execute(sa.text("SELECT 1"))  # e.g. the API key's tenant

    @app.post("/payments")
    @idem.idempotent(recovery="reexecute")
    def pay() -> t.Any:
        db.session.add(Order())
        db.session.commit()  # forbidden in a protected view: must raise SessionSettled
        return {"paid": True}, 201

    with app.app_context():
        db.create_all()
    yield app
    discard(app)


def test_the_views_own_commit_is_refused_after_an_early_connection(app: Flask) -> None:
    client = app.test_client()
    first = client.post("/payments", headers={"Idempotency-Key": "settled-1"})
    with app.app_context():
        count = db.session.scalar(sa.select(sa.func.count()).select_from(Order))
    assert count == 0, f"the view committed its rows itself (answer {first.status_code})"
    assert first.status_code == 500, first.get_data(as_text=True)
