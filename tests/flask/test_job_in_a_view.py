"""A switched-off job called inside a view (an eager ``delay()`` in a test) leaves the view's
``db.session`` to the view: it neither commits the view's writes half-way nor rolls them back
when it raises.
"""

from __future__ import annotations

import typing as t

import pytest
import sqlalchemy as sa
from flask import Flask

from flask_idem import Idempotency
from tests.support.fsa_app import Order, application, db, discard


@pytest.fixture
def app(db_url: str) -> t.Iterator[Flask]:
    app = application(db_url, "job-in-view", IDEMPOTENCY_ENABLED=False)
    idem = Idempotency(app, db=db, tenant=lambda: "alpha")

    @idem.job("receipt", key="order", tenant="merchant")
    def send_receipt(merchant: str, order: int) -> None:
        raise RuntimeError("the mail server is down")

    @app.post("/orders")
    @idem.idempotent
    def create_order() -> t.Any:
        order = Order()
        db.session.add(order)
        db.session.flush()
        try:
            send_receipt("alpha", order.id)  # eager in tests; a failure is tolerated
        except RuntimeError:
            pass
        return {"id": order.id}, 201

    with app.app_context():
        db.create_all()
    yield app
    discard(app)


def test_a_failing_switched_off_job_keeps_the_views_rows(app: Flask) -> None:
    response = app.test_client().post("/orders")
    assert response.status_code == 201
    with app.app_context():
        rows = db.session.scalar(sa.select(sa.func.count()).select_from(Order))
        db.session.remove()
    assert rows == 1, "the job's rollback took the view's row with it"
