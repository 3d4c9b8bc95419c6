"""Claims bound their own transaction when the session brings no bounds: behind a pooler.

Behind a transaction pooler (PgBouncer's ``pool_mode = transaction``) the settings flask_idem's
engines send at connect never reach the server: PgBouncer refuses the ``options`` start-up
parameter by default, and with ``ignore_startup_parameters = options`` it drops it. A session
``SET`` is no answer either: it stays on the server connection after this client's transaction
and applies to the next client's. Both claim functions therefore begin with the bounds for their
own transaction, with ``set_config(..., true)`` (local: it ends with the transaction, costs no
round trip):

- ``lock_timeout`` of 4 s (``flask_idem.store.guards.STATEMENT_TIMEOUT``) when the session has
  none: a claim waiting for the scope's lock, or for a partition's lock behind upkeep, fails
  on the server instead of waiting for the client-side deadline;
- ``statement_timeout`` of 4 s when the session has none: PostgreSQL arms it when a statement
  starts, so it bounds what follows the claim in its transaction (the view's statements after
  an atomic claim), not the claim's own statement, which the lock timeout and the client-side
  deadline bound;
- ``log_min_error_statement = panic`` when the session logs failing statements: a failed claim
  would write its key to the server log. Setting it needs superuser or ``GRANT SET ON
  PARAMETER``; without either the claim runs as before (the store warned at connect).

A session that has its own bounds (startup options of a direct connection, a role setting)
keeps them: each setting is only written when it is missing, so a direct connection pays three
``current_setting`` reads and nothing else.

The texts below are the whole functions; the downgrade restores revision 0006's claim and
revision 0007's atomic claim, copied.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-02
"""

from __future__ import annotations

from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None

#: The claim from this revision on, beginning with its transaction's bounds.
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

#: The atomic claim from this revision on, beginning with the same bounds.
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

#: Revision 0006's claim, restored by the downgrade.
CLAIM_0006 = """CREATE OR REPLACE FUNCTION idempotency_claim(
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

#: Revision 0007's atomic claim, restored by the downgrade.
RESERVE_0007 = """CREATE OR REPLACE FUNCTION idempotency_claim_reserve(
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
        op.execute(CLAIM)
        op.execute(RESERVE)


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(CLAIM_0006)
        op.execute(RESERVE_0007)
