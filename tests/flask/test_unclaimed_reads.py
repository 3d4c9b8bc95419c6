"""Reads of views protected app-wide or blueprint-wide are left as Flask leaves them.

A GET or HEAD that changes a loaded object for display (or leaves a half-built one in the
session after a handled error) commits nothing: only unsafe methods of a protected view have
their unclaimed business transaction settled by flask_idem.
"""

from __future__ import annotations

import typing as t

import flask
import pytest
import sqlalchemy as sa
from flask import Flask

from flask_idem import Idempotency
from flask_idem.store import normalize_url
from tests.support.fsa_app import Order, db, discard


@pytest.fixture(params=["protect_all", "protect_blueprint"])
def app(request: pytest.FixtureRequest, db_url: str) -> t.Iterator[Flask]:
    app = Flask("reads")
    app.config.update(
        SQLALCHEMY_DATABASE_URI=normalize_url(db_url).render_as_string(hide_password=False),
        IDEMPOTENCY_PROTECT_ALL=request.param == "protect_all",
    )
    db.init_app(app)
    idem = Idempotency(db=db, tenant=lambda: "alpha")
    api = flask.Blueprint("api", __name__)
    if request.param == "protect_blueprint":
        idem.protect_blueprint(api)

    @api.get("/customers/<int:cid>")
    def show_customer(cid: int) -> t.Any:
        customer = db.session.get(Order, cid)
        assert customer is not None
        customer.note = customer.note.upper()  # for display only: never meant to be saved
        return {"name": customer.note}

    app.register_blueprint(api)
    idem.init_app(app)
    with app.app_context():
        db.create_all()
        db.session.add(Order(id=1, note="ada"))
        db.session.commit()
    yield app
    discard(app)


def test_a_read_leaves_the_database_as_it_was(app: Flask) -> None:
    response = app.test_client().get("/customers/1")
    assert response.status_code == 200 and response.get_json() == {"name": "ADA"}
    with app.app_context():
        name = db.session.scalar(sa.select(Order.note).where(Order.id == 1))
    assert name == "ada", "a GET committed the view's in-memory change"
