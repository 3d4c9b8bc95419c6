"""The atomic claim: a claim inside the caller's business transaction; both claims insist on
READ COMMITTED.

``idempotency_claim_atomic(...)`` is ``idempotency_claim(...)`` for views whose effects are all
in the database (``@idem.idempotent(atomic=True)``): it runs in the view's own transaction, so
the claim, the business rows and the stored response commit together (one commit), and a
crash rolls all of it back. Two differences:

- it *tries* the scope's advisory lock (``pg_try_advisory_xact_lock``): the lock is held until
  the business transaction ends, so a concurrent duplicate must not wait for the whole view;
  it gets no row back and answers 409 at once;
- it insists on READ COMMITTED: under REPEATABLE READ the lookup would use a snapshot taken
  before the lock and could miss the record the previous lock holder just committed.

Both claims take the same lock, so they exclude each other as well. The atomic claim is
``idempotency_claim`` of revision 0002 with the try-lock, so the lookup and the insert are the
same SQL. The texts below are the whole functions; the downgrade restores revision 0002's
claim, copied.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01
"""

from __future__ import annotations

from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

SIGNATURE = (
    "idempotency_claim_atomic(text, text, text, bytea, text, double precision, double precision)"
)

#: ``idempotency_claim`` refusing any isolation but READ COMMITTED: under REPEATABLE READ (a
#: database's or role's default, even in autocommit) its lookup would use a snapshot taken
#: before the lock and miss the record the previous holder committed, so two claims could both
#: insert.
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

#: The atomic claim. It keeps the ``p_lease`` argument: the caller passes 0, so the lease of a
#: row that is never seen in progress by anyone else "ends" at the claim (should it ever
#: commit in progress, it shows as stuck at once).
ATOMIC_CLAIM_FUNCTION = r"""
CREATE FUNCTION idempotency_claim_atomic(
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

#: Revision 0002's claim, restored by the downgrade.
CLAIM_FUNCTION_0002 = r"""
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


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(CLAIM_FUNCTION)
        op.execute(ATOMIC_CLAIM_FUNCTION)


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(f"DROP FUNCTION IF EXISTS {SIGNATURE}")
        op.execute(CLAIM_FUNCTION_0002)
