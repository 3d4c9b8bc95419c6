"""An atomic view's session guards see the claimed request also when a before_request hook
used ``idem.connection()`` first: the view can neither roll back its claim nor commit its rows
without their record.
"""

from __future__ import annotations

import typing as t

import pytest
import sqlalchemy as sa
from flask import Flask

from flask_idem import Idempotency
from tests.support.fsa_app import Order, db, protected


def _app(pg_url: str, *, early: bool) -> tuple[Flask, Idempotency]:
    # PostgreSQL: on SQLite the hook's open transaction holds the write lock (see
    # tests/flask/test_early_connection_commit_guard.py).
    app, idem = protected(pg_url, "atomic-early")

    if early:

        @app.before_request
        def authenticate() -> None:
            idem.connection().execute(sa.text("SELECT 1"))  # e.g. the API key's tenant

    @app.post("/ledger")
    @idem.idempotent(atomic=True)
    def book() -> t.Any:
        db.session.rollback()  # forbidden before the view answered: SessionSettled
        db.session.add(Order())
        db.session.commit()  # forbidden in a protected view: SessionSettled
        return {"booked": True}, 201

    with app.app_context():
        db.create_all()
    return app, idem


def _rows(app: Flask) -> int:
    with app.app_context():
        count = db.session.scalar(sa.select(sa.func.count()).select_from(Order))
        db.session.remove()
        return int(count or 0)


@pytest.mark.parametrize("early", [False, True], ids=["no-hook", "early-connection"])
def test_an_atomic_views_own_rollback_and_commit_are_refused(
    pg_url: str, fsa_apps: list[Flask], early: bool
) -> None:
    app, _ = _app(pg_url, early=early)
    fsa_apps.append(app)
    client = app.test_client()
    first = client.post("/ledger", headers={"Idempotency-Key": "atomic-early-1"})
    second = client.post("/ledger", headers={"Idempotency-Key": "atomic-early-1"})
    assert _rows(app) == 0, (
        f"the view's own rollback/commit went through: rows committed without their record "
        f"(answers {first.status_code}, {second.status_code})"
    )
    assert first.status_code == 500, first.get_data(as_text=True)
