"""The audit trail (``IDEMPOTENCY_AUDIT``): who did what to which record, when.

When it is on, every state transition of a record (claimed, taken over, completed or unstored,
released, unknown, reopened, settled by a reconciler or an operator, evicted) appends one row
to ``idempotency_audit``, in the same statement as the transition on PostgreSQL (a
data-modifying CTE) and in the same transaction on SQLite, so a transition is never recorded
without its row nor the other way round. Answers that change nothing (replays, 409, 422) are
not audited: they are events and metrics, and auditing them would turn the cheapest answer
into a durable write that any client holding a key could repeat at will.

No key and no body is stored. ``lookup`` is SHA-256 over (tenant, the key's stored digest),
so whoever knows the key finds its timeline (``flask idem history --tenant T``, the key on
standard input; or by ``key_hash``, which rows carry as the logs do), and a copy of the
table shows no key: audit rows outlive the keys' TTL by years (as long as the ledger), and keys are
client-chosen values that sometimes carry order numbers or e-mail addresses. Without
``IDEMPOTENCY_KEY_SECRETS`` a guessable key (``order-42``) can still be confirmed by hashing
guesses; with a secret the stored digest is keyed, and so is the lookup made of it.

Who acted is ``request`` (a view or a job), ``reconciler`` or ``operator``; reconcilers and
``flask idem`` commands say so with :func:`acting`.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import datetime as dt
import hashlib
import typing as t

from ..core.key_digest import is_stored

#: (actor, detail) of the store writes made in this context.
_ACTOR: contextvars.ContextVar[tuple[str, str | None]] = contextvars.ContextVar(
    "flask_idem_audit_actor", default=("request", None)
)
#: The longest ``detail`` kept (the column's width).
DETAIL_LENGTH = 255


def lookup_digest(tenant: str, stored: str) -> bytes:
    """What the audit table stores instead of the key: SHA-256 over the tenant and the key as
    its record stores it (:mod:`flask_idem.core.key_digest`; rows written before revision 0011
    hashed the raw key)."""
    return hashlib.sha256("\x1f".join(("flask_idem audit", tenant, stored)).encode()).digest()


def lookups(tenant: str, key: str, stored: t.Iterable[str]) -> list[bytes]:
    """Every ``lookup`` the audit rows of ``key`` can carry: one per stored form of the key,
    and the raw key's for rows written before revision 0011 (a raw key never looks like a
    stored digest, so the two never collide)."""
    found = [lookup_digest(tenant, form) for form in stored]
    if not is_stored(key):
        found.append(lookup_digest(tenant, key))
    return found


@contextlib.contextmanager
def acting(actor: str, detail: str | None = None) -> t.Iterator[None]:
    """Attribute the store's writes in this block to ``actor`` (``reconciler``,
    ``operator``), with an optional note (never a key or a body)."""
    token = _ACTOR.set((actor, detail[:DETAIL_LENGTH] if detail else None))
    try:
        yield
    finally:
        _ACTOR.reset(token)


def current_actor() -> tuple[str, str | None]:
    """The actor and note of the store writes made now."""
    return _ACTOR.get()


@dataclasses.dataclass(frozen=True)
class AuditEntry:
    """One row of the audit trail."""

    occurred_at: dt.datetime
    tenant: str
    endpoint: str
    key_hash: str
    #: The record's ``created_at``: which operation of the key (a key reused after its TTL is
    #: a new operation, with a new record).
    record_created_at: dt.datetime | None
    #: ``claimed``, ``taken_over``, ``completed``, ``unstored``, ``released``, ``unknown``,
    #: ``reopened``, ``evicted``.
    event: str
    #: The record's state afterwards; None when the record was deleted.
    state: str | None
    status: int | None
    fingerprint: bytes | None
    actor: str
    detail: str | None

    def as_json(self) -> dict[str, t.Any]:
        """As ``flask idem history --json`` and the operator page show it."""
        created = self.record_created_at
        return {
            "occurred_at": self.occurred_at.isoformat(),
            "tenant": self.tenant,
            "endpoint": self.endpoint,
            "key_hash": self.key_hash,
            "record_created_at": None if created is None else created.isoformat(),
            "event": self.event,
            "state": self.state,
            "status": self.status,
            "fingerprint": None if self.fingerprint is None else self.fingerprint.hex(),
            "actor": self.actor,
            "detail": self.detail,
        }
