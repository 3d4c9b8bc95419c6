"""A business transaction ended below SQLAlchemy, however it was ended: the driver
connection's own ``commit()`` or ``rollback()``, a ``COMMIT`` or ``ROLLBACK`` through a raw
driver cursor, or psycopg 3's and sqlite3's ``Connection.execute``. A view that then answers
normally never has that answer stored (its rows did not commit with it: 500, key ``unknown``),
and one that fails is never released: every retry answers 409 and commits nothing, on psycopg2,
psycopg 3 and SQLite, durable and atomic.
"""

from __future__ import annotations

import sqlite3
import typing as t

import pytest
import sqlalchemy as sa
from flask import Flask

from flask_idem import Idempotency
from flask_idem.store import SQLStore
from tests.support.drivers import (
    db_url_on_each_driver,  # noqa: F401 (the fixture, on each driver)
)
from tests.support.fsa_app import Order, create_tables, db, notes, protected
from tests.support.helpers import store_on, with_tables

pytestmark = pytest.mark.usefixtures("sqlalchemy_path")


def _cursor_execute(sql: str) -> t.Callable[[t.Any], None]:
    def execute(dbapi_connection: t.Any) -> None:
        if "\r" in sql and isinstance(dbapi_connection, sqlite3.Connection):
            pytest.skip("SQLite ends a -- comment at a line feed only: nothing commits")
        cursor = dbapi_connection.cursor()
        cursor.execute(sql)
        cursor.close()

    return execute


def _connection_execute(dbapi_connection: t.Any) -> None:
    if not hasattr(dbapi_connection, "execute"):
        pytest.skip("psycopg2 connections have no execute()")
    dbapi_connection.execute("COMMIT")


#: How the view ends its business transaction on the driver connection under it.
ENDS: dict[str, t.Callable[[t.Any], None]] = {
    "driver commit()": lambda dbapi_connection: dbapi_connection.commit(),
    "driver rollback()": lambda dbapi_connection: dbapi_connection.rollback(),
    "cursor COMMIT": _cursor_execute("COMMIT"),
    "cursor ROLLBACK": _cursor_execute("rollback"),
    "cursor CR comment COMMIT": _cursor_execute("-- checkpoint\rCOMMIT"),
    "connection execute COMMIT": _connection_execute,
}


def _dbapi(connection: sa.Connection) -> t.Any:
    return connection.connection.dbapi_connection


def _fsa_app(db_url: str, name: str) -> tuple[Flask, Idempotency]:
    app, idem = protected(db_url, name)
    create_tables(app)
    return app, idem


@pytest.mark.parametrize("end", ENDS)
@pytest.mark.parametrize("mode", ["durable", "atomic"])
def test_an_answer_after_an_end_below_the_session_is_never_stored(
    db_url: str, fsa_apps: list[Flask], mode: str, end: str
) -> None:
    app, idem = _fsa_app(db_url, f"ended-below-{mode}")
    fsa_apps.append(app)
    runs: list[int] = []

    @app.post("/orders")
    @idem.idempotent(atomic=mode == "atomic")
    def create_order() -> t.Any:
        runs.append(1)
        db.session.add(Order(note="ordered"))
        db.session.flush()
        ENDS[end](_dbapi(db.session.connection()))
        db.session.add(Order(note="after"))  # a new driver transaction (or autocommitted)
        db.session.flush()
        return {"created": True}, 201

    client = app.test_client()
    answers = [client.post("/orders", headers={"Idempotency-Key": "below"}) for _ in range(3)]
    rows = notes(app)
    assert len(rows) == len(set(rows)), f"a retry committed again: {rows}"
    if mode == "atomic" and not db_url.startswith("sqlite"):
        # PostgreSQL's store connections refuse the end before it happens (SessionSettled in
        # the view): nothing is ever published, so nothing is kept and each retry runs again.
        assert rows == [], f"published before its record: {rows}"
        assert [a.status_code for a in answers] == [500, 500, 500]
        assert all(a.get_json()["type"].endswith("/internal-error") for a in answers)
        return
    assert [a.status_code for a in answers] == [500, 409, 409], "stored, replayed or released"
    assert answers[0].get_json()["type"].endswith("/internal-error")
    assert answers[1].get_json()["type"].endswith("/outcome-pending")
    assert runs == [1]


ledger = sa.Table(
    "ended_below_ledger",
    sa.MetaData(),
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("note", sa.String(64)),
)


@pytest.fixture
def store(db_url: str) -> t.Iterator[SQLStore]:
    with store_on(db_url) as store, with_tables(store, ledger):
        yield store


def _paid(store: SQLStore, answer: int) -> int:
    query = sa.select(sa.func.count()).select_from(ledger).where(ledger.c.note == str(answer))
    with store.engine.connect() as conn:
        return int(conn.scalar(query) or 0)


@pytest.mark.parametrize("end", ENDS)
def test_an_end_below_the_stores_connection_is_never_released_nor_stored(
    store: SQLStore, end: str
) -> None:
    """A ``release_before_contact`` view on ``idem.connection()``: answering 503 it would be
    released, answering 201 stored for rows that committed before it, or never."""
    app = Flask("ended-below-store")
    app.config.update(PROPAGATE_EXCEPTIONS=False)
    idem = Idempotency(app, store=store, tenant=lambda: "alpha")

    @app.post("/pay/<int:answer>")
    @idem.idempotent(release_before_contact=True)
    def pay(answer: int) -> t.Any:
        conn = idem.connection()
        conn.execute(ledger.insert().values(note=str(answer)))
        ENDS[end](_dbapi(conn))
        return {"answer": answer}, answer

    client = app.test_client()
    for answer, first in ((201, 500), (503, 503)):
        headers = {"Idempotency-Key": f"below-{answer}"}
        answers = [client.post(f"/pay/{answer}", headers=headers) for _ in range(3)]
        assert _paid(store, answer) <= 1, f"{_paid(store, answer)} rows committed for one key"
        assert [a.status_code for a in answers] == [first, 409, 409], "stored or released"
        assert answers[0].headers["Idempotent-Stored"] == "false", "never replayed"
        assert answers[1].get_json()["type"].endswith("/outcome-pending")


@pytest.mark.parametrize("spelling", ["-- checkpoint\rCOMMIT", "SELECT 1 -- x\r; COMMIT"])
def test_an_atomic_views_cr_comment_commit_is_refused(
    db_url: str, fsa_apps: list[Flask], spelling: str
) -> None:
    """PostgreSQL ends a ``--`` comment at a carriage return: the guard reads it the same way
    and refuses the COMMIT before anything commits (SQLite would only see a comment)."""
    app, idem = _fsa_app(db_url, "cr-commit-atomic")
    fsa_apps.append(app)

    @app.post("/orders")
    @idem.idempotent(atomic=True)
    def create_order() -> t.Any:
        db.session.add(Order(note="ordered"))
        db.session.flush()
        db.session.execute(sa.text(spelling))
        return {"created": True}, 201

    client = app.test_client()
    answers = [client.post("/orders", headers={"Idempotency-Key": "cr"}) for _ in range(3)]
    assert notes(app) == [], "refused: nothing commits, no retry commits"
    assert [a.status_code for a in answers] == [500, 500, 500]
