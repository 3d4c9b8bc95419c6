"""The next-day check: what a downstream service recorded against what the store recorded.

The extension makes one operation derive one downstream key, but it cannot see a charge made
behind its back: a code path that calls the provider without it, a record deleted by hand
and run again with new downstream keys, a partner that does not deduplicate on the key. A
day later the provider's own ledger shows them. ``flask idem audit-downstream --day D`` (or
:func:`check_downstream`) asks each registered lookup (:meth:`Idempotency.downstream_lookup
<flask_idem.Idempotency.downstream_lookup>`) for the operations the service recorded, matches
them by (tenant, downstream key) with the store's records, and reports:

``unmatched``   an operation of day D whose downstream key no record derives: a duplicate
                made behind the extension's back (or a record already purged: keep the TTL
                longer than the audit's delay);
``duplicate``   a record of day D with more than one operation under its key (a service that
                does not deduplicate, re-run by ``recovery="reexecute"``);
``unknown``     a record of day D that is ``unknown`` (or stuck, or reopened) although the
                service shows its operation: run ``flask idem reconcile``.

Records and operations are read ``margin`` beyond the day on both sides, so an operation made
just after midnight matches its record of the day before; each finding belongs to the day of
its own timestamp (an operation's or a record's creation), so it is reported once.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import enum
import typing as t

from flask import current_app

from ..core.idempotency_keys import derive_key
from ..core.record import Record, State
from ..core.scopes import ACCOUNT, endpoint_of
from ..state import AppState
from ..store import operator_store
from .reconcile import resolve_targets


@dataclasses.dataclass(frozen=True)
class DownstreamRecord:
    """One operation a downstream service recorded (a provider's charge)."""

    #: The service's id for it (``ch_...``): what an operator refunds or voids.
    id: str
    #: Whose operation it is: the tenant of the record that sent it.
    tenant: str
    #: The idempotency key the service was sent, or None when it has none.
    downstream_key: str | None
    #: When the service recorded it (timezone-aware).
    created: dt.datetime
    #: Free text for the report (status, amount); never a key or a body.
    detail: str = ""


#: ``(start, end) -> operations`` the service recorded in ``[start, end)``.
Lookup = t.Callable[[dt.datetime, dt.datetime], t.Iterable[DownstreamRecord]]


@dataclasses.dataclass(frozen=True)
class LookupTarget:
    """A registered lookup and the step its endpoint derives downstream keys for."""

    lookup: Lookup
    step: str


class DiscrepancyKind(str, enum.Enum):
    """What one discrepancy is."""

    UNMATCHED = "unmatched"
    DUPLICATE = "duplicate"
    UNKNOWN = "unknown"


@dataclasses.dataclass(frozen=True)
class Discrepancy:
    """One finding: the operations concerned, and the record when there is one."""

    finding: DiscrepancyKind
    operations: tuple[DownstreamRecord, ...]
    record: Record | None = None


@dataclasses.dataclass(frozen=True)
class DownstreamReport:
    """What one downstream check of ``[start, end)`` found."""

    start: dt.datetime
    end: dt.datetime
    records: int
    operations: int
    discrepancies: tuple[Discrepancy, ...]

    def count(self, finding: DiscrepancyKind) -> int:
        return sum(d.finding is finding for d in self.discrepancies)


#: States whose outcome nobody knows although the service may show it.
_UNSETTLED = (State.UNKNOWN, State.REOPENED)


def check_downstream(
    start: dt.datetime, end: dt.datetime, *, margin: float = 3600
) -> DownstreamReport:
    """Check the operations and records of ``[start, end)`` for ``current_app``.

    :param margin: seconds read beyond the window on both sides, for matching only.
    :raises ConfigurationError: a lookup is registered for a view the app does not have.
    """
    state = AppState.current()
    targets = resolve_targets(
        current_app,
        state.extension.downstream_lookups,
        state.settings.methods,
        "downstream lookup",
    )
    wide = dt.timedelta(seconds=margin)
    store = operator_store(state.store, "the next-day check")
    records = [
        record
        for record in store.created_between(start - wide, end + wide, endpoints=[*targets, ACCOUNT])
        # Of a principal, or account-wide: the endpoint it ran on (an account-wide record of
        # an endpoint without a lookup is not this check's).
        if endpoint_of(record, targets, state.store.keys) in targets
    ]
    # One service may serve several endpoints: ask it once, match against all of them.
    by_lookup: dict[Lookup, dict[tuple[str, str], Record]] = {}
    for record in records:
        target = targets[endpoint_of(record, targets, state.store.keys)]
        keys = by_lookup.setdefault(target.lookup, {})
        keys[(record.scope.tenant, derive_key(record, target.step))] = record
    for target in targets.values():
        by_lookup.setdefault(target.lookup, {})
    found: list[Discrepancy] = []
    total = 0
    for lookup, keys in by_lookup.items():
        operations = list(lookup(start - wide, end + wide))
        total += sum(start <= op.created < end for op in operations)
        found.extend(_compare(keys, operations, start, end))
    return DownstreamReport(
        start, end, sum(start <= r.created_at < end for r in records), total, tuple(found)
    )


def _compare(
    keys: dict[tuple[str, str], Record],
    operations: list[DownstreamRecord],
    start: dt.datetime,
    end: dt.datetime,
) -> t.Iterator[Discrepancy]:
    matched: dict[tuple[str, str], list[DownstreamRecord]] = {}
    for op in operations:
        key = (op.tenant, op.downstream_key or "")
        if key in keys:
            matched.setdefault(key, []).append(op)
        elif start <= op.created < end:
            yield Discrepancy(DiscrepancyKind.UNMATCHED, (op,))
    for key, ops in matched.items():
        record = keys[key]
        if not start <= record.created_at < end:
            continue  # the record's own day reports it
        if len(ops) > 1:
            yield Discrepancy(DiscrepancyKind.DUPLICATE, tuple(ops), record)
        if record.state in _UNSETTLED or record.lease_expired:
            yield Discrepancy(DiscrepancyKind.UNKNOWN, tuple(ops), record)
