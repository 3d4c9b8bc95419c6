"""One signal and one structured log record per state transition.

:func:`emit` is the only place transitions leave the package: it sends the transition's
blinker signal (:mod:`flask_idem.core.signals`) and logs one record on the ``flask_idem.events``
logger, at INFO, or WARNING for ``unknown`` and ``lease_lost``, or ERROR for
``store_unavailable``. Metrics (:mod:`flask_idem.ops.metrics`) are receivers of these signals.

Every log record carries these attributes, so that a JSON formatter (python-json-logger,
structlog's stdlib bridge) picks them up as fields; none of them is ever the raw key or a body:

==============  ===============================================================================
``event``       the transition: ``claimed``, ``taken_over``, ``completed``, ``replayed``,
                ``conflict``, ``pending``, ``not_stored``, ``mismatch``, ``rate_limited``,
                ``released``, ``unknown``, ``lease_lost``, ``store_unavailable``, ``settled``
``tenant``      the scope's tenant
``endpoint``    the endpoint (``POST /v1/payments``, ``JOB renew-subscription``), also of an
                account-wide key (``*`` outside its request: reconcilers, the CLI); never
                a per-principal key's principal (that would be one series per user)
``key_hash``    16 hex digits of SHA-256 over (tenant, endpoint, key), as in ``flask idem``
``fingerprint`` the first 12 hex digits of the request's fingerprint, or None
``state``       the record's state afterwards (None: deleted, or unknown to the caller)
``replayed``    True for a replay
``status``      the HTTP status answered or stored, when there is one
``duration_ms`` of the claim (claim-time decisions) or of the view since its claim (the end
                of an attempt); None outside a request or job
``reason``,     why (``released``, ``unknown``), where the store failed (``stage``), who
``stage``,      settled a record and how (``actor``, ``action``), whether a snapshot was
``actor``,      stored (``stored``): present only on the transitions that have them
``action``,
``stored``
==============  ===============================================================================

When nobody listens to a signal and the logger is not enabled for its level, :func:`emit`
returns before hashing anything.
"""

from __future__ import annotations

import functools
import logging
import time
import typing as t

from blinker import NamedSignal
from flask import current_app

from .core import signals
from .core.idempotency_keys import key_hash
from .core.record import Scope
from .core.scopes import split
from .observers import call_observer, observer_name

log = logging.getLogger("flask_idem.events")

#: Hex digits of the fingerprint carried by events.
FINGERPRINT_PREFIX = 12

_LEVELS: dict[NamedSignal, int] = {
    signals.unknown: logging.WARNING,
    signals.lease_lost: logging.WARNING,
    signals.store_unavailable: logging.ERROR,
}
#: The record's state after each transition, unless the caller says otherwise.
_STATES: dict[NamedSignal, str | None] = {
    signals.claimed: "in_progress",
    signals.taken_over: "in_progress",
    signals.completed: "completed",
    signals.replayed: "completed",
    signals.conflict: "in_progress",
    signals.not_stored: "unstored",
    signals.unknown: "unknown",
    signals.lease_lost: "in_progress",
}
#: The status a client gets for a transition that always answers the same one.
_STATUSES: dict[NamedSignal, int] = {
    signals.conflict: 409,
    signals.pending: 409,
    signals.not_stored: 409,
    signals.mismatch: 422,
    signals.rate_limited: 429,
    signals.lease_lost: 409,
    signals.store_unavailable: 503,
}


def event_name(signal: NamedSignal) -> str:
    """``idempotency-taken-over`` -> ``taken_over``."""
    return signal.name.removeprefix("idempotency-").replace("-", "_")


def emit(
    signal: NamedSignal,
    scope: Scope,
    *,
    fingerprint: bytes | None = None,
    since: float | None = None,
    endpoint: str | None = None,
    **extra: t.Any,
) -> None:
    """Send ``signal`` for ``scope`` and log the transition once.

    An attempt (:meth:`flask_idem.attempt.Attempt.emit`) gives its fingerprint and its clock:
    ``since`` is the ``time.monotonic()`` the duration counts from. Callers outside an attempt
    (reconcilers, the CLI) give the fingerprint they know, and no duration.

    :param endpoint: the endpoint the attempt runs, when the scope's endpoint column does not
        say it (account-wide); else the column's, principal left out.
    """
    level = _LEVELS.get(signal, logging.INFO)
    logged = log.isEnabledFor(level)
    if not signal.receivers and not logged:
        return  # the common case: nobody listens, so skip hashing the key
    duration = None if since is None else time.monotonic() - since
    fields: dict[str, t.Any] = {
        "event": event_name(signal),
        "tenant": scope.tenant,
        "endpoint": endpoint or split(scope.endpoint)[1],
        "key_hash": key_hash(scope),
        "fingerprint": None if fingerprint is None else fingerprint.hex()[:FINGERPRINT_PREFIX],
        "state": "unstored" if extra.get("stored") is False else _STATES.get(signal),
        "replayed": signal is signals.replayed,
        "status": _STATUSES.get(signal),
        "duration": duration,
        **extra,
    }
    if signal.receivers:
        _send(signal, fields)
    if logged:
        record = {name: value for name, value in fields.items() if name != "duration"}
        record["duration_ms"] = None if duration is None else round(duration * 1000, 3)
        detail = fields.get("reason") or fields.get("stage") or fields.get("action")
        log.log(
            level,
            "idempotency %s%s",
            fields["event"],
            f": {detail}" if detail else "",
            extra=record,
        )


def _send(signal: NamedSignal, fields: dict[str, t.Any]) -> None:
    """``signal.send``, one receiver at a time: a receiver that raises is reported and the
    others still run (see :mod:`flask_idem.observers`)."""
    sender = current_app._get_current_object()  # type: ignore[attr-defined]
    for receiver in signal.receivers_for(sender):
        call_observer(
            observer_name(receiver),
            functools.partial(receiver, sender, **fields),
            key_hash=fields["key_hash"],
        )
