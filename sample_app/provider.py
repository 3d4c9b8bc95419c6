"""A fake payment provider: an "external service" that deduplicates on the caller's key.

It stands for a real provider's API (Stripe, Adyen...): it has its own ledger
(``provider_charges``) written through its own engine and transaction, so its charge is
committed whatever happens to the sample app's request afterwards. Called twice with the same
downstream key it charges once and answers the first charge again, which is what makes
``recovery="reexecute"`` safe for ``POST /v1/payments``.
"""

from __future__ import annotations

import dataclasses
import secrets
import time
import typing as t

import sqlalchemy as sa
from flask import Flask, current_app

from flask_idem.store import create_engine

from .models import dialect_insert, provider_charges

EXTENSION_NAME = "sample_provider"
#: The customer whose card the provider always declines (the 402 example).
DECLINED_CUSTOMER = "cus_declined"
#: The customer whose first charge (per downstream key) is taken, but whose answer is lost:
#: the call raises :class:`ProviderTimeout` after the money moved, the classic double-charge
#: trap. A repeated call with the same downstream key answers that charge.
TIMEOUT_CUSTOMER = "cus_timeout"


class ProviderTimeout(Exception):
    """The provider did not answer in time; it may have charged."""


@dataclasses.dataclass(frozen=True)
class Charge:
    id: str
    status: t.Literal["succeeded", "declined"]
    amount: int
    currency: str
    customer: str
    description: str | None
    metadata: t.Any


class Provider:
    """The provider's client and server in one object.

    :param latency: seconds the provider takes to answer a new charge (after recording it, so a
        worker killed meanwhile leaves a charge the app has not recorded yet); a repeated
        downstream key is answered from its ledger at once.
    :param transit: seconds every charge spends on its way to the provider, before the provider
        records it (a worker frozen meanwhile holds its downstream key, and no charge exists).
    :param log_path: a file that gets one line per charge attempt, written before the provider
        touches its database, so tests can count attempts even when the database is down.
    """

    def __init__(
        self,
        url: str,
        *,
        latency: float = 0.0,
        transit: float = 0.0,
        log_path: str | None = None,
    ) -> None:
        # Checked on checkout: an external service must survive a database restart.
        self.engine = create_engine(url, pool_pre_ping=True)
        self.latency = latency
        self.transit = transit
        self.log_path = log_path

    def charge(
        self,
        *,
        tenant: str,
        downstream_key: str,
        amount: int,
        currency: str,
        customer: str,
        description: str | None = None,
        metadata: t.Any = None,
    ) -> Charge:
        """Charge once per ``(tenant, downstream_key)``; a repeated call returns that charge."""
        if self.log_path:
            with open(self.log_path, "a", encoding="utf-8") as log:
                log.write(f"{tenant} {downstream_key}\n")
        if self.transit:
            time.sleep(self.transit)
        status = "declined" if customer == DECLINED_CUSTOMER else "succeeded"
        with self.engine.begin() as conn:
            insert = dialect_insert(conn, provider_charges).values(
                id=f"ch_{secrets.token_hex(12)}",
                tenant=tenant,
                downstream_key=downstream_key,
                amount=amount,
                currency=currency,
                customer=customer,
                description=description,
                metadata=metadata,
                status=status,
                created=int(time.time()),
            )
            new = conn.execute(insert.on_conflict_do_nothing()).rowcount == 1
        charge = self.find(tenant=tenant, downstream_key=downstream_key)
        assert charge is not None
        if new and customer == TIMEOUT_CUSTOMER:
            raise ProviderTimeout(f"no answer for charge {downstream_key}")
        if new and self.latency:
            time.sleep(self.latency)
        return charge

    def charges_between(self, start: int, end: int) -> list[sa.Row[t.Any]]:
        """Every merchant's charges created in ``[start, end)`` (unix seconds): the
        provider's "list charges" API, which the next-day audit reads."""
        with self.engine.connect() as conn:
            return list(
                conn.execute(
                    sa.select(provider_charges).where(
                        provider_charges.c.created >= start, provider_charges.c.created < end
                    )
                )
            )

    def find(self, *, tenant: str, downstream_key: str) -> Charge | None:
        """The charge made with ``downstream_key``, if any (the provider's lookup API)."""
        with self.engine.connect() as conn:
            row = conn.execute(
                sa.select(provider_charges).where(
                    provider_charges.c.tenant == tenant,
                    provider_charges.c.downstream_key == downstream_key,
                )
            ).first()
        if row is None:
            return None
        return Charge(
            row.id,
            row.status,
            row.amount,
            row.currency,
            row.customer,
            row.description,
            row.metadata,
        )


def init_app(app: Flask, url: str) -> None:
    app.extensions[EXTENSION_NAME] = Provider(
        url,
        latency=int(app.config["SAMPLE_PROVIDER_LATENCY_MS"]) / 1000,
        transit=int(app.config["SAMPLE_PROVIDER_TRANSIT_MS"]) / 1000,
        log_path=app.config["SAMPLE_PROVIDER_LOG"],
    )


def current_provider() -> Provider:
    return t.cast(Provider, current_app.extensions[EXTENSION_NAME])
