"""``flask idem stuck``, ``show``, ``history`` and ``release``: one record, or those stuck."""

from __future__ import annotations

import click

from ...core import signals
from ...core.idempotency_keys import key_hash
from ...core.record import Record, Scope, State
from ...core.serialization import record_schema
from ...events import emit
from ...state import AppState
from ...store import operator_store, trail
from ...store.trail import AuditEntry
from .common import (
    ENDPOINT_SPELLING,
    KEY_HELP,
    age_of,
    format_pairs,
    format_table,
    idem_group,
    json_option,
    key_hash_argument,
    key_lookup,
    lease_of,
    not_found,
    plural,
    print_json,
    read_key,
    store_errors,
)


@idem_group.command()
@click.option(
    "--show-keys",
    is_flag=True,
    help="Print keys as stored (their digests: raw keys are not stored) instead of key hashes.",
)
@click.option(
    "--limit", type=click.IntRange(min=1), default=100, show_default=True, help="Records to list."
)
@json_option
@store_errors
def stuck(show_keys: bool, limit: int, as_json: bool) -> None:
    """List stuck requests (lease expired, outcome unknown, or reopened and not retried).

    Oldest first, across tenants. Retries of these keys get 409 outcome-pending until they
    are reconciled (flask idem reconcile) or released, except on views with
    recovery="reexecute", where a retry takes an expired lease over.
    """
    records = operator_store(AppState.current().store, "flask idem stuck").stuck(limit=limit)
    if as_json:
        print_json(record_schema(bodies=False, keys=show_keys, many=True).dump(records))
        return
    if not records:
        click.echo("no stuck records")
        return
    header = ["AGE", "STATE", "LEASE", "TENANT", "ENDPOINT", "KEY" if show_keys else "KEY HASH"]
    rows = [
        [
            age_of(record),
            record.state.value,
            lease_of(record),
            record.scope.tenant,
            record.scope.endpoint,
            record.scope.key if show_keys else key_hash(record.scope),
        ]
        for record in records
    ]
    click.echo(format_table(header, rows))
    unknown = sum(record.state is State.UNKNOWN for record in records)
    reopened = sum(record.state is State.REOPENED for record in records)
    summary = (
        f"{plural(len(records), 'stuck record')}: {len(records) - unknown - reopened} in "
        f"progress past the lease, {unknown} unknown"
    )
    if reopened:
        summary += f", {reopened} reopened (waiting for the client's retry)"
    if len(records) == limit:
        summary += f" (the oldest {limit}; there may be more)"
    click.echo(summary)


@idem_group.command(epilog=KEY_HELP)
@key_lookup
@json_option
@store_errors
def show(hashed: str | None, tenant: str, endpoint: str | None, as_json: bool) -> None:
    """Show the records of a key (state, times, stored status).

    One record per endpoint the tenant used the key on (KEY_HASH: its one endpoint), with its
    key hash, fingerprint and lease. Stored bodies and headers only with
    IDEMPOTENCY_INSPECT_BODIES.
    """
    state = AppState.current()
    store = operator_store(state.store, "flask idem show")
    if hashed is None:
        records = store.find(tenant, read_key(), endpoint)
    else:
        records = store.find_hashed(tenant, hashed, endpoint)
    schema = record_schema(bodies=state.settings.inspect_bodies, keys=False, many=True)
    if as_json:
        print_json(schema.dump(records))
    elif records:
        click.echo("\n\n".join(format_pairs(dumped) for dumped in schema.dump(records)))
    if not records:
        raise not_found(hashed, "for this tenant")


@idem_group.command(epilog=KEY_HELP)
@key_lookup
@json_option
@store_errors
def history(hashed: str | None, tenant: str, endpoint: str | None, as_json: bool) -> None:
    """Print the audit trail of a key: every transition of its records, oldest first.

    On every endpoint the tenant used the key on (KEY_HASH: its one endpoint). Needs
    IDEMPOTENCY_AUDIT (rows are written only while it is on). Covers expired records too, for
    as long as IDEMPOTENCY_AUDIT_RETENTION keeps their rows. Exit 1 if none.
    """
    store = operator_store(AppState.current().store, "flask idem history")
    if hashed is None:
        entries = store.history(tenant, read_key(), endpoint)
    else:
        entries = store.history_hashed(tenant, hashed, endpoint)
    if as_json:
        print_json([entry.as_json() for entry in entries])
    elif entries:
        click.echo(format_table(_HISTORY_HEADER, [_history_row(entry) for entry in entries]))
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


@idem_group.command(epilog=KEY_HELP)
@key_hash_argument
@click.option("--tenant", required=True, help="The tenant the key belongs to.")
@click.option("--endpoint", required=True, help=f"The endpoint, {ENDPOINT_SPELLING}")
@click.option(
    "--not-happened",
    is_flag=True,
    help="You checked that the operation did not take place: recorded in the audit trail. "
    "The record is reopened all the same (same downstream keys), never forgotten: its owner "
    "may be frozen rather than dead, and would charge under the keys a new record replaces.",
)
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
@json_option
@store_errors
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
        record = store.get(Scope(tenant, endpoint, read_key()))
    else:
        found = store.find_hashed(tenant, hashed, endpoint)
        record = found[-1] if found else None  # the newest, as get() returns it
    if record is None:
        raise not_found(hashed, "for this tenant and endpoint")
    scope = record.scope
    if not (record.state is State.UNKNOWN or record.lease_expired):
        raise click.ClickException(_refusal(record))
    if not yes:
        click.echo(
            f"{endpoint} for {tenant}, key hash {key_hash(scope)}: {record.state.value}, "
            f"{age_of(record)} old. The next retry runs it again as the same operation (same "
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
        print_json({"released": True, "action": "reopened", "record": released})
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
