"""The outcome model: a TTL counted from the end of a request, and the ``reopened`` state.

A record used to count until ``expires_at`` (claim + TTL) or while its lease was held, so a
request that ran past its TTL completed into a dead record and the next retry ran it again.
From this revision a record is live for its TTL from its claim *and* for its TTL from the end
of its request: ``coalesce(completed_at, lease_expires_at, created_at) + (expires_at -
created_at) > now``. The claim function and the partition drop use that predicate, as do the
stores' own statements.

``reopened`` is what an operator's release of a possibly-executed operation leaves: the next
retry runs it again as the same operation (same row, so the same downstream keys).

The texts below are the whole functions; the downgrade restores revision 0001's texts, copied.
The partition unit (``{unit}``) was fixed by 0001; it is read back from the installed function.

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-01
"""

from __future__ import annotations

import re

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

#: The claim from this revision on: live for its TTL from its claim or from its request's end.
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

#: The partition drop from this revision on, with the same liveness as the claim.
DROP_PARTITIONS_FUNCTION = r"""
CREATE OR REPLACE FUNCTION idempotency_drop_expired_partitions(p_dry_run boolean DEFAULT false)
RETURNS SETOF text LANGUAGE plpgsql AS $$
DECLARE
    v_step constant interval := interval '1 {unit}';
    v_name text;
    v_day text;
    v_hi timestamptz;
    v_live boolean;
    -- Live as in idempotency_claim(): before expiry, or in progress under a held lease.
    v_live_query constant text := 'SELECT EXISTS (SELECT 1 FROM %I WHERE expires_at > now() '
        'OR coalesce(completed_at, lease_expires_at, created_at) '
        '+ (expires_at - created_at) > now())';
BEGIN
    PERFORM pg_advisory_xact_lock(hashtext('flask_idem'), 0);
    FOR v_name IN
        SELECT c.relname::text FROM pg_inherits AS inh JOIN pg_class AS c ON c.oid = inh.inhrelid
         WHERE inh.inhparent = 'idempotency_keys'::regclass
         ORDER BY c.relname
    LOOP
        v_day := substring(v_name FROM '^idempotency_keys_p(\d{8})$');
        CONTINUE WHEN v_day IS NULL;
        v_hi := (to_date(v_day, 'YYYYMMDD')::timestamp + v_step) AT TIME ZONE 'UTC';
        -- The current and future partitions still receive claims.
        CONTINUE WHEN v_hi > now();
        EXECUTE format(v_live_query, v_name) INTO v_live;
        CONTINUE WHEN v_live;
        IF NOT p_dry_run THEN
            -- Lock the parent (which locks every partition, parent first, in the order claims
            -- take their locks, so no deadlock), then check again: nothing can move a live
            -- row in (an UPDATE of created_at) between this check and the drop. Claims queue
            -- behind this lock, so the caller keeps lock_timeout short; when the table stays
            -- busy the partition is left for the next run.
            BEGIN
                LOCK TABLE idempotency_keys IN ACCESS EXCLUSIVE MODE;
            EXCEPTION WHEN lock_not_available THEN
                CONTINUE;
            END;
            EXECUTE format(v_live_query, v_name) INTO v_live;
            CONTINUE WHEN v_live;
        END IF;
        IF NOT p_dry_run THEN
            EXECUTE format('DROP TABLE %I', v_name);
        END IF;
        RETURN NEXT v_name;
    END LOOP;
END
$$;
"""

#: Revision 0001's claim, restored by the downgrade.
CLAIM_FUNCTION_0001 = r"""
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
                OR (k.state = 'in_progress' AND k.lease_expires_at > v_now))
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

#: Revision 0001's partition drop, restored by the downgrade.
DROP_PARTITIONS_FUNCTION_0001 = r"""
CREATE OR REPLACE FUNCTION idempotency_drop_expired_partitions(p_dry_run boolean DEFAULT false)
RETURNS SETOF text LANGUAGE plpgsql AS $$
DECLARE
    v_step constant interval := interval '1 {unit}';
    v_name text;
    v_day text;
    v_hi timestamptz;
    v_live boolean;
    -- Live as in idempotency_claim(): before expiry, or in progress under a held lease.
    v_live_query constant text := 'SELECT EXISTS (SELECT 1 FROM %I WHERE expires_at > now() '
        'OR (state = ''in_progress'' AND lease_expires_at > now()))';
BEGIN
    PERFORM pg_advisory_xact_lock(hashtext('flask_idem'), 0);
    FOR v_name IN
        SELECT c.relname::text FROM pg_inherits AS inh JOIN pg_class AS c ON c.oid = inh.inhrelid
         WHERE inh.inhparent = 'idempotency_keys'::regclass
         ORDER BY c.relname
    LOOP
        v_day := substring(v_name FROM '^idempotency_keys_p(\d{8})$');
        CONTINUE WHEN v_day IS NULL;
        v_hi := (to_date(v_day, 'YYYYMMDD')::timestamp + v_step) AT TIME ZONE 'UTC';
        -- The current and future partitions still receive claims.
        CONTINUE WHEN v_hi > now();
        EXECUTE format(v_live_query, v_name) INTO v_live;
        CONTINUE WHEN v_live;
        IF NOT p_dry_run THEN
            -- Lock the parent (which locks every partition, parent first, in the order claims
            -- take their locks, so no deadlock), then check again: nothing can move a live
            -- row in (an UPDATE of created_at) between this check and the drop. Claims queue
            -- behind this lock, so the caller keeps lock_timeout short; when the table stays
            -- busy the partition is left for the next run.
            BEGIN
                LOCK TABLE idempotency_keys IN ACCESS EXCLUSIVE MODE;
            EXCEPTION WHEN lock_not_available THEN
                CONTINUE;
            END;
            EXECUTE format(v_live_query, v_name) INTO v_live;
            CONTINUE WHEN v_live;
        END IF;
        IF NOT p_dry_run THEN
            EXECUTE format('DROP TABLE %I', v_name);
        END IF;
        RETURN NEXT v_name;
    END LOOP;
END
$$;
"""


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


def _functions(claim: str, drop: str) -> None:
    op.execute(claim)
    op.execute(drop.replace("{unit}", _granularity()))


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
        _functions(CLAIM_FUNCTION, DROP_PARTITIONS_FUNCTION)


def downgrade() -> None:
    # Reopened records become unknown ones: the closest state 0001 knows (never re-run).
    op.execute(f"UPDATE {TABLE} SET state = 'unknown' WHERE state = 'reopened'")
    _set_states(OLD_STATES)
    if op.get_bind().dialect.name == "postgresql":
        _functions(CLAIM_FUNCTION_0001, DROP_PARTITIONS_FUNCTION_0001)
