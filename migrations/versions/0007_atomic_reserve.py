"""The atomic claim reserves its record instead of inserting it: one row write per new key.

``idempotency_claim_reserve(...)`` is ``idempotency_claim_atomic(...)`` (revisions 0004 and
0006: READ COMMITTED, the try-lock, the bounded lookup) without the insert: when no live record
holds the scope it returns the record it would have inserted (``claimed`` true, nothing
written), and the store inserts that record, completed, with the stored response, just before
the business transaction commits. An atomic request then writes its record once (an ``INSERT``)
instead of twice (an ``INSERT`` in progress, then an ``UPDATE`` that plans against the
partitioned table and leaves a dead row version behind).

Nothing else changes, because nobody else could ever see the in-progress row: it was
uncommitted until the business transaction's commit, which is also when the completed row
becomes visible now. What excludes a concurrent duplicate is the scope's advisory lock, held
until that commit in both versions, and the reserved ``created_at`` is still the clock read
after taking the lock, so the horizon of revision 0006 holds as it is: the row commits before
the lock is released.

One thing the in-progress row used to catch has to be caught explicitly: a view that ends the
business transaction itself (``idem.connection().rollback()``) also
releases the lock, and a duplicate may run meanwhile. The in-progress row went with that
transaction, so the completion's ``UPDATE`` found nothing and the request lost its claim. Here
the function marks the transaction with a setting local to it (``flask_idem.reserved``, the
claim token), and the completion inserts the record only while the setting still holds the
token: in any later transaction it inserts nothing, and the request loses its claim as before.

``idempotency_claim_atomic`` stays: a worker still running the previous release during a
rolling deploy keeps claiming, and completing with its ``UPDATE``, as before.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-01
"""

from __future__ import annotations

from alembic import context, op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

SIGNATURE = (
    "idempotency_claim_reserve(text, text, text, bytea, text, double precision, double precision)"
)

#: Where the atomic claim's insert starts and ends (revision 0001's text, found, not copied).
INSERT_START = "    RETURN QUERY\n        WITH inserted AS ("
INSERT_END = "FROM inserted AS i;"
#: The same record, returned and not written (the store inserts it completed), and the
#: transaction marked as the one holding it.
RESERVE = """    -- A setting local to this transaction (it ends with it, as the lock does): the
    -- completion inserts the record only while it still reads this claim's token, so never
    -- after the view ended the transaction itself (a rollback releases the lock, and a
    -- duplicate may then have run).
    PERFORM set_config('flask_idem.reserved', p_token, true);
    RETURN QUERY
        -- Reserved, not written: the store inserts it completed before the commit.
        SELECT true, p_fingerprint, 'in_progress'::text, p_token, v_now + make_interval(
                   secs => p_lease), NULL::integer, NULL::jsonb, NULL::bytea, v_now,
               NULL::timestamptz, v_now + make_interval(secs => p_ttl), v_now;"""


def reserve_function() -> str:
    """The atomic claim of revision 0006, renamed, with its insert made a reservation."""
    atomic = context.script.get_revision("0006").module.claim_functions(bounded=True)[1]
    if atomic.count(INSERT_START) != 1 or atomic.count(INSERT_END) != 1:
        raise RuntimeError("revision 0006's atomic claim is not the one this revision expects")
    start = atomic.index(INSERT_START)
    end = atomic.index(INSERT_END, start) + len(INSERT_END)
    reserving = atomic[:start] + RESERVE + atomic[end:]
    return reserving.replace(
        "FUNCTION idempotency_claim_atomic(", "FUNCTION idempotency_claim_reserve(", 1
    )


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(reserve_function())


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(f"DROP FUNCTION IF EXISTS {SIGNATURE}")
