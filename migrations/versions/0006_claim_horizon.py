"""The claim's lookup skips partitions no record of the scope can be in: those starting a day
or more after the claim's own clock.

Both claim functions used to probe every partition for a live record of the scope, the
partitions kept ready ahead included (seven of the ten a fresh install has). Their lookup now
reads ``created_at < v_now + interval '1 day'``, which PostgreSQL prunes on when the statement
starts, so a claim probes the partitions of the past, today's, tomorrow's and DEFAULT.

Why no live record is missed (the proof the bound rests on):

1. On PostgreSQL only the two claim functions insert into ``idempotency_keys``, and nothing
   updates ``created_at`` (a takeover keeps the row, so its ``created_at`` too). A record's
   ``created_at`` is the ``v_now`` of the claim that inserted it: ``clock_timestamp()`` read
   *after* that claim took the scope's advisory lock.
2. That lock is a transaction lock: the inserter holds it until its row commits (or rolls back,
   leaving no row). A claim whose lookup can see the row therefore took the same lock after
   the inserter committed, and read its own ``v_now`` after taking it. Two claims of one scope
   never overlap between lock and commit, whatever partition the row is in.
3. So the inserter read the database clock before this claim did: ``created_at <= v_now`` on a
   clock that never runs backwards. The day of slack covers a clock stepped back by up to a day
   (NTP correcting a fast clock, a host booted with its RTC in local time, 14 hours at worst)
   and the skew between Citus nodes after a shard moves. A clock stepped back further than a
   day, while records made before the step are live, is the one case the bound does not cover:
   such rows would not block a claim until the clock caught up. A clock fault of that size
   already defeats any TTL the other way: a step forward by a TTL expires every live record.

Nothing is narrowed in the past: a record stays live for its TTL from its claim and for its TTL
from the end of its request, however long that request ran, so no bound on ``created_at`` from
below holds for every record (``idempotency_drop_expired_partitions`` keeps the past short).

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-01
"""

from __future__ import annotations

from alembic import context, op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

#: The lookup's order, as revision 0001 spells it; it appears once in each claim function.
LOOKUP_ORDER = "         ORDER BY k.created_at DESC\n"
#: The same with the bound before it (see the module docstring for why it misses nothing).
BOUNDED_LOOKUP_ORDER = (
    "           -- No record of this scope was made a day or more after this clock (0006).\n"
    "           AND k.created_at < v_now + interval '1 day'\n" + LOOKUP_ORDER
)


def _replace(source: str) -> str:
    return source.replace("CREATE FUNCTION", "CREATE OR REPLACE FUNCTION", 1)


def claim_functions(*, bounded: bool) -> tuple[str, str]:
    """Both claim functions as revision 0004 made them, with the bound when ``bounded``."""
    atomic = context.script.get_revision("0004").module
    functions = (atomic.checked_claim_function(), _replace(atomic.atomic_claim_function()))
    if not bounded:
        return functions
    if any(function.count(LOOKUP_ORDER) != 1 for function in functions):
        raise RuntimeError("revision 0004's claim functions are not the ones this one expects")
    checked, atomic_claim = (f.replace(LOOKUP_ORDER, BOUNDED_LOOKUP_ORDER) for f in functions)
    return checked, atomic_claim


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        for function in claim_functions(bounded=True):
            op.execute(function)


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        for function in claim_functions(bounded=False):
            op.execute(function)
