"""A job whose business transaction ended under it (``db.session.close()`` in the job) lost its
writes: its result must never be stored, as a view's answer is never stored in that case."""

from __future__ import annotations

import typing as t

import pytest
import sqlalchemy as sa
from flask import Flask

from flask_idem import Idempotency, JobOutcomePending
from flask_idem.store import normalize_url

from ..support.fsa_app import Order, db, discard, notes


@pytest.mark.parametrize("end", ["close", "remove"])
def test_a_job_that_closed_its_session_stores_no_result(db_url: str, end: str) -> None:
    """The job's rows are gone with the session it closed (or removed): a stored result would
    replay a value whose writes never committed. The first run is refused as a view's answer
    is, the key is left unknown, and a redelivery neither replays nor runs it again."""
    app = Flask("lost-work-job")
    app.config.update(
        SQLALCHEMY_DATABASE_URI=normalize_url(db_url).render_as_string(hide_password=False)
    )
    db.init_app(app)
    idem = Idempotency(app, db=db)
    runs: list[str] = []

    @idem.job("renew", key="order_id", tenant="merchant")
    def renew(merchant: str, order_id: str) -> dict[str, t.Any]:
        runs.append(order_id)
        db.session.add(Order(note=order_id))
        db.session.flush()
        getattr(db.session, end)()
        return {"renewed": order_id}

    with app.app_context():
        db.create_all()
    try:
        with app.app_context(), pytest.raises(JobOutcomePending):
            renew("alpha", f"o-{end}")
        with app.app_context(), pytest.raises(JobOutcomePending):
            renew("alpha", f"o-{end}")
        assert runs == [f"o-{end}"], "a redelivery ran it again"
        assert notes(app) == [], "the closed session's rows were committed"
        with app.app_context():
            state = db.session.scalar(
                sa.text("SELECT state FROM idempotency_keys WHERE tenant = 'alpha' AND key = :k"),
                {"k": f"o-{end}"},
            )
            db.session.remove()
        assert state == "unknown"
    finally:
        discard(app)
