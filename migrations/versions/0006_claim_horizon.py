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

The texts below are the whole functions; the downgrade restores revision 0004's, copied.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-01
"""

from __future__ import annotations

from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

#: The claim from this revision on: its lookup bounded a day after its clock (see above for
#: why the bound misses nothing).
CLAIM_FUNCTION = r"""
CREATE OR REPLACE FUNCTION idempotency_claim(
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
    PERFORM pg_advisory_xact_lock(
        hashtext('flask_idem'),
        hashtext(p_tenant || E'\x1f' || p_endpoint || E'\x1f' || p_key));
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
$$;
"""

#: The atomic claim from this revision on, with the same bound.
ATOMIC_CLAIM_FUNCTION = r"""
CREATE OR REPLACE FUNCTION idempotency_claim_atomic(
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
$$;
"""

#: Revision 0004's claim, restored by the downgrade.
CLAIM_FUNCTION_0004 = r"""
CREATE OR REPLACE FUNCTION idempotency_claim(
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
    PERFORM pg_advisory_xact_lock(
        hashtext('flask_idem'),
        hashtext(p_tenant || E'\x1f' || p_endpoint || E'\x1f' || p_key));
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
$$;
"""

#: Revision 0004's atomic claim, restored by the downgrade.
ATOMIC_CLAIM_FUNCTION_0004 = r"""
CREATE OR REPLACE FUNCTION idempotency_claim_atomic(
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
$$;
"""


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(CLAIM_FUNCTION)
        op.execute(ATOMIC_CLAIM_FUNCTION)


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(CLAIM_FUNCTION_0004)
        op.execute(ATOMIC_CLAIM_FUNCTION_0004)
