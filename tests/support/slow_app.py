"""A small payments app for crash and reconciliation tests.

``POST /payments`` (``{"amount": 4200, "reference": "order-1"}``) charges a "provider" (a
table written in its own transaction, like a call to a real provider: it stays charged whatever
happens to the request) with the operation's downstream key, then answers. Its reconciler looks
the charge up by that key and answers what the view would have.

Under gunicorn (``gunicorn 'tests.support.slow_app:create_app()'``) it reads ``DATABASE_URL``, and
``SLOW_APP_SLEEP`` (seconds the view hangs after charging, so that a test can SIGKILL the worker
mid-request) with ``SLOW_APP_PIDFILE`` (where the hanging worker writes its pid). In process,
tests set ``SLOW_APP_FAIL`` (``"before-charge"`` or ``"after-charge"``: the view raises there)
and ``PROVIDER_DOWN`` (the reconciler cannot tell) in ``app.config``.
"""

from __future__ import annotations

import os
import time
import typing as t
from pathlib import Path

import sqlalchemy as sa
from flask import Flask, request

from flask_idem import Idempotency, Record, Verdict, derive_key

charges = sa.Table(
    "slow_app_charges",
    sa.MetaData(),
    sa.Column("downstream_key", sa.String(64), primary_key=True),
    sa.Column("amount", sa.Integer, nullable=False),
    sa.Column("reference", sa.String(64), nullable=False),
)


def payment(reference: str, amount: int) -> tuple[dict[str, t.Any], int, dict[str, str]]:
    """The answer for a charge: what the view returns, and what the reconciler stores."""
    payment_id = f"pay_{reference}"
    return {"id": payment_id, "amount": amount}, 201, {"Location": f"/payments/{payment_id}"}


def create_app(database_url: str | None = None) -> Flask:
    app = Flask(__name__)
    app.config.update(
        IDEMPOTENCY_DATABASE_URL=database_url or os.environ["DATABASE_URL"],
        SLOW_APP_FAIL=None,
        PROVIDER_DOWN=False,
    )
    idem = Idempotency(app, tenant=lambda: request.headers.get("X-Tenant"))
    engine = app.extensions["idempotency"].store.engine
    charges.metadata.create_all(engine)

    @app.post("/payments")
    @idem.idempotent
    def create_payment() -> t.Any:
        body = request.get_json()
        amount, reference = int(body["amount"]), str(body["reference"])
        downstream_key = idem.downstream_key("charge")
        # From here on a crash must never re-execute: the provider may have charged.
        idem.side_effect()
        if app.config["SLOW_APP_FAIL"] == "before-charge":
            raise RuntimeError("crashed before the charge")
        with engine.begin() as conn:
            conn.execute(
                charges.insert().values(
                    downstream_key=downstream_key, amount=amount, reference=reference
                )
            )
        if app.config["SLOW_APP_FAIL"] == "after-charge":
            raise RuntimeError("crashed after the charge")
        _hang()
        return payment(reference, amount)

    @idem.reconciler(create_payment)
    def payment_outcome(record: Record) -> Verdict:
        if app.config["PROVIDER_DOWN"]:
            return Verdict.unknown("provider unreachable")
        downstream_key = derive_key(record, "charge")
        with engine.connect() as conn:
            charge = conn.execute(
                sa.select(charges).where(charges.c.downstream_key == downstream_key)
            ).first()
        if charge is None:
            return Verdict.not_happened("no charge with the downstream key")
        return Verdict.happened(payment(charge.reference, charge.amount))

    return app


def _hang() -> None:
    seconds = float(os.environ.get("SLOW_APP_SLEEP", "0"))
    if seconds:
        Path(os.environ["SLOW_APP_PIDFILE"]).write_text(str(os.getpid()))
        time.sleep(seconds)
