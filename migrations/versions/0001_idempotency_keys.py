"""Create idempotency_keys (partitioned by created_at on PostgreSQL) and its SQL functions.

Revision ID: 0001
Revises:
Create Date: 2026-11-30
"""

from __future__ import annotations

import os

import sqlalchemy as sa
from alembic import context, op
from sqlalchemy.dialects import postgresql

revision = "0001"
down_revision = None
branch_labels = ("flask_idem",)
depends_on = None

GRANULARITIES = ("day", "week", "month")


def _option(name: str, default: str) -> str:
    """An ``-x name=value`` argument, else the ``IDEMPOTENCY_<NAME>`` variable, else default."""
    value = context.get_x_argument(as_dictionary=True).get(name)
    return value or os.environ.get(f"IDEMPOTENCY_{name.upper()}", default)


def _columns() -> list[sa.Column]:  # type: ignore[type-arg]
    timestamp = sa.DateTime(timezone=True)
    return [
        sa.Column("tenant", sa.String(255), nullable=False),
        sa.Column("endpoint", sa.String(255), nullable=False),
        sa.Column("key", sa.String(255), nullable=False),
        sa.Column("fingerprint", sa.LargeBinary(32), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("claim_token", sa.String(32), nullable=True),
        sa.Column("lease_expires_at", timestamp, nullable=True),
        sa.Column("response_status", sa.Integer, nullable=True),
        sa.Column(
            "response_headers",
            sa.JSON().with_variant(postgresql.JSONB(), "postgresql"),
            nullable=True,
        ),
        sa.Column("response_body", sa.LargeBinary, nullable=True),
        sa.Column("created_at", timestamp, nullable=False),
        sa.Column("completed_at", timestamp, nullable=True),
        sa.Column("expires_at", timestamp, nullable=False),
        sa.PrimaryKeyConstraint(
            "tenant", "endpoint", "key", "created_at", name=op.f("pk_idempotency_keys")
        ),
        sa.CheckConstraint(
            "state IN ('in_progress', 'completed', 'unknown', 'unstored')",
            name=op.f("ck_idempotency_keys_state"),
        ),
    ]


CLAIM_FUNCTION = r"""
CREATE FUNCTION idempotency_claim(
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

CREATE_PARTITIONS_FUNCTION = r"""
CREATE FUNCTION idempotency_create_partitions(
    p_ahead integer, p_dry_run boolean DEFAULT false, p_behind integer DEFAULT 0
) RETURNS SETOF text LANGUAGE plpgsql AS $$
DECLARE
    v_step constant interval := interval '1 {unit}';
    v_first timestamp := date_trunc('{unit}', now() AT TIME ZONE 'UTC');
    v_lo timestamp;
    v_hi timestamp;
    v_name text;
BEGIN
    PERFORM pg_advisory_xact_lock(hashtext('flask_idem'), 0);
    FOR n IN -p_behind..p_ahead LOOP
        v_lo := v_first + n * v_step;
        v_hi := v_lo + v_step;
        v_name := 'idempotency_keys_p' || to_char(v_lo, 'YYYYMMDD');
        CONTINUE WHEN EXISTS (
            SELECT 1 FROM pg_inherits AS inh JOIN pg_class AS c ON c.oid = inh.inhrelid
             WHERE inh.inhparent = 'idempotency_keys'::regclass AND c.relname = v_name);
        IF NOT p_dry_run THEN
            -- Rows that fell into DEFAULT while this partition was missing move into it,
            -- otherwise PostgreSQL refuses to attach it.
            LOCK TABLE idempotency_keys_default IN ACCESS EXCLUSIVE MODE;
            EXECUTE format(
                'CREATE TABLE %I (LIKE idempotency_keys INCLUDING DEFAULTS INCLUDING CONSTRAINTS)',
                v_name);
            EXECUTE format(
                'WITH moved AS (DELETE FROM idempotency_keys_default'
                ' WHERE created_at >= %L AND created_at < %L RETURNING *)'
                ' INSERT INTO %I SELECT * FROM moved',
                v_lo AT TIME ZONE 'UTC', v_hi AT TIME ZONE 'UTC', v_name);
            EXECUTE format(
                'ALTER TABLE idempotency_keys ATTACH PARTITION %I FOR VALUES FROM (%L) TO (%L)',
                v_name, v_lo AT TIME ZONE 'UTC', v_hi AT TIME ZONE 'UTC');
        END IF;
        RETURN NEXT v_name;
    END LOOP;
END
$$;
"""

DROP_PARTITIONS_FUNCTION = r"""
CREATE FUNCTION idempotency_drop_expired_partitions(p_dry_run boolean DEFAULT false)
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

FUNCTIONS = (
    "idempotency_claim(text, text, text, bytea, text, double precision, double precision)",
    "idempotency_create_partitions(integer, boolean, integer)",
    "idempotency_drop_expired_partitions(boolean)",
)


def upgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        op.create_table("idempotency_keys", *_columns())
        op.create_index("ix_idempotency_keys_expires_at", "idempotency_keys", ["expires_at"])
        return

    unit = _option("partition_granularity", "day")
    if unit not in GRANULARITIES:
        raise SystemExit(f"partition_granularity must be one of {', '.join(GRANULARITIES)}")
    ahead = int(_option("partitions_ahead", "7"))

    op.create_table("idempotency_keys", *_columns(), postgresql_partition_by="RANGE (created_at)")
    op.create_index("ix_idempotency_keys_expires_at", "idempotency_keys", ["expires_at"])
    op.execute("CREATE TABLE idempotency_keys_default PARTITION OF idempotency_keys DEFAULT")
    op.execute(CLAIM_FUNCTION)
    op.execute(CREATE_PARTITIONS_FUNCTION.replace("{unit}", unit))
    op.execute(DROP_PARTITIONS_FUNCTION.replace("{unit}", unit))
    # Yesterday's partition too: a record claimed just before midnight stays in its own day.
    op.execute(
        sa.text("SELECT idempotency_create_partitions(:ahead, false, 1)").bindparams(ahead=ahead)
    )


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        for signature in FUNCTIONS:
            op.execute(f"DROP FUNCTION IF EXISTS {signature}")
    op.drop_index("ix_idempotency_keys_expires_at", table_name="idempotency_keys")
    op.drop_table("idempotency_keys")
