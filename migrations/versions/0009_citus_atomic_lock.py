"""The atomic claim locks its scope where the tenant's shard lives, on Citus too.

On Citus the atomic claim (``idempotency_claim_reserve``) runs inside the business transaction,
where Citus does not delegate a function call: it runs on the node the application is
connected to, and its advisory lock was taken there. Citus lets workers with synced metadata
serve queries, so an atomic claim through a worker and one through the coordinator took two
locks on two nodes, both found no record and both ran the view.

From this revision, after its try-lock, the claim takes the same lock again by a query on the
tenant's rows (``idempotency_keys_default``, the partition that always exists), which Citus
routes whole to the worker holding the tenant's shard, or runs locally when that is this node:
``pg_try_advisory_xact_lock`` runs there, inside this distributed transaction, and is held
until it ends. The query is a ``DELETE`` that deletes nothing (no row is dated before
``-infinity``) in a CTE: as a write on the shard, it makes a shard move that blocks writes
wait for the claim's transaction (Citus locks a modified shard's metadata until the end of the
transaction), so the move cannot switch the tenant to another worker, where this lock is not,
while the claim is held; with a plain ``SELECT`` a move during an atomic storm through two
nodes ran a key twice. Being a write, it also makes Citus commit the transaction in two
phases, also when the business rows are local on the coordinator. The lookup that follows
and the record's insert touch the same shard group, so Citus sends them over the same
connection: the record becomes visible on that worker before the lock is released, as on one
server. Every atomic claim of a tenant, through any node, therefore meets on one lock.

The branch is taken only where Citus is loaded (the ``citus.version`` setting exists, read
with ``current_setting(..., true)``). On plain PostgreSQL the claim sends the same statement,
in the same round trip, and pays one setting lookup (about 0.2 microseconds). Where Citus is
loaded but the table is not distributed yet, the query runs locally and finds the lock already
held by this transaction, which a try-lock grants again.

The text below is the whole function; the downgrade restores revision 0008's text, copied.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-02
"""

from __future__ import annotations

from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None

#: The atomic claim from this revision on.
RESERVE = """CREATE OR REPLACE FUNCTION idempotency_claim_reserve(
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
    v_locked boolean;
BEGIN
    -- Bounds and a quiet log for this transaction when the session has none
    -- (behind a transaction pooler): local settings, gone with the transaction (0008).
    IF current_setting('lock_timeout') = '0' THEN
        PERFORM set_config('lock_timeout', '4s', true);
    END IF;
    IF current_setting('statement_timeout') = '0' THEN
        PERFORM set_config('statement_timeout', '4s', true);
    END IF;
    IF current_setting('log_min_error_statement') <> 'panic' THEN
        BEGIN
            PERFORM set_config('log_min_error_statement', 'panic', true);
        EXCEPTION WHEN insufficient_privilege THEN
            NULL;  -- no GRANT SET: the store warned at its first connection
        END;
    END IF;
    -- Every claim of one scope queues here, whichever partition holds its record.
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        RAISE EXCEPTION 'an idempotency claim needs READ COMMITTED, not %',
            current_setting('transaction_isolation');
    END IF;
    -- Held until the business transaction ends: a duplicate gets no row, never a wait.
    IF NOT pg_try_advisory_xact_lock(
        hashtext('flask_idem'),
        hashtext(p_tenant || E'\\x1f' || p_endpoint || E'\\x1f' || p_key)) THEN
        RETURN;
    END IF;
    -- On Citus (0009) the node running this function may be any node that accepts queries:
    -- the same lock, held until the same end, is also taken on the worker holding the
    -- tenant's shard, by a query Citus routes there whole, in this distributed transaction
    -- (the lookup and the record's insert then go over that same connection). The query is a
    -- write that deletes nothing (no row is dated before -infinity), so that Citus holds the
    -- shard's metadata lock until the transaction ends: a shard move cannot switch the
    -- tenant to another worker, where this lock is not, while the claim is held.
    IF current_setting('citus.version', true) IS NOT NULL THEN
        WITH pinned AS (
            DELETE FROM idempotency_keys_default AS d
             WHERE d.tenant = p_tenant AND d.endpoint = p_endpoint AND d.key = p_key
               AND d.created_at < '-infinity'
            RETURNING 1)
        SELECT pg_try_advisory_xact_lock(
                   hashtext('flask_idem'),
                   hashtext(p_tenant || E'\\x1f' || p_endpoint || E'\\x1f' || p_key))
          INTO v_locked
          FROM (SELECT count(*) FROM pinned) AS s;
        IF NOT v_locked THEN
            RETURN;
        END IF;
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
$$
"""

#: Revision 0008's atomic claim, restored by the downgrade.
RESERVE_0008 = """CREATE OR REPLACE FUNCTION idempotency_claim_reserve(
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
    -- Bounds and a quiet log for this transaction when the session has none
    -- (behind a transaction pooler): local settings, gone with the transaction (0008).
    IF current_setting('lock_timeout') = '0' THEN
        PERFORM set_config('lock_timeout', '4s', true);
    END IF;
    IF current_setting('statement_timeout') = '0' THEN
        PERFORM set_config('statement_timeout', '4s', true);
    END IF;
    IF current_setting('log_min_error_statement') <> 'panic' THEN
        BEGIN
            PERFORM set_config('log_min_error_statement', 'panic', true);
        EXCEPTION WHEN insufficient_privilege THEN
            NULL;  -- no GRANT SET: the store warned at its first connection
        END;
    END IF;
    -- Every claim of one scope queues here, whichever partition holds its record.
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        RAISE EXCEPTION 'an idempotency claim needs READ COMMITTED, not %',
            current_setting('transaction_isolation');
    END IF;
    -- Held until the business transaction ends: a duplicate gets no row, never a wait.
    IF NOT pg_try_advisory_xact_lock(
        hashtext('flask_idem'),
        hashtext(p_tenant || E'\\x1f' || p_endpoint || E'\\x1f' || p_key)) THEN
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
$$
"""


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(RESERVE)


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(RESERVE_0008)
