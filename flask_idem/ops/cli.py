"""``flask idem ...``: partition upkeep, stuck requests, inspection, release, reconciliation, the
next-day audit against downstream services, distribution over Citus and encryption keys.

Every command prints for a terminal by default and JSON with ``--json`` (for scripts and
alerting), and exits non-zero when the store fails. Raw keys are printed only with
``--show-keys`` (elsewhere a record is named by its key hash, the ``key_hash`` of the logs and
signals) and never read from the command line (standard input, or the key hash); stored bodies
only with ``IDEMPOTENCY_INSPECT_BODIES``.
"""

from __future__ import annotations

import datetime as dt
import functools
import json
import re
import sys
import typing as t

import click
from flask import current_app
from flask.cli import AppGroup

from ..core import signals
from ..core.errors import IdempotencyError
from ..core.idempotency_keys import InvalidKey, key_hash, normalize
from ..core.record import KeyUsage, MaintenanceReport, Record, Scope, State
from ..core.sealing import KEY_ID_PATTERN, KEY_ID_SIZE, generate_key
from ..core.serialization import record_schema
from ..events import emit
from ..state import AppState
from ..store import citus, operator_store, trail
from ..store.messages import database_message
from ..store.trail import AuditEntry
from . import check
from .downstream import AuditReport, Discrepancy, DownstreamRecord, Finding, audit
from .migrate import db_group
from .reconcile import Action, Settlement, reconcile

P = t.ParamSpec("P")

#: Reconciliations of more records than this show a progress bar (on stderr).
PROGRESS_AFTER = 20
#: A key hash as logs, signals and these commands print it (``idempotency_keys.key_hash``).
KEY_HASH = re.compile(r"[0-9a-f]{16}")

idem_group = AppGroup(
    "idem", help="Operate flask_idem: partitions, stuck requests, inspection, reconciliation."
)
idem_group.add_command(db_group)

json_option = click.option(
    "--json", "as_json", is_flag=True, help="Print JSON for scripts instead of text."
)


def _store_errors(command: t.Callable[P, None]) -> t.Callable[P, None]:
    """Turn store and configuration failures into a one-line error and exit status 1."""

    @functools.wraps(command)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> None:
        try:
            command(*args, **kwargs)
        except IdempotencyError as exc:
            reason = database_message(exc)
            shown = str(exc) if not reason or reason in str(exc) else f"{exc} ({reason})"
            raise click.ClickException(shown) from exc

    return wrapper


def _hash_argument(ctx: click.Context, _param: click.Parameter, value: str | None) -> str | None:
    """KEY_HASH as given, refused when it is not a key hash: a raw key, most likely."""
    if value is None or KEY_HASH.fullmatch(value):
        return value
    raise click.BadParameter(
        "not a key hash (16 hex digits, as logs and `flask idem stuck` print it). Never put a "
        "raw key on the command line: every user sees it in `ps`, and shell history keeps it. "
        "Leave KEY_HASH out and type the key at the hidden prompt, or pipe it in: "
        f"printf '%s\\n' \"$KEY\" | {ctx.command_path} --tenant ...",
        param_hint="KEY_HASH",
    )


#: The argument naming a record by key hash; without it the key is read from standard input.
key_hash_argument = click.argument(
    "hashed", required=False, metavar="[KEY_HASH]", callback=_hash_argument
)


def _key_lookup(command: t.Callable[P, None]) -> t.Callable[P, None]:
    """[KEY_HASH], --tenant and an optional --endpoint: one key's records (``show``,
    ``history``)."""
    for decorate in (
        click.option(
            "--endpoint", help='Only this endpoint, as records spell it: "POST /v1/payments".'
        ),
        click.option("--tenant", required=True, help="The tenant the key belongs to."),
        key_hash_argument,
    ):
        command = decorate(command)
    return command


def _not_found(hashed: str | None, where: str) -> click.ClickException:
    """Nothing found; a KEY_HASH argument may have been a key of 16 hex digits itself."""
    if hashed is None:
        return click.ClickException(f"no live record of this key {where}")
    return click.ClickException(
        f"no record with key hash {hashed} {where}. If {hashed} is the key itself, not its "
        "hash, pipe it in instead: printf '%s\\n' KEY | flask idem ..."
    )


def _read_key() -> str:
    """The raw key, from standard input: a hidden prompt on a terminal, else its first line.

    :raises click.UsageError: there is no key there, or it is not a valid key.
    """
    if sys.stdin.isatty():
        value = click.prompt("Idempotency key", hide_input=True, err=True)
    else:
        value = sys.stdin.readline()
        if not value:
            raise click.UsageError(
                "no key on standard input: pipe it in, type it at the prompt of a terminal, "
                "or give its KEY_HASH"
            )
    try:
        return normalize(value.rstrip("\r\n"))
    except InvalidKey as exc:
        raise click.UsageError(f"the key on standard input: {exc}") from None


