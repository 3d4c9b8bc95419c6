"""A business transaction rolled back by the view or by a hook, not by flask_idem, then
answered with a success: what the view wrote is gone, so that success is never stored or
replayed (a 500 says the work was not recorded, and the key is left as after any failure). An
error answer after such a rollback stands for what committed (nothing) and is stored as usual.

Both SQLAlchemy paths: the rollback is seen by the wrapped dialect and by SQLAlchemy's events.
"""

from __future__ import annotations

import typing as t
import uuid

import flask
import pytest
import sqlalchemy as sa

from flask_idem import Idempotency, JobOutcomePending
from flask_idem.core.record import Scope, State
from flask_idem.store import SQLStore
from tests.support.fsa_app import Order, application, db, discard, notes
from tests.support.helpers import with_tables

pytestmark = pytest.mark.usefixtures("sqlalchemy_path")

ledger = sa.Table(
    "rollback_ledger",
    sa.MetaData(),
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("note", sa.String(64)),
)


@pytest.fixture
def ledger_store(store: SQLStore) -> t.Iterator[SQLStore]:
    with with_tables(store, ledger):
        yield store


def _ledger(store: SQLStore) -> list[str]:
    with store.engine.connect() as conn:
        return list(conn.scalars(sa.select(ledger.c.note)))


def _connection_app(store: SQLStore, status: int) -> tuple[flask.Flask, list[str]]:
    """A view that writes through idem.connection(), rolls that back, and answers ``status``."""
    app = flask.Flask("rolled-back")
    app.config.update(PROPAGATE_EXCEPTIONS=False)
    idem = Idempotency(app, store=store, tenant=lambda: "alpha")
    runs: list[str] = []

    @app.post("/orders")
    @idem.idempotent
    def order() -> t.Any:
        runs.append("run")
        connection = idem.connection()
        connection.execute(ledger.insert().values(note="order"))
        connection.rollback()  # the view changed its mind; its row is gone
        return {"ordered": status < 400}, status

    return app, runs


def test_a_success_after_the_view_rolled_its_writes_back_is_never_stored(
    ledger_store: SQLStore,
) -> None:
    app, runs = _connection_app(ledger_store, 201)
    client = app.test_client()
    first = client.post("/orders", headers={"Idempotency-Key": "rb-1"})
    assert first.status_code == 500, first.get_data(as_text=True)
    assert first.json is not None and first.json["type"].endswith("internal-error")
    assert _ledger(ledger_store) == []
    retry = client.post("/orders", headers={"Idempotency-Key": "rb-1"})
    assert retry.status_code != 201 and "Idempotent-Replayed" not in retry.headers, (
        "a 201 that stands for no row was replayed"
    )
    record = ledger_store.get(Scope("alpha", "POST /orders", "rb-1"))
    assert record is not None and record.state is State.UNKNOWN, "a failure's key, never free"


def test_an_error_answer_after_the_view_rolled_back_is_stored_as_any_error(
    ledger_store: SQLStore,
) -> None:
    app, runs = _connection_app(ledger_store, 409)
    client = app.test_client()
    assert client.post("/orders", headers={"Idempotency-Key": "rb-2"}).status_code == 409
    retry = client.post("/orders", headers={"Idempotency-Key": "rb-2"})
    assert retry.status_code == 409 and retry.headers["Idempotent-Replayed"] == "true"
    assert runs == ["run"] and _ledger(ledger_store) == []


def _session_app(db_url: str, name: str) -> flask.Flask:
    app = application(db_url, name)
    idem = Idempotency(app, db=db, tenant=lambda: "alpha")

    @app.post("/orders")
    @idem.idempotent
    def order() -> t.Any:
        if flask.request.args.get("refuse"):
            flask.abort(409)
        db.session.add(Order(note="o-1"))
        return {"ordered": True}, 201

    with app.app_context():
        db.create_all()
    return app


def test_a_hook_rolling_the_session_back_after_a_success_is_not_stored(db_url: str) -> None:
    app = _session_app(db_url, "rollback-hook")

    # Registered after init_app, so Flask runs it before flask_idem records the answer.
    @app.after_request
    def roll_back(response: flask.Response) -> flask.Response:
        db.session.rollback()
        return response

    try:
        client = app.test_client()
        headers = {"Idempotency-Key": f"hook-rb-{uuid.uuid4()}"}  # the database outlives a run
        first = client.post("/orders", headers=headers)
        assert first.status_code == 500, first.get_data(as_text=True)
        assert notes(app) == []
        retry = client.post("/orders", headers=headers)
        assert "Idempotent-Replayed" not in retry.headers, "a 201 standing for no order replayed"
    finally:
        discard(app)


def test_an_error_handler_rolling_back_after_an_abort_keeps_its_answer(db_url: str) -> None:
    app = _session_app(db_url, "rollback-handler")

    @app.errorhandler(409)
    def conflict(error: Exception) -> t.Any:
        db.session.rollback()  # the common clean-up before an error answer
        return {"error": "conflict"}, 409

    try:
        client = app.test_client()
        headers = {"Idempotency-Key": f"handler-rb-{uuid.uuid4()}"}
        assert client.post("/orders?refuse=1", headers=headers).status_code == 409
        retry = client.post("/orders?refuse=1", headers=headers)
        assert retry.status_code == 409 and retry.headers["Idempotent-Replayed"] == "true"
    finally:
        discard(app)


def test_a_job_that_rolled_its_writes_back_is_not_stored(ledger_store: SQLStore) -> None:
    app = flask.Flask("rolled-back-job")
    idem = Idempotency(app, store=ledger_store)
    runs: list[str] = []

    @idem.job("renew", key="order_id", tenant="merchant")
    def renew(merchant: str, order_id: str) -> dict[str, str]:
        runs.append(order_id)
        connection = idem.connection()
        connection.execute(ledger.insert().values(note=order_id))
        connection.rollback()
        return {"renewed": order_id}

    with app.app_context(), pytest.raises(JobOutcomePending):
        renew("alpha", "o-1")
    with app.app_context(), pytest.raises(JobOutcomePending):
        renew("alpha", "o-1")  # the redelivery is told the outcome is unknown, never a value
    assert runs == ["o-1"] and _ledger(ledger_store) == []
