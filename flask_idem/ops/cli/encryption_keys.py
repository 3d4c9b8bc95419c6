"""``flask idem keys ...``: which live records need which encryption key (rotation)."""

from __future__ import annotations

import typing as t

import click
from flask.cli import AppGroup

from ...core.record import KeyUsage
from ...core.sealing import KEY_ID_PATTERN, KEY_ID_SIZE, generate_key
from ...state import AppState
from ...store import operator_store
from .common import (
    format_table,
    idem_group,
    json_option,
    plural,
    print_json,
    store_errors,
)

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
@store_errors
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
        print_json({"keys": rows, "missing": len(missing)})
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
        click.echo(format_table(header, table))
        if missing:
            click.echo(
                f"{plural(sum(row['live_records'] for row in missing), 'live record')} "
                "cannot be replayed: put the missing keys back into IDEMPOTENCY_ENCRYPTION_KEYS",
                err=True,
            )
    if missing:
        click.get_current_context().exit(1)


@keys_group.command("can-retire")
@click.argument("key_id")
@json_option
@store_errors
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
        print_json(
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
            f"{key_id!r} is still needed: {plural(live, 'live stored response')} use it; "
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
