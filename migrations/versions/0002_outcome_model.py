"""The outcome model: a TTL counted from the end of a request, and the ``reopened`` state.

A record used to count until ``expires_at`` (claim + TTL) or while its lease was held, so a
request that ran past its TTL completed into a dead record and the next retry ran it again.
From this revision a record is live for its TTL from its claim *and* for its TTL from the end
of its request: ``coalesce(completed_at, lease_expires_at, created_at) + (expires_at -
created_at) > now``. The claim function and the partition drop use that predicate, as do the
stores' own statements.

``reopened`` is what an operator's release of a possibly-executed operation leaves: the next
retry runs it again as the same operation (same row, so the same downstream keys).

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-01
"""

from __future__ import annotations

import importlib.util
import pathlib
import re
import types

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

TABLE = "idempotency_keys"
CHECK = "ck_idempotency_keys_state"
OLD_STATES = ("in_progress", "completed", "unknown", "unstored")
NEW_STATES = (*OLD_STATES, "reopened")

# Revision 0001's liveness tests, as its functions spell them, and their replacements.
OLD_CLAIM_LIVE = (
    "(k.expires_at > v_now\n"
    "                OR (k.state = 'in_progress' AND k.lease_expires_at > v_now))"
)
NEW_CLAIM_LIVE = (
    "(k.expires_at > v_now\n"
    "                OR coalesce(k.completed_at, k.lease_expires_at, k.created_at)\n"
    "                   + (k.expires_at - k.created_at) > v_now)"
)
OLD_DROP_LIVE = (
    "'SELECT EXISTS (SELECT 1 FROM %I WHERE expires_at > now() '\n"
    "        'OR (state = ''in_progress'' AND lease_expires_at > now()))'"
)
NEW_DROP_LIVE = (
    "'SELECT EXISTS (SELECT 1 FROM %I WHERE expires_at > now() '\n"
    "        'OR coalesce(completed_at, lease_expires_at, created_at) '\n"
    "        '+ (expires_at - created_at) > now())'"
)


def _first_revision() -> types.ModuleType:
    """Revision 0001, for the SQL functions this revision rewrites (one source, no copy)."""
    path = pathlib.Path(__file__).with_name("0001_idempotency_keys.py")
    spec = importlib.util.spec_from_file_location("flask_idem_revision_0001", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _replace(source: str, old: str, new: str) -> str:
    if old not in source:
        raise RuntimeError("revision 0001's SQL function is not the one this revision expects")
    return source.replace("CREATE FUNCTION", "CREATE OR REPLACE FUNCTION", 1).replace(old, new)


def _granularity() -> str:
    """The partition unit revision 0001 fixed in the drop function (day, week or month)."""
    definition = op.get_bind().scalar(
        sa.text("SELECT pg_get_functiondef(CAST(:function AS regprocedure))"),
        {"function": "idempotency_drop_expired_partitions(boolean)"},
    )
    found = re.search(r"interval '1 (day|week|month)'", str(definition))
    if found is None:
        raise RuntimeError("cannot tell the partition granularity of idempotency_keys")
    return found.group(1)


def _functions(claim_live: tuple[str, str], drop_live: tuple[str, str]) -> None:
    first = _first_revision()
    op.execute(_replace(first.CLAIM_FUNCTION, *claim_live))
    drop = first.DROP_PARTITIONS_FUNCTION.replace("{unit}", _granularity())
    op.execute(_replace(drop, *drop_live))


def _check(states: tuple[str, ...]) -> str:
    return "state IN (" + ", ".join(f"'{state}'" for state in states) + ")"


def _set_states(states: tuple[str, ...]) -> None:
    if op.get_bind().dialect.name != "postgresql":
        # SQLite cannot alter a constraint: batch mode copies the table.
        with op.batch_alter_table(TABLE, recreate="always") as batch:
            batch.drop_constraint(op.f(CHECK), type_="check")
            batch.create_check_constraint(op.f(CHECK), _check(states))
        return
    # Partitions made with LIKE ... INCLUDING CONSTRAINTS hold a local copy of the check,
    # which dropping the parent's would leave behind: drop every copy, then add it once on the
    # parent (PostgreSQL adds it to each partition).
    partitions = op.get_bind().scalars(
        sa.text(
            "SELECT c.relname FROM pg_inherits AS i JOIN pg_class AS c ON c.oid = i.inhrelid "
            "WHERE i.inhparent = CAST(:table AS regclass)"
        ),
        {"table": TABLE},
    )
    op.execute(f"ALTER TABLE {TABLE} DROP CONSTRAINT {CHECK}")
    for name in partitions:
        op.execute(f'ALTER TABLE "{name}" DROP CONSTRAINT IF EXISTS {CHECK}')
    op.execute(f"ALTER TABLE {TABLE} ADD CONSTRAINT {CHECK} CHECK ({_check(states)})")


def upgrade() -> None:
    _set_states(NEW_STATES)
    if op.get_bind().dialect.name == "postgresql":
        _functions((OLD_CLAIM_LIVE, NEW_CLAIM_LIVE), (OLD_DROP_LIVE, NEW_DROP_LIVE))


def downgrade() -> None:
    # Reopened records become unknown ones: the closest state 0001 knows (never re-run).
    op.execute(f"UPDATE {TABLE} SET state = 'unknown' WHERE state = 'reopened'")
    _set_states(OLD_STATES)
    if op.get_bind().dialect.name == "postgresql":
        _functions((OLD_CLAIM_LIVE, OLD_CLAIM_LIVE), (OLD_DROP_LIVE, OLD_DROP_LIVE))
