"""Flask-SQLAlchemy set up the ways a new application does, and db.session keeps its writes.

``IDEMPOTENCY_DATABASE_URL`` naming the same database as ``SQLALCHEMY_DATABASE_URI`` (without
``db=``) makes ``db.session`` the business transaction, as ``db=`` does: a view that leaves its
commit to flask_idem keeps its rows. An application error handler that rolls ``db.session``
back (the usual Flask-SQLAlchemy habit) gets its own answer to the client, and an
``abort(404)`` is still stored and replayed. ``idem.refuse()`` ends the view where it is called.
"""

from __future__ import annotations

import typing as t

import flask
import pytest
from flask import Flask
from werkzeug.exceptions import HTTPException

from flask_idem import Idempotency
from flask_idem.store import normalize_url
from tests.support.fsa_app import Order, db, notes


def _app(db_url: str, *, db_argument: bool, handler: bool = False) -> tuple[Flask, Idempotency]:
    url = normalize_url(db_url).render_as_string(hide_password=False)
    app = Flask("setups")
    app.config.update(SQLALCHEMY_DATABASE_URI=url, PROPAGATE_EXCEPTIONS=False)
    if not db_argument:
        app.config["IDEMPOTENCY_DATABASE_URL"] = url  # the same database, named again
    db.init_app(app)
    idem = Idempotency(app, db=db if db_argument else None, tenant=lambda: "alpha")
    if handler:

        @app.errorhandler(Exception)
        def everything(error: Exception) -> t.Any:
            db.session.rollback()
            if isinstance(error, HTTPException):
                return error
            return {"error": "internal"}, 500

    with app.app_context():
        db.create_all()
    return app, idem


@pytest.mark.parametrize("atomic", [False, True], ids=["durable", "atomic"])
def test_the_same_database_named_twice_commits_the_session_with_the_record(
    db_url: str, fsa_apps: list[Flask], atomic: bool
) -> None:
    app, idem = _app(db_url, db_argument=False)
    fsa_apps.append(app)
    with app.app_context():
        assert app.extensions["idempotency"].store.engine is db.engine, "one engine"

    @app.post("/orders")
    @idem.idempotent(atomic=atomic)
    def create_order() -> t.Any:
        db.session.add(Order(note="kept"))
        return {"ok": True}, 201

    client = app.test_client()
    key = {"Idempotency-Key": f"same-database-{atomic}"}
    assert client.post("/orders", headers=key).status_code == 201
    retry = client.post("/orders", headers=key)
    assert retry.headers["Idempotent-Replayed"] == "true"
    assert notes(app) == ["kept"]


def test_an_error_handler_that_rolls_back_keeps_the_answers(
    db_url: str, fsa_apps: list[Flask]
) -> None:
    app, idem = _app(db_url, db_argument=True, handler=True)
    fsa_apps.append(app)

    @app.post("/orders/<note>")
    @idem.idempotent
    def create_order(note: str) -> t.Any:
        db.session.add(Order(note=note))
        if note == "missing":
            flask.abort(404)
        raise RuntimeError("after the write")

    client = app.test_client()
    first = client.post("/orders/missing", headers={"Idempotency-Key": "m"})
    assert first.status_code == 404 and first.mimetype != "application/problem+json"
    replay = client.post("/orders/missing", headers={"Idempotency-Key": "m"})
    assert replay.status_code == 404 and replay.headers["Idempotent-Replayed"] == "true"
    crashed = client.post("/orders/crash", headers={"Idempotency-Key": "c"})
    assert crashed.status_code == 500 and crashed.get_json() == {"error": "internal"}
    assert notes(app) == [], "nothing the handler rolled back commits"


def test_refuse_ends_the_view_where_it_is_called(db_url: str, fsa_apps: list[Flask]) -> None:
    app, idem = _app(db_url, db_argument=True)
    fsa_apps.append(app)
    quota = {"left": 0}

    @app.post("/orders")
    @idem.idempotent
    def create_order() -> t.Any:
        if quota["left"] == 0:
            idem.refuse(({"error": "daily limit"}, 429))  # no return: it raises, as abort()
        db.session.add(Order(note="made"))
        return {"ok": True}, 201

    client = app.test_client()
    refused = client.post("/orders", headers={"Idempotency-Key": "q"})
    assert refused.status_code == 429 and refused.get_json() == {"error": "daily limit"}
    assert notes(app) == []
    quota["left"] = 1
    made = client.post("/orders", headers={"Idempotency-Key": "q"})
    assert made.status_code == 201 and "Idempotent-Replayed" not in made.headers
    assert notes(app) == ["made"]
