"""Background work of the payments API: subscription renewals, charged by a queue worker.

A queue (RQ, Celery, SQS) delivers each renewal message at least once. ``@idem.job`` makes a
redelivered message (the worker died between the charge and the ack, the queue's visibility
timeout ran out while it was still working) answer the first run's payment instead of
charging again. The key is the business operation, one subscription's period, so a producer
that publishes the same renewal twice is deduplicated as well.
"""

from __future__ import annotations

import typing as t

from . import problems
from .extensions import idem
from .provider import current_provider
from .views import payment_document, record_payment


def renewal_key(tenant: str, subscription: str, period: str, *_: t.Any) -> str:
    """One renewal is one subscription's period: ``sub_42.2026-12`` (called with the job's
    arguments)."""
    return f"{subscription}.{period}"


# ``reexecute``: a renewal whose worker died after the charge runs again as the same operation
# (the provider deduplicates on the downstream key; the payment row commits with the result).
@idem.job(
    "renew-subscription",
    key=renewal_key,
    tenant="tenant",
    recovery="reexecute",
    release_before_contact=True,
)
def renew_subscription(
    tenant: str, subscription: str, period: str, amount: int, currency: str, customer: str
) -> dict[str, t.Any]:
    """Charge one period of a subscription and record the payment; returns the payment (or
    the ``card-declined`` problem document), which a redelivery gets back."""
    charge = current_provider().charge(
        tenant=tenant,
        downstream_key=idem.downstream_key("charge"),
        amount=amount,
        currency=currency,
        customer=customer,
        description=f"{subscription} {period}",
    )
    if charge.status == "declined":
        return problems.card_declined().document()
    return payment_document(record_payment(idem.connection(), tenant, charge))
