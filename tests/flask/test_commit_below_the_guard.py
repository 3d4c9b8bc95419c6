"""A commit the commit guard cannot refuse still makes the attempt never releasable: the driver
connection's own ``commit()`` under ``idem.connection()`` or ``db.session`` (psycopg2, psycopg 3),
also when the view writes again after it (a new driver transaction), and a
``db.session.remove()`` followed by rows committed through the fresh session. Every retry of
such an attempt answers 409 and commits nothing: one set of rows per key.
"""

from __future__ import annotations

import typing as t

import pytest
import sqlalchemy as sa
from flask import Flask

from flask_idem.sessions import SessionSettled
from flask_idem.store import SQLStore
from tests.support.commit_views import self_committing_app, three_tries
from tests.support.drivers import (
    PG_DRIVERS,
    db_url_on_each_driver,  # noqa: F401 (the fixture, on each driver)
    spelled_for,
)
from tests.support.fsa_app import Order, create_tables, db, notes, protected
from tests.support.helpers import store_on, with_tables

pytestmark = pytest.mark.usefixtures("sqlalchemy_path")

ledger = sa.Table(
    "driver_commit_ledger",
    sa.MetaData(),
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("note", sa.String(64)),
)


def _driver_commit(connection: sa.Connection) -> None:
    connection.connection.dbapi_connection.commit()  # type: ignore[union-attr]


#: What the view does after the driver's commit, before it fails.
AFTERWARDS: dict[str, t.Callable[[sa.Connection], t.Any]] = {
    "nothing": lambda connection: None,
    "writes again": lambda connection: connection.execute(ledger.insert().values(note="more")),
}


@pytest.fixture(params=PG_DRIVERS, ids=["psycopg2", "psycopg"])
def pg_driver_url(request: pytest.FixtureRequest, pg_url: str) -> str:
    """The migrated PostgreSQL database through each driver (SQLite's store connections begin
    with an explicit BEGIN, so sqlite3 shows such a commit as no transaction at all)."""
    return spelled_for(pg_url, request.param)


@pytest.fixture
def tables(pg_driver_url: str) -> t.Iterator[SQLStore]:
    with store_on(pg_driver_url) as store, with_tables(store, ledger):
        yield store


def _paid(store: SQLStore) -> int:
    with store.engine.connect() as conn:
        query = sa.select(sa.func.count()).select_from(ledger).where(ledger.c.note == "paid")
        return int(conn.scalar(query) or 0)


@pytest.mark.parametrize("afterwards", AFTERWARDS)
def test_a_drivers_own_commit_on_the_stores_connection_is_never_released(
    tables: SQLStore, afterwards: str
) -> None:
    store = tables

    def commit(conn: sa.Connection) -> None:
        _driver_commit(conn)
        AFTERWARDS[afterwards](conn)

    answers = three_tries(self_committing_app("driver-commit", store, ledger, commit), "driver")
    assert _paid(store) == 1, f"{_paid(store)} rows committed for one key"
    assert [a.status_code for a in answers] == [503, 409, 409], "never released"
    assert answers[1].get_json()["type"].endswith("/outcome-pending")


@pytest.mark.parametrize("mode", ["durable", "atomic"])
def test_a_drivers_own_commit_under_the_session_is_never_released(
    pg_driver_url: str, fsa_apps: list[Flask], mode: str
) -> None:
    """``db.session.connection().connection.commit()``, the pool's proxy of the driver's, is
    refused before it commits (the session's transaction is the session's to settle): nothing
    is published, so the attempt is given back (durable, before contact) or leaves nothing
    (atomic), and every retry is refused the same way."""
    app, idem = protected(pg_driver_url, f"fsa-driver-commit-{mode}")
    fsa_apps.append(app)
    atomic = mode == "atomic"
    options = {"atomic": True} if atomic else {"release_before_contact": True}

    @app.post("/orders")
    @idem.idempotent(**options)  # type: ignore[call-overload]
    def create_order() -> t.Any:
        db.session.add(Order(note="ordered"))
        db.session.flush()
        with pytest.raises(SessionSettled):
            db.session.connection().connection.commit()
        refused.append(1)
        raise RuntimeError("the provider failed")

    refused: list[int] = []
    create_tables(app)
    client = app.test_client()
    answers = [client.post("/orders", headers={"Idempotency-Key": "fsa"}) for _ in range(3)]
    assert notes(app) == [], "the refused commit published nothing"
    assert refused == [1, 1, 1]
    assert [a.status_code for a in answers] == [500, 500, 500]
    assert all(a.get_json()["type"].endswith("/internal-error") for a in answers)


def _write_then_remove() -> None:
    db.session.add(Order(note="lost"))
    db.session.flush()
    db.session.remove()


#: How the view drops db.session before committing through a fresh one.
REMOVALS: dict[str, t.Callable[[], None]] = {
    "after writing": _write_then_remove,
    "first": lambda: db.session.remove(),
}


@pytest.mark.parametrize("removal", REMOVALS)
@pytest.mark.parametrize("mode", ["durable", "atomic"])
def test_a_fresh_session_after_remove_is_never_released(
    db_url: str, fsa_apps: list[Flask], mode: str, removal: str
) -> None:
    app, idem = protected(db_url, f"fsa-removed-{mode}")
    fsa_apps.append(app)
    options = {"atomic": True} if mode == "atomic" else {"release_before_contact": True}

    @app.post("/orders")
    @idem.idempotent(**options)  # type: ignore[call-overload]
    def create_order() -> t.Any:
        REMOVALS[removal]()
        db.session.add(Order(note="committed"))
        db.session.commit()  # the fresh session is no business transaction of flask_idem's
        return {"error": "provider unavailable"}, 503

    create_tables(app)
    client = app.test_client()
    answers = [client.post("/orders", headers={"Idempotency-Key": "removed"}) for _ in range(3)]
    assert notes(app) == ["committed"], "committed once, never by a retry"
    assert answers[0].status_code in (500, 503)
    assert [a.status_code for a in answers[1:]] == [409, 409], "never released"
    assert answers[1].get_json()["type"].endswith("/outcome-pending")


def test_a_view_that_replaced_its_session_never_stores_its_answer(
    db_url: str, fsa_apps: list[Flask]
) -> None:
    """Its rows went into the fresh ``db.session``, which flask_idem never commits: a stored
    201 would replay a success for rows that do not exist."""
    app, idem = protected(db_url, "fsa-replaced")
    fsa_apps.append(app)

    @app.post("/orders")
    @idem.idempotent
    def create_order() -> t.Any:
        db.session.remove()
        db.session.add(Order(note="never committed"))
        db.session.flush()
        return {"created": True}, 201

    create_tables(app)
    client = app.test_client()
    first = client.post("/orders", headers={"Idempotency-Key": "replaced"})
    retry = client.post("/orders", headers={"Idempotency-Key": "replaced"})
    assert notes(app) == []
    assert first.status_code == 500, "a 201 for rows that do not exist"
    assert first.get_json()["type"].endswith("/internal-error")
    assert retry.status_code == 409 and retry.get_json()["type"].endswith("/outcome-pending")
