"""An atomic view's error handler that rolls ``db.session`` back (the usual habit) takes the
claim with it: the view's own answer (a raised 404) goes out unstored and the key is free, never
a 503 on every attempt.
"""

from __future__ import annotations

import typing as t

import flask
import pytest
import sqlalchemy as sa
from flask import Flask
from werkzeug.exceptions import HTTPException

from tests.support.fsa_app import Order, db, discard, protected


@pytest.fixture
def app(db_url: str) -> t.Iterator[Flask]:
    app, idem = protected(db_url, "atomic-handler")

    @app.errorhandler(HTTPException)
    def rendered(error: HTTPException) -> t.Any:
        db.session.rollback()  # the usual habit
        return error

    @app.post("/orders")
    @idem.idempotent(atomic=True)
    def create_order() -> t.Any:
        db.session.add(Order())
        db.session.flush()
        flask.abort(404)

    with app.app_context():
        db.create_all()
    yield app
    discard(app)


def test_an_atomic_views_404_survives_the_handlers_rollback(app: Flask) -> None:
    client = app.test_client()
    first = client.post("/orders", headers={"Idempotency-Key": "atomic-handler"})
    retry = client.post("/orders", headers={"Idempotency-Key": "atomic-handler"})
    assert (first.status_code, retry.status_code) == (404, 404), first.get_data(as_text=True)
    with app.app_context():
        rows = db.session.scalar(sa.select(sa.func.count()).select_from(Order))
        db.session.remove()
    assert rows == 0
