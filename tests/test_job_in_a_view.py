"""A switched-off job called inside a view (an eager ``delay()`` in a test) leaves the view's
``db.session`` to the view: it neither commits the view's writes half-way nor rolls them back
when it raises.
"""

from __future__ import annotations

import typing as t

import pytest
import sqlalchemy as sa
from flask import Flask
from flask_sqlalchemy import SQLAlchemy
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from flask_idem import Idempotency
from flask_idem.store import normalize_url


class Base(DeclarativeBase):
    pass


db = SQLAlchemy(model_class=Base)


class Order(db.Model):  # type: ignore[name-defined,misc]
    __tablename__ = "review_job_in_view_orders"
    id: Mapped[int] = mapped_column(primary_key=True)


@pytest.fixture
def app(db_url: str) -> t.Iterator[Flask]:
    app = Flask("job-in-view")
    app.config.update(
        SQLALCHEMY_DATABASE_URI=normalize_url(db_url).render_as_string(hide_password=False),
        PROPAGATE_EXCEPTIONS=False,
        IDEMPOTENCY_ENABLED=False,
    )
    db.init_app(app)
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
    with app.app_context():
        db.session.remove()
        db.drop_all()
        db.engine.dispose()


def test_a_failing_switched_off_job_keeps_the_views_rows(app: Flask) -> None:
    response = app.test_client().post("/orders")
    assert response.status_code == 201
    with app.app_context():
        rows = db.session.scalar(sa.select(sa.func.count()).select_from(Order))
        db.session.remove()
    assert rows == 1, "the job's rollback took the view's row with it"