def _print_json(data: t.Any) -> None:
    click.echo(json.dumps(data, indent=2))


@idem_group.command()
@click.option(
    "--ahead",
    type=click.IntRange(min=0),
    default=None,
    help="Partitions to keep ready after the current one [default: IDEMPOTENCY_PARTITIONS_AHEAD].",
)
@click.option("--dry-run", is_flag=True, help="Only print what would be done.")
@json_option
@_store_errors
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
        _print_json({"dialect": store.dialect, **dumped})
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
        _print_json({"ok": not failed, "checks": listed})
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
            lines.append(f"{done} {_plural(len(names), 'partition')}{where}{listed}")
    lines.append(f"{verb[2]} {_plural(report.purged, 'expired row')}")
    if audited:
        if partitioned:
            for done, names in zip(
                verb[:2], (report.audit_created, report.audit_dropped), strict=True
            ):
                listed = f": {', '.join(names)}" if names else ""
                lines.append(f"audit: {done} {_plural(len(names), 'partition')}{listed}")
        lines.append(f"audit: {verb[2]} {_plural(report.audit_purged, 'row')} past the retention")
    return "\n".join(lines)


@idem_group.command("citus")
@click.option(
    "--colocate-with",
    metavar="TABLE",
    help="An application table distributed by the same tenant value, to share its workers.",
)
@click.option("--dry-run", is_flag=True, help="Only print the SQL that would run.")
@json_option
@_store_errors
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
        _print_json(
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


@idem_group.command()
@click.option("--show-keys", is_flag=True, help="Print raw keys instead of key hashes.")
@click.option(
    "--limit", type=click.IntRange(min=1), default=100, show_default=True, help="Records to list."
)
@json_option
@_store_errors
def stuck(show_keys: bool, limit: int, as_json: bool) -> None:
    """List stuck requests (lease expired, outcome unknown, or reopened and not retried).

    Oldest first, across tenants. Retries of these keys get 409 outcome-pending until they
    are reconciled (flask idem reconcile) or released, except on views with
    recovery="reexecute", where a retry takes an expired lease over.
    """
    records = operator_store(AppState.current().store, "flask idem stuck").stuck(limit=limit)
    if as_json:
        _print_json(record_schema(bodies=False, keys=show_keys, many=True).dump(records))
        return
    if not records:
        click.echo("no stuck records")
        return
    header = ["AGE", "STATE", "LEASE", "TENANT", "ENDPOINT", "KEY" if show_keys else "KEY HASH"]
    rows = [
        [
            _age(record),
            record.state.value,
            _lease(record),
            record.scope.tenant,
            record.scope.endpoint,
            record.scope.key if show_keys else key_hash(record.scope),
        ]
        for record in records
    ]
    click.echo(_table(header, rows))
    unknown = sum(record.state is State.UNKNOWN for record in records)
    reopened = sum(record.state is State.REOPENED for record in records)
    summary = (
        f"{_plural(len(records), 'stuck record')}: {len(records) - unknown - reopened} in "
        f"progress past the lease, {unknown} unknown"
    )
    if reopened:
        summary += f", {reopened} reopened (waiting for the client's retry)"
    if len(records) == limit:
        summary += f" (the oldest {limit}; there may be more)"
    click.echo(summary)


#: How each command reads the key, for the help texts.
_KEY_HELP = (
    "The key is read from standard input (a hidden prompt on a terminal): never on the "
    "command line, where ps and shell history show it. Or name the record by its KEY_HASH."
)


@idem_group.command(epilog=_KEY_HELP)
@_key_lookup
@json_option
@_store_errors
def show(hashed: str | None, tenant: str, endpoint: str | None, as_json: bool) -> None:
    """Show the records of a key (state, times, stored status).

    One record per endpoint the tenant used the key on (KEY_HASH: its one endpoint), with its
    key hash, fingerprint and lease. Stored bodies and headers only with
    IDEMPOTENCY_INSPECT_BODIES.
    """
    state = AppState.current()
    store = operator_store(state.store, "flask idem show")
    if hashed is None:
        records = store.find(tenant, _read_key(), endpoint)
    else:
        records = store.find_hashed(tenant, hashed, endpoint)
    schema = record_schema(bodies=state.settings.inspect_bodies, keys=False, many=True)
    if as_json:
        _print_json(schema.dump(records))
    elif records:
        click.echo("\n\n".join(_pairs(dumped) for dumped in schema.dump(records)))
    if not records:
        raise _not_found(hashed, "for this tenant")


@idem_group.command(epilog=_KEY_HELP)
@_key_lookup
@json_option
@_store_errors
def history(hashed: str | None, tenant: str, endpoint: str | None, as_json: bool) -> None:
    """Print the audit trail of a key: every transition of its records, oldest first.

    On every endpoint the tenant used the key on (KEY_HASH: its one endpoint). Needs
    IDEMPOTENCY_AUDIT (rows are written only while it is on). Covers expired records too, for
    as long as IDEMPOTENCY_AUDIT_RETENTION keeps their rows. Exit 1 if none.
    """
    store = operator_store(AppState.current().store, "flask idem history")
    if hashed is None:
        entries = store.history(tenant, _read_key(), endpoint)
    else:
        entries = store.history_hashed(tenant, hashed, endpoint)
    if as_json:
        _print_json([entry.as_json() for entry in entries])
    elif entries:
        click.echo(_table(_HISTORY_HEADER, [_history_row(entry) for entry in entries]))
    if not entries:
        note = "" if store.audit else " (IDEMPOTENCY_AUDIT is off)"
        raise click.ClickException(f"no audit rows of this key for this tenant{note}")


_HISTORY_HEADER = ["WHEN", "ENDPOINT", "EVENT", "STATE", "STATUS", "BY", "RECORD", "DETAIL"]


def _history_row(entry: AuditEntry) -> list[str]:
    created = entry.record_created_at
    return [
        entry.occurred_at.isoformat(timespec="milliseconds"),
        entry.endpoint,
        entry.event,
        entry.state or "-",
        "-" if entry.status is None else str(entry.status),
        entry.actor,
        "-" if created is None else created.isoformat(timespec="milliseconds"),
        entry.detail or "",
    ]


@idem_group.command("metrics")
@_store_errors
def metrics_command() -> None:
    """Print the table's gauges in Prometheus text format (for a textfile collector).

    Records in progress, past their lease, unknown and reopened, the age of the oldest one in
    progress, and the partitions ready ahead: read from the table, so the same for every
    process. Needs the metrics extra (prometheus_client).
    """
    import prometheus_client

    from .metrics import TableCollector

    registry = prometheus_client.CollectorRegistry(auto_describe=False)
    registry.register(
        TableCollector(operator_store(AppState.current().store, "flask idem metrics"))
    )
    click.echo(prometheus_client.generate_latest(registry).decode(), nl=False)


@idem_group.command(epilog=_KEY_HELP)
@key_hash_argument
@click.option("--tenant", required=True, help="The tenant the key belongs to.")
@click.option("--endpoint", required=True, help='As records spell it: "POST /v1/payments".')
@click.option(
    "--not-happened",
    is_flag=True,
    help="You checked that the operation did not take place: recorded in the audit trail. "
    "The record is reopened all the same (same downstream keys), never forgotten: its owner "
    "may be frozen rather than dead, and would charge under the keys a new record replaces.",
)
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
@json_option
@_store_errors
def release(
    hashed: str | None, tenant: str, endpoint: str, not_happened: bool, yes: bool, as_json: bool
) -> None:
    """Let a retry of a key run its operation again.

    A stuck record (unknown, or in progress past its lease) is reopened: the next retry runs
    the view again as the same operation, with the same downstream keys, so a provider that
    deduplicates on them charges once, even if the first attempt's worker was only frozen and
    resumes. Completed, running and already reopened records are refused. Prefer flask idem
    reconcile, which asks the endpoint's reconciler. With the key piped in and no --yes, the
    confirmation is read from the next line.
    """
    store = operator_store(AppState.current().store, "flask idem release")
    if hashed is None:
        record = store.get(Scope(tenant, endpoint, _read_key()))
    else:
        found = store.find_hashed(tenant, hashed, endpoint)
        record = found[-1] if found else None  # the newest, as get() returns it
    if record is None:
        raise _not_found(hashed, "for this tenant and endpoint")
    scope = record.scope
    if not (record.state is State.UNKNOWN or record.lease_expired):
        raise click.ClickException(_refusal(record))
    if not yes:
        click.echo(
            f"{endpoint} for {tenant}, key hash {key_hash(scope)}: {record.state.value}, "
            f"{_age(record)} old. The next retry runs it again as the same operation (same "
            "downstream keys).",
            err=True,
        )
        click.confirm("Release this key?", abort=True, err=True)
    # Fenced: a retry that took the operation over since the record was read (and may be
    # charging right now) is never reopened under it.
    reason = "flask idem release --not-happened" if not_happened else "flask idem release"
    with trail.acting("operator", reason):
        done = store.reopen(scope, token=record.claim_token)
    if not done:
        raise click.ClickException(
            "the record changed meanwhile (a retry took it over?); look again"
        )
    emit(
        signals.settled,
        scope,
        fingerprint=record.fingerprint,
        actor="operator",
        action="reopened",
        state=State.REOPENED.value,
    )
    if as_json:
        released = record_schema(bodies=False, keys=False).dump(record)
        _print_json({"released": True, "action": "reopened", "record": released})
    else:
        click.echo(f"reopened {endpoint} for {tenant}, key hash {key_hash(scope)}")


def _refusal(record: Record) -> str:
    """Why a record that is not stuck is never released."""
    if record.state is State.IN_PROGRESS:
        return "Its request is still running (its lease is held): wait for it."
    if record.state is State.REOPENED:
        return "It is already reopened: the next retry runs it."
    return (
        f"Its operation is {record.state.value}: it happened, and releasing it would run it "
        "a second time."
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
@_store_errors
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
        _print_json(
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
@_store_errors
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
    report = audit(start, start + dt.timedelta(days=1), margin=margin)
    if as_json:
        _print_json(_audit_json(report))
    else:
        click.echo(_audit_text(report))
    if report.discrepancies:
        click.get_current_context().exit(1)


def _audit_json(report: AuditReport) -> dict[str, t.Any]:
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
        **{finding.value: report.count(finding) for finding in Finding},
        "discrepancies": [discrepancy(found) for found in report.discrepancies],
    }


_FINDING_TEXT = {
    Finding.UNMATCHED: "no record derives its downstream key (made behind the extension)",
    Finding.DUPLICATE: "one record, more than one downstream operation",
    Finding.UNKNOWN: "the record is unknown but the service shows it done: reconcile it",
}


def _audit_text(report: AuditReport) -> str:
    summary = (
        f"audited {report.start:%Y-%m-%d}: {_plural(report.records, 'record')}, "
        f"{_plural(report.operations, 'downstream operation')}; "
        f"{report.count(Finding.UNMATCHED)} unmatched, "
        f"{report.count(Finding.DUPLICATE)} duplicate, "
        f"{report.count(Finding.UNKNOWN)} unknown but done"
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
    table = _table(["FINDING", "OPERATIONS", "TENANT", "ENDPOINT", "KEY HASH", "WHAT"], rows)
    return f"{summary}\n\n{table}"


def _settlement_json(settlement: Settlement) -> dict[str, t.Any]:
    dumped = record_schema(bodies=False, keys=False).dump(settlement.record)
    return {**dumped, "action": settlement.action.value, "reason": settlement.reason}


def _reconcile_text(settlements: list[Settlement], counts: dict[Action, int]) -> str:
    summary = (
        f"reconciled {_plural(len(settlements), 'stuck record')}: "
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
            _age(s.record),
            s.record.scope.tenant,
            s.record.scope.endpoint,
            key_hash(s.record.scope),
            s.reason,
        ]
        for s in unknown
    ]
    table = _table(["AGE", "TENANT", "ENDPOINT", "KEY HASH", "WHY"], rows)
    return f"{summary}\n\nstill unknown:\n{table}"


# -- encryption keys ------------------------------------------------------------------------

keys_group = AppGroup(
    "keys",
    help="Encryption keys of stored responses: which live records need which key (rotation).",
)
idem_group.add_command(keys_group)


def _key_rows(state: AppState) -> list[dict[str, t.Any]]:
    """One row per configured key (in order), per key live records use but the configuration
    lacks, and one for responses stored unencrypted."""
    store = operator_store(state.store, "flask idem keys")
    usage: dict[str | None, KeyUsage] = {u.key_id: u for u in store.key_usage()}
    configured = [key.id for key in state.settings.encryption_keys]

    def row(key_id: str | None, role: str) -> dict[str, t.Any]:
        found = usage.get(key_id)
        last = None if found is None or found.last_expires_at is None else found.last_expires_at
        return {
            "key_id": key_id,
            "role": role,
            "live_records": 0 if found is None else found.rows,
            "last_expires_at": None if last is None else last.isoformat(),
        }

    rows = [
        row(key_id, "encrypts" if i == 0 else "decrypts") for i, key_id in enumerate(configured)
    ]
    rows += [row(key_id, "missing") for key_id in usage if key_id and key_id not in configured]
    if None in usage or not configured:
        rows.append(row(None, "unencrypted"))
    return rows


@keys_group.command("status")
@json_option
@_store_errors
def keys_status(as_json: bool) -> None:
    """List the configured keys and how many live stored responses each one protects.

    A key no live record uses can be retired. Exits with status 1 when live records are
    encrypted with a key that is not configured (their retries answer 503
    stored-response-unreadable until it is put back).
    """
    state = AppState.current()
    rows = _key_rows(state)
    missing = [row for row in rows if row["role"] == "missing"]
    if as_json:
        _print_json({"keys": rows, "missing": len(missing)})
    else:
        header = ["KEY ID", "ROLE", "LIVE RECORDS", "LAST EXPIRES"]
        table = [
            [
                row["key_id"] or "(none)",
                row["role"],
                str(row["live_records"]),
                row["last_expires_at"] or "-",
            ]
            for row in rows
        ]
        click.echo(_table(header, table))
        if missing:
            click.echo(
                f"{_plural(sum(row['live_records'] for row in missing), 'live record')} "
                "cannot be replayed: put the missing keys back into IDEMPOTENCY_ENCRYPTION_KEYS",
                err=True,
            )
    if missing:
        click.get_current_context().exit(1)


@keys_group.command("can-retire")
@click.argument("key_id")
@json_option
@_store_errors
def keys_can_retire(key_id: str, as_json: bool) -> None:
    """Tell whether KEY_ID can be removed from IDEMPOTENCY_ENCRYPTION_KEYS.

    Yes (exit 0) when no live stored response is encrypted with it; no (exit 1) otherwise,
    with when the last of them expires. Run it after every process encrypts with the new key.
    """
    state = AppState.current()
    configured = [key.id for key in state.settings.encryption_keys]
    if configured and configured[0] == key_id:
        raise click.ClickException(
            f"{key_id!r} is the key that encrypts new responses: put the new key first, deploy, "
            "then retire this one once no live record needs it"
        )
    found = next((row for row in _key_rows(state) if row["key_id"] == key_id), None)
    live = 0 if found is None else found["live_records"]
    if as_json:
        _print_json(
            {
                "key_id": key_id,
                "can_retire": live == 0,
                "live_records": live,
                "last_expires_at": None if found is None else found["last_expires_at"],
            }
        )
    elif live == 0:
        click.echo(f"{key_id!r} can be retired: no live stored response uses it")
    else:
        assert found is not None
        click.echo(
            f"{key_id!r} is still needed: {_plural(live, 'live stored response')} use it; "
            f"the last one expires at {found['last_expires_at']}"
        )
    if live:
        click.get_current_context().exit(1)


@keys_group.command("generate")
@click.argument("key_id")
def keys_generate(key_id: str) -> None:
    """Print a new random key as ``KEY_ID:base64``, ready for IDEMPOTENCY_ENCRYPTION_KEYS.

    Nothing is stored or logged: keep it in your secret store.
    """
    if not KEY_ID_PATTERN.fullmatch(key_id):
        raise click.BadParameter(
            f"1 to {KEY_ID_SIZE} characters from A-Z a-z 0-9 . _ -", param_hint="KEY_ID"
        )
    click.echo(f"{key_id}:{generate_key()}")


# -- terminal formatting --------------------------------------------------------------------


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def _duration(seconds: float) -> str:
    """A short human duration: 42s, 12m05s, 3h02m, 2d04h."""
    seconds = int(max(0.0, seconds))
    if seconds >= 86400:
        return f"{seconds // 86400}d{seconds % 86400 // 3600:02d}h"
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    if seconds >= 60:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds}s"


def _age(record: Record) -> str:
    return _duration((record.now - record.created_at).total_seconds())


def _lease(record: Record) -> str:
    # Unknown and reopened records keep the time their lease ended, for their TTL only.
    if record.lease_expires_at is None or record.state is not State.IN_PROGRESS:
        return "-"
    return f"expired {_duration((record.now - record.lease_expires_at).total_seconds())} ago"


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in [header, *rows]
    )


def _pairs(dumped: dict[str, t.Any]) -> str:
    """One record as aligned ``name  value`` lines."""
    width = max(len(name) for name in dumped)

    def text(value: t.Any) -> str:
        if value is None:
            return "-"
        if isinstance(value, bool):
            return "yes" if value else "no"
        if isinstance(value, list):
            return "; ".join(": ".join(map(str, item)) for item in value)
        return str(value)

    return "\n".join(
        f"{name.replace('_', ' ').ljust(width)}  {text(value)}" for name, value in dumped.items()
    )
