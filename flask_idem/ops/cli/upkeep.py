"""``flask idem maintain``, ``check``, ``citus`` and ``metrics``: partitions, the deployment's
checks, distribution over Citus, the store's gauges."""

from __future__ import annotations

import click
from flask import current_app

from ...core.record import MaintenanceReport
from ...state import AppState
from ...store import citus, operator_store
from .. import check
from .common import (
    idem_group,
    json_option,
    plural,
    print_json,
    store_errors,
)


@idem_group.command()
@click.option(
    "--ahead",
    type=click.IntRange(min=0),
    default=None,
    help="Partitions to keep ready after the current one [default: IDEMPOTENCY_PARTITIONS_AHEAD].",
)
@click.option("--dry-run", is_flag=True, help="Only print what would be done.")
@json_option
@store_errors
def maintain(ahead: int | None, dry_run: bool, as_json: bool) -> None:
    """Create partitions ahead; drop and purge expired records.

    With IDEMPOTENCY_ARCHIVE_RETENTION (PostgreSQL), expired partitions are detached into
    IDEMPOTENCY_ARCHIVE_SCHEMA instead, and dropped once kept that long. Idempotent and safe
    to run from cron every few minutes.
    """
    state = AppState.current()
    store = operator_store(state.store, "flask idem maintain")
    ahead = state.settings.partitions_ahead if ahead is None else ahead
    report = store.maintain(ahead=ahead, dry_run=dry_run)
    if as_json:
        dumped = report.as_dict()
        if not store.audit:
            dumped = {k: v for k, v in dumped.items() if not k.startswith("audit_")}
        if store.archive is None or store.dialect != "postgresql":
            dumped = {k: v for k, v in dumped.items() if not k.startswith("archive")}
        print_json({"dialect": store.dialect, **dumped})
    else:
        partitioned = store.dialect == "postgresql"
        click.echo(
            _maintenance_text(
                report,
                partitioned=partitioned,
                audited=store.audit,
                archiving=partitioned and store.archive is not None,
            )
        )


@idem_group.command("check")
@json_option
def check_command(as_json: bool) -> None:
    """Check that the database is ready for this flask_idem: schema, partitions, sessions.

    One line per check, ok, warning or error: the database, the schema revision against this
    package's head, on PostgreSQL the current partition and IDEMPOTENCY_PARTITIONS_AHEAD more,
    and the session settings flask_idem relies on. Exits with status 1 on any error (a missing
    or outdated schema, no partition for today, an isolation the claims refuse).
    """
    state = AppState.current()
    findings = check.run(
        state.store,
        partitions_ahead=state.settings.partitions_ahead,
        migrate=current_app.extensions.get("migrate"),
    )
    failed = any(finding.status is check.Status.ERROR for finding in findings)
    if as_json:
        listed = [
            {"check": f.check, "status": f.status.value, "detail": f.detail} for f in findings
        ]
        print_json({"ok": not failed, "checks": listed})
    else:
        for finding in findings:
            click.echo(f"{finding.status.value:<8}{finding.check}: {finding.detail}")
    if failed:
        click.get_current_context().exit(1)


def _maintenance_text(
    report: MaintenanceReport, *, partitioned: bool, audited: bool = False, archiving: bool = False
) -> str:
    verb = (
        ("would create", "would drop", "would purge", "would archive")
        if report.dry_run
        else ("created", "dropped", "purged", "archived")
    )
    lines = []
    if partitioned:
        done_to_partitions = [(verb[0], report.created, "")]
        if archiving:
            done_to_partitions += [
                (verb[3], report.archived, ""),
                (verb[1], report.archive_dropped, " from the archive"),
            ]
        else:
            done_to_partitions.append((verb[1], report.dropped, ""))
        for done, names, where in done_to_partitions:
            listed = f": {', '.join(names)}" if names else ""
            lines.append(f"{done} {plural(len(names), 'partition')}{where}{listed}")
    lines.append(f"{verb[2]} {plural(report.purged, 'expired row')}")
    if audited:
        if partitioned:
            for done, names in zip(
                verb[:2], (report.audit_created, report.audit_dropped), strict=True
            ):
                listed = f": {', '.join(names)}" if names else ""
                lines.append(f"audit: {done} {plural(len(names), 'partition')}{listed}")
        lines.append(f"audit: {verb[2]} {plural(report.audit_purged, 'row')} past the retention")
    return "\n".join(lines)


@idem_group.command("citus")
@click.option(
    "--colocate-with",
    metavar="TABLE",
    help="An application table distributed by the same tenant value, to share its workers.",
)
@click.option("--dry-run", is_flag=True, help="Only print the SQL that would run.")
@json_option
@store_errors
def citus_command(colocate_with: str | None, dry_run: bool, as_json: bool) -> None:
    """Distribute the store over Citus, by tenant (see docs/citus.md).

    Distributes idempotency_keys by tenant and the claim function by its tenant argument, so
    that each claim runs on the worker holding the tenant's shard. Runs only what is missing:
    safe to repeat. Refused, changing nothing, when the database has no citus extension.
    """
    engine = AppState.current().store.engine
    try:
        steps = citus.distribute(engine, colocate_with=colocate_with, dry_run=dry_run)
        note = None
    except citus.CitusMissing as exc:
        if not dry_run:
            raise
        # Show the whole plan, for review before Citus is there; running it is refused.
        steps, note = citus.full_plan(colocate_with), str(exc)
    if as_json:
        print_json(
            {
                "dry_run": dry_run,
                "steps": [{"reason": s.reason, "sql": s.rendered()} for s in steps],
                **({"note": note} if note else {}),
            }
        )
        return
    if note:
        click.echo(f"-- {note}: the full plan follows", err=True)
    if not steps:
        click.echo(f"{citus.TABLE} is distributed by {citus.DISTRIBUTION_COLUMN}: nothing to do")
    for step in steps:
        click.echo(f"-- {step.reason}\n{step.rendered()}" if dry_run else f"done: {step.reason}")


@idem_group.command("metrics")
@store_errors
def metrics_command() -> None:
    """Print the table's gauges in Prometheus text format (for a textfile collector).

    Records in progress, past their lease, unknown and reopened, the age of the oldest one in
    progress, and the partitions ready ahead: read from the table, so the same for every
    process. Needs the metrics extra (prometheus_client).
    """
    import prometheus_client

    from ..metrics import TableCollector

    registry = prometheus_client.CollectorRegistry(auto_describe=False)
    registry.register(
        TableCollector(operator_store(AppState.current().store, "flask idem metrics"))
    )
    click.echo(prometheus_client.generate_latest(registry).decode(), nl=False)
