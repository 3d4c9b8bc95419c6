"""A commit on another connection of the store's engine, made while the attempt runs (``with
db.engine.begin()``, a ``Session(db.engine)``, the store engine's ``begin()``, a raw driver
connection of its pool), stays whatever the attempt does next: a ``release_before_contact``
view that then answers 503 is never released, so no retry commits the rows again.
"""

from __future__ import annotations

import typing as t

import pytest
import sqlalchemy as sa
from flask import Flask
from sqlalchemy.orm import Session

from tests.support.drivers import (
    db_url_on_each_driver,  # noqa: F401 (the fixture, on each driver)
)
from tests.support.fsa_app import Order, create_tables, db, notes, protected

pytestmark = pytest.mark.usefixtures("sqlalchemy_path")

_INSERT = sa.insert(Order.__table__).values(note="paid")  # type: ignore[arg-type]


def _engine_begin() -> None:
    with db.engine.begin() as connection:
        connection.execute(_INSERT)


def _session_of_the_engine() -> None:
    with Session(db.engine) as session:
        session.add(Order(note="paid"))
        session.commit()


def _store_engine_begin() -> None:
    from flask_idem.state import AppState

    with AppState.current().store.engine.begin() as connection:
        connection.execute(_INSERT)


def _raw_connection(commit: t.Callable[[t.Any], None]) -> t.Callable[[], None]:
    def write() -> None:
        raw = db.engine.raw_connection()
        try:
            cursor = raw.cursor()
            cursor.execute("INSERT INTO fsa_orders (note) VALUES ('paid')")
            commit(raw)
            cursor.close()
        finally:
            raw.close()

    return write


def _cursor_commit(raw: t.Any) -> None:
    raw.cursor().execute("COMMIT")


#: How the view commits a row through a connection that is not its business transaction.
ELSEWHERE: dict[str, t.Callable[[], None]] = {
    "db.engine.begin()": _engine_begin,
    "Session(db.engine)": _session_of_the_engine,
    "store engine begin()": _store_engine_begin,
    "raw connection commit()": _raw_connection(lambda raw: raw.commit()),
    "raw connection cursor COMMIT": _raw_connection(_cursor_commit),
}


@pytest.mark.parametrize("how", ELSEWHERE)
def test_a_commit_on_another_connection_is_never_released(
    db_url: str, fsa_apps: list[Flask], how: str
) -> None:
    if how.startswith("raw") and db_url.startswith("sqlite"):
        pytest.skip(
            "SQLite's driver connections run in autocommit outside flask_idem's BEGIN: each "
            "statement commits with no commit() to count (a documented limit)"
        )
    app, idem = protected(db_url, "commit-elsewhere")
    fsa_apps.append(app)
    create_tables(app)

    @app.post("/pay")
    @idem.idempotent(release_before_contact=True)
    def pay() -> t.Any:
        ELSEWHERE[how]()
        return {"error": "provider unavailable"}, 503

    client = app.test_client()
    answers = [client.post("/pay", headers={"Idempotency-Key": "elsewhere"}) for _ in range(3)]
    assert notes(app) == ["paid"], "committed once, never by a retry"
    assert [a.status_code for a in answers] == [503, 409, 409], "never released"
    assert answers[1].get_json()["type"].endswith("/outcome-pending")
