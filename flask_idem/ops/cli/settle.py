"""``flask idem reconcile`` and ``audit-downstream``: settling unknown records and checking
yesterday's answers against the downstream services."""

from __future__ import annotations

import datetime as dt
import sys
import typing as t

import click

from ...core.idempotency_keys import key_hash
from ...core.serialization import record_schema
from ...state import AppState
from ...store import operator_store
from ..downstream import (
    Discrepancy,
    DiscrepancyKind,
    DownstreamRecord,
    DownstreamReport,
    check_downstream,
)
from ..reconcile import Action, Settlement, reconcile
from .common import (
    PROGRESS_AFTER,
    age_of,
    format_table,
    idem_group,
    json_option,
    plural,
    print_json,
    store_errors,
)


@idem_group.command("reconcile")
@click.option(
    "--limit",
    type=click.IntRange(min=1),
    default=1000,
    show_default=True,
    help="Stuck records to reconcile in this run, oldest first.",
)
@json_option
@store_errors
def reconcile_command(limit: int, as_json: bool) -> None:
    """Settle stuck records with the registered reconcilers.

    Each record's reconciler says whether its operation happened (the record completes and
    retries replay it), did not (the record is reopened: the next retry runs it as the same
    operation, with the same downstream keys) or cannot tell (the record stays).
    Exits with status 1 when any record stays unknown.
    """
    records = operator_store(AppState.current().store, "flask idem reconcile").stuck(limit=limit)
    if len(records) > PROGRESS_AFTER:
        with click.progressbar(records, label="reconciling", file=sys.stderr) as progress:
            settlements = list(reconcile(progress))
    else:
        settlements = list(reconcile(records))
    counts = {action: 0 for action in Action}
    for settlement in settlements:
        counts[settlement.action] += 1
    if as_json:
        print_json(
            {
                **{action.value: count for action, count in counts.items()},
                "records": [_settlement_json(settlement) for settlement in settlements],
            }
        )
    else:
        click.echo(_reconcile_text(settlements, counts))
    if counts[Action.UNKNOWN]:
        click.get_current_context().exit(1)


@idem_group.command("audit-downstream")
@click.option(
    "--day",
    type=click.DateTime(["%Y-%m-%d"]),
    default=None,
    help="The UTC day to audit [default: yesterday].",
)
@click.option(
    "--margin",
    type=click.FloatRange(min=0),
    default=3600,
    show_default=True,
    help="Seconds read beyond the day on both sides, to match operations across midnight.",
)
@json_option
@store_errors
def audit_downstream(day: dt.datetime | None, margin: float, as_json: bool) -> None:
    """Compare a day of records with what downstream services recorded.

    Each registered downstream lookup (idem.downstream_lookup) lists the operations its
    service recorded (a provider's charges); they are matched by downstream key with the
    day's completed and unknown records. Reports operations no record explains (a duplicate
    made behind the extension's back), records with more than one operation, and unknown
    records the service shows done. Exits with status 1 when it finds anything.
    """
    today = dt.datetime.now(dt.timezone.utc).replace(hour=0, minute=0, second=0, microsecond=0)
    start = today - dt.timedelta(days=1) if day is None else day.replace(tzinfo=dt.timezone.utc)
    ttl = AppState.current().settings.ttl
    if start < dt.datetime.now(dt.timezone.utc) - dt.timedelta(seconds=ttl):
        click.echo(
            "warning: the day is older than IDEMPOTENCY_TTL; records may be purged already, "
            "so their operations would be reported as unmatched",
            err=True,
        )
    report = check_downstream(start, start + dt.timedelta(days=1), margin=margin)
    if as_json:
        print_json(_report_json(report))
    else:
        click.echo(_report_text(report))
    if report.discrepancies:
        click.get_current_context().exit(1)


def _report_json(report: DownstreamReport) -> dict[str, t.Any]:
    def operation(op: DownstreamRecord) -> dict[str, t.Any]:
        return {
            "id": op.id,
            "tenant": op.tenant,
            "created": op.created.isoformat(),
            "detail": op.detail,
        }

    def discrepancy(found: Discrepancy) -> dict[str, t.Any]:
        record = found.record
        return {
            "finding": found.finding.value,
            "operations": [operation(op) for op in found.operations],
            "record": None
            if record is None
            else record_schema(bodies=False, keys=False).dump(record),
        }

    return {
        "start": report.start.isoformat(),
        "end": report.end.isoformat(),
        "records": report.records,
        "operations": report.operations,
        **{finding.value: report.count(finding) for finding in DiscrepancyKind},
        "discrepancies": [discrepancy(found) for found in report.discrepancies],
    }


_FINDING_TEXT = {
    DiscrepancyKind.UNMATCHED: "no record derives its downstream key (made behind the extension)",
    DiscrepancyKind.DUPLICATE: "one record, more than one downstream operation",
    DiscrepancyKind.UNKNOWN: "the record is unknown but the service shows it done: reconcile it",
}


def _report_text(report: DownstreamReport) -> str:
    summary = (
        f"audited {report.start:%Y-%m-%d}: {plural(report.records, 'record')}, "
        f"{plural(report.operations, 'downstream operation')}; "
        f"{report.count(DiscrepancyKind.UNMATCHED)} unmatched, "
        f"{report.count(DiscrepancyKind.DUPLICATE)} duplicate, "
        f"{report.count(DiscrepancyKind.UNKNOWN)} unknown but done"
    )
    if not report.discrepancies:
        return summary
    rows = [
        [
            found.finding.value,
            ", ".join(op.id for op in found.operations),
            found.operations[0].tenant,
            "-" if found.record is None else found.record.scope.endpoint,
            "-" if found.record is None else key_hash(found.record.scope),
            _FINDING_TEXT[found.finding],
        ]
        for found in report.discrepancies
    ]
    table = format_table(["FINDING", "OPERATIONS", "TENANT", "ENDPOINT", "KEY HASH", "WHAT"], rows)
    return f"{summary}\n\n{table}"


def _settlement_json(settlement: Settlement) -> dict[str, t.Any]:
    dumped = record_schema(bodies=False, keys=False).dump(settlement.record)
    return {**dumped, "action": settlement.action.value, "reason": settlement.reason}


def _reconcile_text(settlements: list[Settlement], counts: dict[Action, int]) -> str:
    summary = (
        f"reconciled {plural(len(settlements), 'stuck record')}: "
        f"{counts[Action.COMPLETED]} completed, {counts[Action.REOPENED]} reopened, "
        f"{counts[Action.UNKNOWN]} still unknown"
    )
    if counts[Action.SKIPPED]:
        summary += f", {counts[Action.SKIPPED]} skipped (settled meanwhile, or already reopened)"
    unknown = [s for s in settlements if s.action is Action.UNKNOWN]
    if not unknown:
        return summary
    rows = [
        [
            age_of(s.record),
            s.record.scope.tenant,
            s.record.scope.endpoint,
            key_hash(s.record.scope),
            s.reason,
        ]
        for s in unknown
    ]
    table = format_table(["AGE", "TENANT", "ENDPOINT", "KEY HASH", "WHY"], rows)
    return f"{summary}\n\nstill unknown:\n{table}"
