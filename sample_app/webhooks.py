"""The provider's webhooks: ``POST /v1/webhooks/provider``, one effect per event.

The provider signs every delivery (``Provider-Signature``, verified by
:func:`sample_app.auth.authenticate` before the claim; the account whose secret verifies it is
the tenant) and retries a delivery that failed or timed out, often aggressively. It assigns
each event one id (``evt_...``) and each delivery attempt another (``Provider-Delivery``): the
event id is the idempotency key, so every delivery of one event is one operation; the delivery
id is only kept for diagnostics.
"""

from __future__ import annotations

import time
import typing as t

import sqlalchemy as sa
from flask import Blueprint, current_app, jsonify, request
from marshmallow import Schema, fields, validate
from werkzeug.wrappers import Response

from .auth import tenant
from .extensions import idem
from .models import payments, webhook_events
from .schemas import Text, load_body

bp = Blueprint("webhooks", __name__, url_prefix="/v1")
DELIVERY_HEADER = "Provider-Delivery"
#: Events that change a payment: ``data.charge`` names its provider charge.
PAYMENT_STATUS = {"charge.refunded": "refunded", "charge.disputed": "disputed"}


class EventSchema(Schema):
    id = Text(required=True)
    type = Text(required=True, validate=validate.Length(min=1, max=64))
    data = fields.Dict(keys=Text(), load_default=dict)


def event_id(req: t.Any) -> t.Any:
    """The key of a delivery: its event's id (None without one: 400 before any claim)."""
    body = req.get_json(silent=True)
    return body.get("id") if isinstance(body, dict) else None


# Every write is in the transaction committed with the stored answer, so a worker killed
# mid-event left nothing behind: a redelivery after the lease simply runs it (``reexecute``).
@bp.post("/webhooks/provider")
@idem.idempotent(key=event_id, recovery="reexecute", release_before_contact=True)
def provider_event() -> Response:
    event = load_body(EventSchema())
    conn = idem.connection()
    conn.execute(
        webhook_events.insert().values(
            tenant=tenant(),
            event_id=event["id"],
            type=event["type"],
            delivery_id=request.headers.get(DELIVERY_HEADER),
            received=int(time.time()),
        )
    )
    status = PAYMENT_STATUS.get(event["type"])
    charge = event["data"].get("charge")
    if status is not None and isinstance(charge, str):
        conn.execute(
            sa.update(payments)
            .where(payments.c.tenant == tenant(), payments.c.provider_charge_id == charge)
            .values(status=status)
        )
    # Slows the handler down for the tests that kill a worker mid-event.
    time.sleep(int(current_app.config["SAMPLE_WEBHOOK_LATENCY_MS"]) / 1000)
    return jsonify({"received": event["id"], "type": event["type"]})
