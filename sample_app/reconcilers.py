"""Settling stuck payments, and auditing them the next day: ask the provider.

A payment whose worker died after the provider call (or whose outcome is ``unknown``) is
looked up at the provider by its downstream key, the key every execution of the operation
derives: no charge means nothing happened yet (the record is reopened, so the client's retry
charges under that same key, the one a worker that is only frozen still holds), a charge means
the payment happened, and it is recorded now exactly as the view would have recorded it.
Subscription renewals (a job) charge the same way and are settled by the same function.

The next day, ``flask idem audit-downstream`` compares the provider's list of charges with the
records of both (:func:`provider_charges`): a charge no record derived the downstream key of
was made behind the extension's back, and is reported for a refund.
"""

from __future__ import annotations

import datetime as dt

from flask import current_app

from flask_idem import DownstreamRecord, Record, Verdict, derive_key
from flask_idem.store import create_engine

from . import problems
from .extensions import idem
from .jobs import renew_subscription
from .provider import current_provider
from .views import create_payment, payment_document, record_payment


@idem.reconciler(renew_subscription)
@idem.reconciler(create_payment)
def payment_outcome(record: Record) -> Verdict:
    tenant = record.scope.tenant
    charge = current_provider().find(tenant=tenant, downstream_key=derive_key(record, "charge"))
    if charge is None:
        return Verdict.not_happened("the provider has no charge for this payment")
    if charge.status == "declined":
        return Verdict.happened(problems.card_declined().get_response(), reason="declined")
    engine = create_engine(current_app.config["IDEMPOTENCY_DATABASE_URL"])
    try:
        with engine.begin() as conn:
            row = record_payment(conn, tenant, charge)
    finally:
        engine.dispose()
    location = {"Location": f"/v1/payments/{row.id}"}
    return Verdict.happened((payment_document(row), 201, location), reason="charged")


@idem.downstream_lookup(renew_subscription, step="charge")
@idem.downstream_lookup(create_payment, step="charge")
def provider_charges(start: dt.datetime, end: dt.datetime) -> list[DownstreamRecord]:
    """The provider's charges of ``[start, end)``, with the downstream key each was sent."""
    rows = current_provider().charges_between(int(start.timestamp()), int(end.timestamp()))
    return [
        DownstreamRecord(
            row.id,
            row.tenant,
            row.downstream_key,
            dt.datetime.fromtimestamp(row.created, dt.timezone.utc),
            detail=f"{row.status} {row.amount} {row.currency} {row.customer}",
        )
        for row in rows
    ]
