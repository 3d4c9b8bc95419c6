"""A job's db.session writes commit when it returns and roll back when it raises, switched on
or off (``IDEMPOTENCY_ENABLED = False``), as a view's do.
"""

from __future__ import annotations

import typing as t

import pytest
import sqlalchemy as sa
from flask import Flask

from flask_idem import Idempotency, JobOutcomePending
from flask_idem.core.key_digest import unkeyed
from flask_idem.sessions import SessionSettled
from flask_idem.store import normalize_url
from tests.support.fsa_app import Order, db, discard, notes


@pytest.mark.parametrize("enabled", [True, False], ids=["on", "off"])
def test_a_job_keeps_its_session_writes_switched_on_or_off(db_url: str, enabled: bool) -> None:
    app = Flask("off-job")
    app.config.update(
        SQLALCHEMY_DATABASE_URI=normalize_url(db_url).render_as_string(hide_password=False),
        IDEMPOTENCY_ENABLED=enabled,
    )
    db.init_app(app)
    idem = Idempotency(app, db=db)

    @idem.job("renew", key="order_id", tenant="merchant")
    def renew(merchant: str, order_id: str) -> dict[str, t.Any]:
        db.session.add(Order(note=order_id))  # no commit: flask_idem commits
        return {"renewed": order_id}

    with app.app_context():
        db.create_all()
    try:
        with app.app_context():
            assert renew("alpha", "o-1") == {"renewed": "o-1"}
        with app.app_context():
            rows = list(db.session.scalars(sa.select(Order.note)))
        assert rows == ["o-1"], f"the job's write was lost (IDEMPOTENCY_ENABLED={enabled})"
    finally:
        discard(app)


def _renewing_app(
    db_url: str, name: str, end_session: t.Callable[[], None]
) -> tuple[Flask, t.Callable[[str, str], t.Any], list[str]]:
    """An app whose job adds an order, flushes it and then calls ``end_session``: the app,
    the job, and the order ids it ran for."""
    app = Flask(name)
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
        end_session()
        return {"renewed": order_id}

    with app.app_context():
        db.create_all()
    return app, renew, runs


@pytest.mark.parametrize("end", ["commit", "rollback"])
def test_a_job_that_ended_its_session_below_sqlalchemy_stores_no_result(
    db_url: str, end: str
) -> None:
    """The driver connection's ``commit()`` or ``rollback()`` under ``db.session``: the job's
    rows did not commit with its result, so none is stored and the key is left unknown (a
    redelivery gets ``JobOutcomePending``, never a replay nor a second run)."""
    app, renew, runs = _renewing_app(
        db_url,
        "ended-below-job",
        lambda: getattr(db.session.connection().connection.dbapi_connection, end)(),
    )
    # PostgreSQL's store connections refuse the end before it happens; SQLite sees it after.
    refused_before = not db_url.startswith("sqlite")
    try:
        first = SessionSettled if refused_before else JobOutcomePending
        with app.app_context(), pytest.raises(first):
            renew("alpha", f"o-{end}")
        with app.app_context(), pytest.raises(JobOutcomePending):
            renew("alpha", f"o-{end}")
        assert runs == [f"o-{end}"], "a redelivery ran it again"
        if refused_before:
            with app.app_context():
                assert db.session.scalars(sa.select(Order.note)).all() == [], "published"
    finally:
        discard(app)


@pytest.mark.parametrize("end", ["close", "remove"])
def test_a_job_that_closed_its_session_stores_no_result(db_url: str, end: str) -> None:
    """The job's rows are gone with the session it closed (or removed): a stored result would
    replay a value whose writes never committed. The first run is refused as a view's answer
    is, the key is left unknown, and a redelivery neither replays nor runs it again."""
    app, renew, runs = _renewing_app(db_url, "lost-work-job", lambda: getattr(db.session, end)())
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
                {"k": unkeyed("alpha", f"o-{end}")},
            )
            db.session.remove()
        assert state == "unknown"
    finally:
        discard(app)
