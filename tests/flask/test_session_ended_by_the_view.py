"""A durable view that ends ``db.session``'s transaction itself before it answers
(``db.session.close()``, ``db.session.remove()``, or a ``db.session.rollback()`` whose
``SessionSettled`` it catches) has lost the rows it wrote: its answer is never stored. The client
gets a 500 problem instead of a 201 for rows that do not exist, and the key is given up as for a
crash (``unknown``), so no retry replays a success that never committed.
"""

from __future__ import annotations

import typing as t
import uuid

import pytest
from flask import Flask

from flask_idem import Idempotency
from flask_idem.sessions import SessionSettled
from tests.support.fsa_app import Order, application, db, notes

pytestmark = pytest.mark.usefixtures("sqlalchemy_path")


def _end_by_close() -> None:
    db.session.close()


def _end_by_remove() -> None:
    db.session.remove()


def _end_by_caught_rollback() -> None:
    try:
        db.session.rollback()
    except SessionSettled:
        pass  # the rollback already happened


ENDINGS = {
    "close": _end_by_close,
    "remove": _end_by_remove,
    "caught rollback": _end_by_caught_rollback,
}


@pytest.mark.parametrize("how", ENDINGS)
def test_a_view_that_ends_the_session_never_stores_its_answer(
    db_url: str, fsa_apps: list[Flask], how: str
) -> None:
    app = application(db_url, f"ended-{how}")
    fsa_apps.append(app)
    idem = Idempotency(app, db=db, tenant=lambda: "alpha")
    runs: list[int] = []

    @app.post("/orders")
    @idem.idempotent
    def create_order() -> t.Any:
        runs.append(1)
        db.session.add(Order(note="lost"))
        db.session.flush()
        ENDINGS[how]()
        return {"created": True}, 201

    with app.app_context():
        db.create_all()
    client = app.test_client()
    # The database outlives the test: a key of its own for each run.
    headers = {"Idempotency-Key": f"ended-{how.replace(' ', '-')}-{uuid.uuid4().hex[:8]}"}
    first = client.post("/orders", headers=headers)
    retry = client.post("/orders", headers=headers)
    assert notes(app) == [], "the rows were never committed"
    assert first.status_code == 500, "a 201 for rows that do not exist"
    assert first.mimetype == "application/problem+json"
    assert first.get_json()["type"].endswith("/internal-error")
    assert retry.status_code == 409, "the key is unknown: no replay of a success, no re-run"
    assert retry.get_json()["type"].endswith("/outcome-pending")
    assert runs == [1]
