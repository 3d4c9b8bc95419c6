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

The text below is the whole function (revision 0006's atomic claim, renamed, with its insert
made a reservation); the downgrade drops it.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-01
"""

from __future__ import annotations

from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

SIGNATURE = (
    "idempotency_claim_reserve(text, text, text, bytea, text, double precision, double precision)"
)

#: The atomic claim that reserves its record: the record it would have inserted is returned,
#: not written (the store inserts it completed), and the transaction is marked as the one
#: holding it.
RESERVE_FUNCTION = r"""
CREATE OR REPLACE FUNCTION idempotency_claim_reserve(
    p_tenant text, p_endpoint text, p_key text, p_fingerprint bytea, p_token text,
    p_ttl double precision, p_lease double precision
) RETURNS TABLE (
    claimed boolean, fingerprint bytea, state text, claim_token text,
    lease_expires_at timestamptz, response_status integer, response_headers jsonb,
    response_body bytea, created_at timestamptz, completed_at timestamptz,
    expires_at timestamptz, db_now timestamptz
) LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    v_now timestamptz;
BEGIN
    -- Every claim of one scope queues here, whichever partition holds its record.
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        RAISE EXCEPTION 'an idempotency claim needs READ COMMITTED, not %',
            current_setting('transaction_isolation');
    END IF;
    -- Held until the business transaction ends: a duplicate gets no row, never a wait.
    IF NOT pg_try_advisory_xact_lock(
        hashtext('flask_idem'),
        hashtext(p_tenant || E'\x1f' || p_endpoint || E'\x1f' || p_key)) THEN
        RETURN;
    END IF;
    -- Read the clock after the lock: a waiter never dates its row before the winner's.
    v_now := clock_timestamp();
    -- A record is live until its TTL ends, and, while in progress, as long as its owner holds
    -- the lease: a request still running past the TTL must never let a retry run again.
    RETURN QUERY
        SELECT false, k.fingerprint, k.state::text, k.claim_token::text, k.lease_expires_at,
               k.response_status, k.response_headers, k.response_body, k.created_at,
               k.completed_at, k.expires_at, v_now
          FROM idempotency_keys AS k
         WHERE k.tenant = p_tenant AND k.endpoint = p_endpoint AND k.key = p_key
           AND (k.expires_at > v_now
                OR coalesce(k.completed_at, k.lease_expires_at, k.created_at)
                   + (k.expires_at - k.created_at) > v_now)
           -- No record of this scope was made a day or more after this clock (0006).
           AND k.created_at < v_now + interval '1 day'
         ORDER BY k.created_at DESC
         LIMIT 1;
    IF FOUND THEN
        RETURN;
    END IF;
    -- A setting local to this transaction (it ends with it, as the lock does): the
    -- completion inserts the record only while it still reads this claim's token, so never
    -- after the view ended the transaction itself (a rollback releases the lock, and a
    -- duplicate may then have run).
    PERFORM set_config('flask_idem.reserved', p_token, true);
    RETURN QUERY
        -- Reserved, not written: the store inserts it completed before the commit.
        SELECT true, p_fingerprint, 'in_progress'::text, p_token, v_now + make_interval(
                   secs => p_lease), NULL::integer, NULL::jsonb, NULL::bytea, v_now,
               NULL::timestamptz, v_now + make_interval(secs => p_ttl), v_now;
END
$$;
"""


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(RESERVE_FUNCTION)


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(f"DROP FUNCTION IF EXISTS {SIGNATURE}")
