"""An app with one atomic view, for the atomic mode's process and crash tests.

``POST /orders`` (``{"reference": "order-1"}``) inserts an order row through
``idem.connection()`` and answers it: the claim, the row and the stored response commit once.
Under gunicorn (``gunicorn 'tests.support.atomic_app:create_app()'``) it reads ``DATABASE_URL``, and
``ATOMIC_APP_SLEEP`` (seconds the view hangs after its insert, so that a test can SIGKILL the
worker mid-view) with ``ATOMIC_APP_PIDFILE`` (where the hanging worker writes its pid).
"""

from __future__ import annotations

import os
import time
import typing as t
from pathlib import Path

import sqlalchemy as sa
from flask import Flask, request

from flask_idem import Idempotency

orders = sa.Table(
    "atomic_app_orders",
    sa.MetaData(),
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("tenant", sa.String(64), nullable=False),
    sa.Column("reference", sa.String(64), nullable=False),
)


def create_app(database_url: str | None = None) -> Flask:
    app = Flask(__name__)
    app.config["IDEMPOTENCY_DATABASE_URL"] = database_url or os.environ["DATABASE_URL"]
    idem = Idempotency(app, tenant=lambda: request.headers.get("X-Tenant"))
    orders.metadata.create_all(app.extensions["idempotency"].store.engine)
    sleep = float(os.environ.get("ATOMIC_APP_SLEEP", "0"))
    pidfile = os.environ.get("ATOMIC_APP_PIDFILE")

    @app.post("/orders")
    @idem.idempotent(atomic=True)
    def create_order() -> t.Any:
        reference = str(request.get_json()["reference"])
        tenant = str(request.headers["X-Tenant"])
        conn = idem.connection()
        row = conn.execute(
            orders.insert().values(tenant=tenant, reference=reference).returning(orders.c.id)
        ).one()
        if sleep:
            if pidfile:
                Path(pidfile).write_text(str(os.getpid()))
            time.sleep(sleep)
        return {"id": row.id, "reference": reference}, 201

    return app
