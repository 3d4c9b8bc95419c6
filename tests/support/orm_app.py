"""A Flask-SQLAlchemy application protected by flask_idem, for the ORM tests.

``python -m tests.support.orm_app URL MODE PREFIX`` sends protected requests (keys ``PREFIX-0``,
``PREFIX-1``...) in a loop through the test client, slowed down around the commit, until it is
killed: the kill -9 test of ``test_flask_sqlalchemy.py``.
"""

from __future__ import annotations

import random
import sys
import time
import typing as t

import flask
import sqlalchemy as sa
from flask import Flask
from flask_sqlalchemy import SQLAlchemy
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from flask_idem import Idempotency
from flask_idem.store import normalize_url


class Base(DeclarativeBase):
    pass


db = SQLAlchemy(model_class=Base)


class Payment(db.Model):  # type: ignore[name-defined,misc]
    __tablename__ = "orm_payments"
    id: Mapped[int] = mapped_column(primary_key=True)
    idem_key: Mapped[str] = mapped_column(sa.String(255))
    amount: Mapped[int]


def create_app(url: str, *, slow: bool = False) -> tuple[Flask, Idempotency]:
    app = Flask("orm-app")
    app.config.update(
        SQLALCHEMY_DATABASE_URI=normalize_url(url).render_as_string(hide_password=False),
        PROPAGATE_EXCEPTIONS=False,
    )
    db.init_app(app)
    idem = Idempotency(app, db=db, tenant=lambda: "alpha")
    with app.app_context():
        db.create_all()

    def pause() -> None:
        if slow:
            time.sleep(random.uniform(0, 0.01))

    def charge() -> t.Any:
        body = flask.request.get_json()
        db.session.add(Payment(idem_key=flask.request.headers["Idempotency-Key"], **body))
        pause()
        db.session.flush()
        pause()
        if body["amount"] == 13:
            raise RuntimeError("unlucky amount, after the flush")
        if body["amount"] == 7:
            db.session.commit()  # refused: flask_idem commits the session
        return {"ok": True}, 201

    def busy() -> t.Any:
        db.session.add(Payment(idem_key=flask.request.headers["Idempotency-Key"], amount=1))
        return "busy", 503  # never stored: the key is given back, nothing commits

    def nested() -> t.Any:
        with db.session.begin_nested():  # a savepoint released normally commits nothing yet
            db.session.add(Payment(idem_key=flask.request.headers["Idempotency-Key"], amount=2))
        return {"ok": True}, 201

    app.post("/busy", endpoint="busy")(idem.idempotent(release_before_contact=True)(busy))
    app.post("/nested", endpoint="nested")(idem.idempotent(nested))
    app.post("/durable", endpoint="durable")(idem.idempotent(charge))
    app.post("/atomic", endpoint="atomic")(idem.idempotent(atomic=True)(charge))
    if slow:
        sa.event.listen(db.session, "before_commit", lambda _session: pause())
    return app, idem


def main() -> None:
    url, mode, prefix = sys.argv[1:4]
    app, _ = create_app(url, slow=True)
    client = app.test_client()
    print("ready", flush=True)
    number = 0
    while True:
        client.post(
            f"/{mode}", json={"amount": 100}, headers={"Idempotency-Key": f"{prefix}-{number}"}
        )
        number += 1


if __name__ == "__main__":
    main()
