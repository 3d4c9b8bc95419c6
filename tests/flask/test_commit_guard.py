"""An attempt that committed anything itself is never released, however it committed:
``Connection.commit()`` of ``idem.connection()`` or of the session's connection, a statement
(``COMMIT``, ``END``, in any spelling), or a ``COMMIT`` below SQLAlchemy (a DBAPI cursor's). A
``release_before_contact`` view that commits and then fails leaves its key ``unknown``, so no
retry commits its rows again. In an atomic view such a commit would publish the claim half-way
(on PostgreSQL the rows without any record): it is refused before anything commits. A savepoint
is no commit.
"""

from __future__ import annotations

import typing as t

import pytest
import sqlalchemy as sa
from flask import Flask

from flask_idem import Idempotency
from flask_idem.commits import ends_transaction
from flask_idem.store import SQLStore
from tests.support.commit_views import self_committing_app, three_tries
from tests.support.fsa_app import Order, db, notes, protected
from tests.support.helpers import with_tables

pytestmark = pytest.mark.usefixtures("sqlalchemy_path")

ledger = sa.Table(
    "commit_guard_ledger",
    sa.MetaData(),
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("note", sa.String(64)),
)

#: How a view commits its business transaction itself.
COMMITS: dict[str, t.Callable[[sa.Connection], t.Any]] = {
    "Connection.commit()": lambda conn: conn.commit(),
    "text COMMIT": lambda conn: conn.execute(sa.text("COMMIT")),
    "exec_driver_sql END": lambda conn: conn.exec_driver_sql("END"),
    "commented lowercase": lambda conn: conn.exec_driver_sql("/* done */ -- now\n commit"),
}


@pytest.fixture
def tables(store: SQLStore) -> t.Iterator[SQLStore]:
    with with_tables(store, ledger):
        yield store


def _rows(store: SQLStore) -> int:
    with store.engine.connect() as conn:
        return int(conn.scalar(sa.select(sa.func.count()).select_from(ledger)) or 0)


@pytest.mark.parametrize("how", COMMITS)
def test_a_releasable_views_own_commit_is_never_released(tables: SQLStore, how: str) -> None:
    store = tables
    answers = three_tries(self_committing_app("self-commit", store, ledger, COMMITS[how]), "own")
    assert _rows(store) == 1, f"{_rows(store)} rows committed for one key"
    assert [a.status_code for a in answers] == [503, 409, 409], "never released"
    assert answers[1].get_json()["type"].endswith("/outcome-pending")


def _commit_below_sqlalchemy(conn: sa.Connection) -> None:
    cursor = conn.connection.dbapi_connection.cursor()  # type: ignore[union-attr]
    cursor.execute("COMMIT")
    cursor.close()


def test_a_commit_below_sqlalchemy_is_never_released(tables: SQLStore) -> None:
    store = tables
    app = self_committing_app("dbapi-commit", store, ledger, _commit_below_sqlalchemy)
    answers = three_tries(app, "dbapi")
    assert _rows(store) == 1, "one attempt committed; no retry may commit again"
    assert [a.status_code for a in answers] == [503, 409, 409]
    assert answers[1].get_json()["type"].endswith("/outcome-pending")


#: (claim mode, how the view commits); an atomic view's ``Connection.commit()`` was refused
#: already (tests/e2e/test_atomic.py).
SESSION_COMMITS = [("durable", how) for how in COMMITS] + [
    ("atomic", how) for how in COMMITS if how != "Connection.commit()"
]


@pytest.mark.parametrize(("mode", "how"), SESSION_COMMITS)
def test_a_commit_of_the_sessions_connection_is_refused(
    db_url: str, fsa_apps: list[Flask], mode: str, how: str
) -> None:
    """db.session's transaction is the session's to settle, as ``db.session.commit()``."""
    app, idem = protected(db_url, f"fsa-self-commit-{mode}")
    fsa_apps.append(app)
    options = {"atomic": True} if mode == "atomic" else {"release_before_contact": True}

    @app.post("/orders")
    @idem.idempotent(**options)  # type: ignore[call-overload]
    def create_order() -> t.Any:
        db.session.add(Order(note="ordered"))
        db.session.flush()
        COMMITS[how](db.session.connection())
        return {"error": "provider unavailable"}, 503

    with app.app_context():
        db.create_all()
    client = app.test_client()
    answers = [client.post("/orders", headers={"Idempotency-Key": "fsa"}) for _ in range(3)]
    assert notes(app) == [], "the view's rows committed without their answer"
    assert [a.status_code for a in answers] == [500] * 3, "refused: a crash of the view"


