"""The durable claim takes its lock where the tenant's shard lives, on Citus too.

On Citus the durable claim (``idempotency_claim``) is delegated to the worker that holds the
tenant's shard, by whichever node the application sent it to (the coordinator, or a worker
with synced metadata), and took its advisory lock on the node running it. During a shard move
that blocks writes (``citus_move_shard_placement(..., shard_transfer_mode => 'block_writes')``)
a claim that had locked on the old worker and found no record waited for the block to end
before its insert, which Citus then routed to the new worker; a claim of the same key sent
after the switch was delegated to the new worker, locked there, found no record either and
inserted too: one key, two records in one shard, two winners
(``test_durable_claims_through_every_node_during_shard_moves_claim_each_key_once`` recorded
47 keys of 650 twice on revision 0009).

From this revision, where Citus is loaded (the ``citus.version`` setting exists), the claim
takes its lock by the query revision 0009 gave the atomic claim: a ``DELETE`` of the tenant's
rows in ``idempotency_keys_default`` (the partition that always exists) that deletes nothing
(no row is dated before ``-infinity``), in a CTE, with ``pg_advisory_xact_lock`` (the waiting
lock) in the same statement; its ``RETURNING`` is ``*``, as every ``RETURNING`` of this
function (``tests/store/test_citus.py`` holds the delegated function to stored columns).
Citus routes the query whole to the worker holding the shard, or runs it locally when that
is this node,
and, as for any write, first takes the shard's metadata lock on this node (seen in
``pg_locks``: the metadata lock on the node running the claim, the scope's lock on the
tenant's worker). A move that blocks writes holds that metadata lock exclusively on every
node until it has switched the tenant, so the query waits for the move and then routes to the
new worker, or the move waits for this claim's transaction. Every claim of the scope, through
any node, during a move or not, therefore locks on the shard's current worker, and its lookup
and insert go over the same connection in the same transaction. The claim takes no lock on
its own node first: held while the query waits for a move, it could close a cycle of waits
with the move and a claim already pinned from another node (the move waits for that claim,
which waits for this lock).

On plain PostgreSQL the claim takes the same lock as before, after one setting lookup. Where
Citus is loaded but the table is not distributed, the query runs locally and takes the lock
here. The atomic claim is unchanged (revision 0009).

The text below is the whole function; the downgrade restores revision 0008's text, copied.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-03
"""

from __future__ import annotations

from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None

#: The durable claim from this revision on.
CLAIM = """CREATE OR REPLACE FUNCTION idempotency_claim(
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
    v_pinned bigint;
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
    IF current_setting('citus.version', true) IS NULL THEN
        PERFORM pg_advisory_xact_lock(
            hashtext('flask_idem'),
            hashtext(p_tenant || E'\\x1f' || p_endpoint || E'\\x1f' || p_key));
    ELSE
        -- On Citus (0010) this function runs on whichever node the claim reached or was
        -- delegated to, and a shard move can switch the tenant to another worker while it
        -- runs. The lock is taken where the tenant's shard is, by a query Citus routes there
        -- whole, in this transaction (the lookup and the insert then go over that same
        -- connection). The query is a write that deletes nothing (no row is dated before
        -- -infinity): Citus takes the shard's metadata lock for it on this node, so a move
        -- that blocks writes has either finished switching the tenant before this query
        -- routes, or waits for this transaction to end; every claim of the scope, from any
        -- node, meets on the one lock on the shard's current worker. No lock is taken on
        -- this node first: held while this query waits for a move, it could close a cycle
        -- of waits with the move and a claim already pinned from another node.
        WITH pinned AS (
            DELETE FROM idempotency_keys_default AS d
             WHERE d.tenant = p_tenant AND d.endpoint = p_endpoint AND d.key = p_key
               AND d.created_at < '-infinity'
            RETURNING *)
        SELECT s.n INTO v_pinned
          FROM (SELECT count(*) AS n FROM pinned) AS s
         WHERE pg_advisory_xact_lock(
                   hashtext('flask_idem'),
                   hashtext(p_tenant || E'\\x1f' || p_endpoint || E'\\x1f' || p_key))
               IS NOT NULL;
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
    RETURN QUERY
        WITH inserted AS (
            INSERT INTO idempotency_keys (
                tenant, endpoint, key, fingerprint, state, claim_token,
                lease_expires_at, created_at, expires_at)
            VALUES (
                p_tenant, p_endpoint, p_key, p_fingerprint, 'in_progress', p_token,
                v_now + make_interval(secs => p_lease), v_now,
                v_now + make_interval(secs => p_ttl))
            RETURNING *)
        SELECT true, i.fingerprint, i.state::text, i.claim_token::text, i.lease_expires_at,
               i.response_status, i.response_headers, i.response_body, i.created_at,
               i.completed_at, i.expires_at, v_now
          FROM inserted AS i;
END
$$

"""

#: Revision 0008's durable claim, restored by the downgrade.
CLAIM_0008 = """CREATE OR REPLACE FUNCTION idempotency_claim(
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
    PERFORM pg_advisory_xact_lock(
        hashtext('flask_idem'),
        hashtext(p_tenant || E'\\x1f' || p_endpoint || E'\\x1f' || p_key));
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
    RETURN QUERY
        WITH inserted AS (
            INSERT INTO idempotency_keys (
                tenant, endpoint, key, fingerprint, state, claim_token,
                lease_expires_at, created_at, expires_at)
            VALUES (
                p_tenant, p_endpoint, p_key, p_fingerprint, 'in_progress', p_token,
                v_now + make_interval(secs => p_lease), v_now,
                v_now + make_interval(secs => p_ttl))
            RETURNING *)
        SELECT true, i.fingerprint, i.state::text, i.claim_token::text, i.lease_expires_at,
               i.response_status, i.response_headers, i.response_body, i.created_at,
               i.completed_at, i.expires_at, v_now
          FROM inserted AS i;
END
$$
"""


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(CLAIM)


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(CLAIM_0008)
