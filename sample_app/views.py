"""The payments API: two idempotent POST endpoints and two reads.

Problems raised in the protected views (card declined, validation errors) are answers like any
other: flask_idem stores them and replays them to retries.
"""

from __future__ import annotations

import re
import secrets
import time
import typing as t

import sqlalchemy as sa
from flask import Blueprint, jsonify
from werkzeug.wrappers import Response

from . import problems
from .auth import requires, tenant
from .extensions import db, idem
from .models import Payment, Refund, payments
from .provider import Charge, ProviderTimeout, current_provider
from .schemas import PaymentSchema, RefundSchema, load_body

#: The customer whose payment makes the handler fail before it calls the provider.
CRASH_CUSTOMER = "cus_crash"
#: What the payment ids this app hands out look like; anything else (a NUL, which PostgreSQL
#: text cannot hold, or 4 KB of garbage) is a 404 without a query.
PAYMENT_ID = re.compile(r"pay_[0-9a-f]{24}", re.ASCII)

bp = Blueprint("payments", __name__, url_prefix="/v1")


def payment_document(row: t.Any) -> dict[str, t.Any]:
    return {
        "id": row.id,
        "object": "payment",
        "amount": row.amount,
        "currency": row.currency,
        "customer": row.customer,
        "description": row.description,
        "status": row.status,
        "provider_charge_id": row.provider_charge_id,
        "created": row.created,
    }


def record_payment(conn: sa.Connection, tenant: str, charge: Charge) -> t.Any:
    """The payment row of a succeeded charge, inserted once (the reconciler may have)."""
    existing = conn.execute(
        sa.select(payments).where(
            payments.c.tenant == tenant, payments.c.provider_charge_id == charge.id
        )
    ).first()
    if existing is not None:
        return existing
    values = {
        "id": f"pay_{secrets.token_hex(12)}",
        "tenant": tenant,
        "amount": charge.amount,
        "currency": charge.currency,
        "customer": charge.customer,
        "description": charge.description,
        "metadata": charge.metadata,
        "status": "succeeded",
        "provider_charge_id": charge.id,
        "created": int(time.time()),
    }
    return conn.execute(payments.insert().values(values).returning(payments)).one()


# ``reexecute``: when the first attempt's outcome is unknown (its worker died, the provider
# call failed after charging), a retry runs the view again as the same operation: the
# provider deduplicates on the downstream key, and the payment row commits only together
# with the stored response. ``release_before_contact``: the view asks for its downstream key before
# it calls the provider, so a failure before that (``cus_crash``) gives the key back.
@bp.post("/payments")
@requires("payments:write")
@idem.idempotent(exclude=["client_ts"], recovery="reexecute", release_before_contact=True)
def create_payment() -> Response:
    body = load_body(PaymentSchema())
    if body["customer"] == CRASH_CUSTOMER:
        raise RuntimeError("simulated failure before the provider call")
    # Asking for the downstream key declares the contact: from here any failure leaves the
    # key "unknown" (re-run as the same operation on retry), never free to charge anew.
    downstream_key = idem.downstream_key("charge")
    try:
        charge = current_provider().charge(
            tenant=tenant(),
            downstream_key=downstream_key,
            amount=body["amount"],
            currency=body["currency"],
            customer=body["customer"],
            description=body.get("description"),
            metadata=body.get("metadata"),
        )
    except ProviderTimeout:
        raise problems.provider_timeout() from None
    if charge.status == "declined":
        raise problems.card_declined()
    # Committed by the extension in the same transaction as the stored response.
    row = record_payment(idem.connection(), tenant(), charge)
    response = jsonify(payment_document(row))
    response.status_code = 201
    response.headers["Location"] = f"/v1/payments/{row.id}"
    # Per-request header: the extension never stores it, so a replay does not set it again.
    response.set_cookie("last_payment", row.id, httponly=True, path="/")
    return response


@bp.get("/payments")
def list_payments() -> Response:
    rows = idem.connection().execute(
        sa.select(payments).where(payments.c.tenant == tenant()).order_by(payments.c.seq.desc())
    )
    return jsonify({"object": "list", "data": [payment_document(row) for row in rows]})


@bp.get("/payments/<payment_id>")
def get_payment(payment_id: str) -> Response:
    if not PAYMENT_ID.fullmatch(payment_id):
        raise problems.payment_not_found(payment_id)
    row = (
        idem.connection()
        .execute(
            sa.select(payments).where(payments.c.id == payment_id, payments.c.tenant == tenant())
        )
        .first()
    )
    if row is None:
        raise problems.payment_not_found(payment_id)
    return jsonify(payment_document(row))


# Every write of this view is in the transaction committed with the stored response, so a
# worker that died mid-request left nothing behind and re-running it is safe.
# The Flask-SQLAlchemy style: ORM models on ``db.session``, which flask_idem flushes after the
# view and commits with the stored response (a view must not commit it itself). Every write of
# this view is in that transaction, so a worker that died mid-request left nothing behind and
# re-running it is safe.
@bp.post("/payments/<payment_id>/refunds")
@requires("payments:write")
@idem.idempotent(recovery="reexecute", release_before_contact=True)
def create_refund(payment_id: str) -> Response:
    if not PAYMENT_ID.fullmatch(payment_id):
        raise problems.payment_not_found(payment_id)
    body = load_body(RefundSchema())
    # The row lock serialises refunds of one payment, so two of them (with different keys)
    # cannot both fit in the same remainder.
    payment = db.session.execute(
        sa.select(Payment)
        .where(Payment.id == payment_id, Payment.tenant == tenant())
        .with_for_update()
    ).scalar_one_or_none()
    if payment is None:
        raise problems.payment_not_found(payment_id)
    refunded = db.session.execute(
        sa.select(sa.func.coalesce(sa.func.sum(Refund.amount), 0)).where(
            Refund.payment_id == payment_id
        )
    ).scalar_one()
    remaining = payment.amount - refunded
    if body["amount"] > remaining:
        raise problems.refund_exceeds_payment(remaining)
    refund = Refund(
        id=f"re_{secrets.token_hex(12)}",
        tenant=tenant(),
        payment_id=payment_id,
        amount=body["amount"],
        created=int(time.time()),
    )
    db.session.add(refund)
    response = jsonify(
        {"id": refund.id, "object": "refund", "payment": payment_id, "amount": body["amount"]}
    )
    response.status_code = 201
    return response