def test_an_atomic_views_commit_below_sqlalchemy_is_refused_before_it_publishes(
    pg_url: str, fsa_apps: list[Flask]
) -> None:
    """PostgreSQL writes an atomic record only with the answer, so such a commit would publish
    the rows alone, and a process killed right after it would leave no record for the retry:
    the store's connections refuse it before it happens."""
    app, idem = protected(pg_url, "fsa-dbapi-commit")
    fsa_apps.append(app)

    @app.post("/orders")
    @idem.idempotent(atomic=True)
    def create_order() -> t.Any:
        db.session.add(Order(note="ordered"))
        db.session.flush()
        _commit_below_sqlalchemy(db.session.connection())
        raise RuntimeError("after the commit")

    with app.app_context():
        db.create_all()
    client = app.test_client()
    answers = [client.post("/orders", headers={"Idempotency-Key": "fsa-dbapi"}) for _ in range(3)]
    assert notes(app) == [], "the refused commit published nothing"
    assert [a.status_code for a in answers] == [500, 500, 500]
    assert all(a.get_json()["type"].endswith("/internal-error") for a in answers)


def test_a_released_savepoint_commits_nothing(tables: SQLStore) -> None:
    store = tables
    app = Flask("savepoint")
    idem = Idempotency(app, store=store, tenant=lambda: "alpha")

    @app.post("/pay")
    @idem.idempotent(release_before_contact=True)
    def pay() -> t.Any:
        conn = idem.connection()
        conn.exec_driver_sql("SAVEPOINT step")
        conn.execute(ledger.insert().values(note="paid"))
        conn.exec_driver_sql("RELEASE SAVEPOINT step")
        conn.exec_driver_sql("SAVEPOINT undone")
        conn.execute(ledger.insert().values(note="undone"))
        conn.exec_driver_sql("ROLLBACK TO SAVEPOINT undone")
        return {"paid": True}, 201

    client = app.test_client()
    first = client.post("/pay", headers={"Idempotency-Key": "sp"})
    retry = client.post("/pay", headers={"Idempotency-Key": "sp"})
    assert first.status_code == 201 and retry.headers["Idempotent-Replayed"] == "true"
    assert _rows(store) == 1


@pytest.mark.parametrize(
    ("sql", "ends"),
    [
        ("COMMIT", True),
        ("end transaction", True),
        ("SELECT 1; COMMIT", True),
        ("ROLLBACK", True),
        ("rollback work and chain", True),
        ("ABORT", True),
        ("PREPARE TRANSACTION 'x'", True),
        ("/* a /* nested */ comment */ COMMIT", True),
        ("ROLLBACK TO SAVEPOINT s", False),
        ("ROLLBACK TRANSACTION TO s", False),
        ("RELEASE SAVEPOINT s", False),
        ("SELECT CASE WHEN true THEN 1 END", False),
        ("SELECT 'COMMIT'; SELECT \"end\"", False),
        ("SELECT $tag$; COMMIT $tag$", False),
        ("SELECT E'it\\'s; commit'", False),
        ("PREPARE plan AS SELECT 1", False),
        ("-- COMMIT\nSELECT 1", False),
        # PostgreSQL's lexer ends a -- comment at a carriage return too.
        ("-- x\rCOMMIT", True),
        ("SELECT 1; -- x\rCOMMIT", True),
        ("SELECT 1 -- x\r; COMMIT", True),
    ],
)
def test_statements_that_end_the_transaction(sql: str, ends: bool) -> None:
    assert ends_transaction(sql) is ends
