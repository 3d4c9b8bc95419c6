"""What every ``flask idem`` command group shares: the group, ``--json``, store errors as exit
codes, reading a key, terminal formatting."""

from __future__ import annotations

import functools
import json
import re
import sys
import typing as t

import click
from flask.cli import AppGroup

from ...core.errors import IdempotencyError
from ...core.idempotency_keys import InvalidKey, normalize
from ...core.record import Record, State
from ...store.messages import database_message
from ..migrate import db_group

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


def store_errors(command: t.Callable[P, None]) -> t.Callable[P, None]:
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


#: How an operator names a record's namespace (docs/keys.md, "Key scopes").
ENDPOINT_SPELLING = (
    'as records spell it: "POST /v1/payments", "*" for an account-wide key, '
    '"principal=<id> POST /v1/payments" for a principal\'s.'
)


def key_lookup(command: t.Callable[P, None]) -> t.Callable[P, None]:
    """[KEY_HASH], --tenant and an optional --endpoint: one key's records (``show``,
    ``history``)."""
    for decorate in (
        click.option("--endpoint", help=f"Only this endpoint, {ENDPOINT_SPELLING}"),
        click.option("--tenant", required=True, help="The tenant the key belongs to."),
        key_hash_argument,
    ):
        command = decorate(command)
    return command


def not_found(hashed: str | None, where: str) -> click.ClickException:
    """Nothing found; a KEY_HASH argument may have been a key of 16 hex digits itself."""
    if hashed is None:
        return click.ClickException(f"no live record of this key {where}")
    return click.ClickException(
        f"no record with key hash {hashed} {where}. If {hashed} is the key itself, not its "
        "hash, pipe it in instead: printf '%s\\n' KEY | flask idem ..."
    )


def read_key() -> str:
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


def print_json(data: t.Any) -> None:
    """``--json`` output: indented, for people and ``jq`` alike."""
    click.echo(json.dumps(data, indent=2))


#: How each command reads the key, for the help texts.
KEY_HELP = (
    "The key is read from standard input (a hidden prompt on a terminal): never on the "
    "command line, where ps and shell history show it. Or name the record by its KEY_HASH."
)


def plural(count: int, noun: str) -> str:
    """``1 record``, ``2 records``."""
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


def age_of(record: Record) -> str:
    """How long ago the record was claimed, by the database clock it was read with."""
    return _duration((record.now - record.created_at).total_seconds())


def lease_of(record: Record) -> str:
    """How long ago an in-progress record's lease ran out; ``-`` for any other record."""
    # Unknown and reopened records keep the time their lease ended, for their TTL only.
    if record.lease_expires_at is None or record.state is not State.IN_PROGRESS:
        return "-"
    return f"expired {_duration((record.now - record.lease_expires_at).total_seconds())} ago"


def format_table(header: list[str], rows: list[list[str]]) -> str:
    """Columns padded to their widest cell, two spaces apart."""
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in [header, *rows]
    )


def format_pairs(dumped: dict[str, t.Any]) -> str:
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
