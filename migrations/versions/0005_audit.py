"""The audit trail: ``idempotency_audit``, append-only, partitioned by month on PostgreSQL.

One row per state transition of a record when ``IDEMPOTENCY_AUDIT`` is on (see
``flask_idem/trail.py``). It is written in the same statement (PostgreSQL) or transaction
(SQLite) as the transition, never updated, and deleted only by its own retention
(``IDEMPOTENCY_AUDIT_RETENTION``, enforced by ``flask idem maintain``), which is set apart from
the keys' TTL: audit rows are kept as long as the ledger they explain.

On PostgreSQL the table is ``PARTITION BY RANGE (occurred_at)`` with monthly partitions
(``idempotency_audit_pYYYYMM``) and a DEFAULT one, so an insert never fails when upkeep falls
behind; ``idempotency_audit_partitions(ahead, retention, dry_run)`` creates months ahead, drops
whole months past the retention, and deletes rows past it from DEFAULT. Like the keys' upkeep it
never moves rows, and gives up a lock it cannot get at once (the caller's lock_timeout) until
the next run. On SQLite it is one plain table.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

TABLE = "idempotency_audit"
FUNCTION = "idempotency_audit_partitions(integer, double precision, boolean)"

PARTITIONS_FUNCTION = r"""
CREATE FUNCTION idempotency_audit_partitions(
    p_ahead integer, p_retention double precision, p_dry_run boolean DEFAULT false
) RETURNS SETOF text LANGUAGE plpgsql AS $$
DECLARE
    v_first timestamp := date_trunc('month', now() AT TIME ZONE 'UTC');
    v_lo timestamp;
    v_hi timestamp;
    v_name text;
    v_cut timestamptz;
    v_purged bigint;
BEGIN
    PERFORM pg_advisory_xact_lock(hashtext('flask_idem'), 1);
    FOR n IN 0..p_ahead LOOP
        v_lo := v_first + make_interval(months => n);
        v_hi := v_lo + interval '1 month';
        v_name := 'idempotency_audit_p' || to_char(v_lo, 'YYYYMM');
        CONTINUE WHEN EXISTS (
            SELECT 1 FROM pg_inherits AS inh JOIN pg_class AS c ON c.oid = inh.inhrelid
             WHERE inh.inhparent = 'idempotency_audit'::regclass AND c.relname = v_name);
        -- Rows of this month in DEFAULT stay there (never moved): the month gets no partition.
        CONTINUE WHEN EXISTS (
            SELECT 1 FROM idempotency_audit_default
             WHERE occurred_at >= v_lo AT TIME ZONE 'UTC'
               AND occurred_at < v_hi AT TIME ZONE 'UTC');
        IF NOT p_dry_run THEN
            BEGIN
                EXECUTE format(
                    'CREATE TABLE %I PARTITION OF idempotency_audit FOR VALUES FROM (%L) TO (%L)',
                    v_name, v_lo AT TIME ZONE 'UTC', v_hi AT TIME ZONE 'UTC');
            EXCEPTION WHEN lock_not_available OR check_violation THEN
                CONTINUE;
            END;
        END IF;
        RETURN NEXT 'created ' || v_name;
    END LOOP;
    IF p_retention IS NULL THEN
        RETURN;
    END IF;
    v_cut := now() - make_interval(secs => p_retention);
    FOR v_name IN
        SELECT c.relname::text FROM pg_inherits AS inh JOIN pg_class AS c ON c.oid = inh.inhrelid
         WHERE inh.inhparent = 'idempotency_audit'::regclass
           AND c.relname ~ '^idempotency_audit_p[0-9]{6}$'
         ORDER BY c.relname
    LOOP
        -- A month goes once its last moment is past the retention.
        CONTINUE WHEN (to_date(substring(v_name FROM '[0-9]{6}$') || '01', 'YYYYMMDD')
                       + interval '1 month')::timestamp AT TIME ZONE 'UTC' > v_cut;
        IF NOT p_dry_run THEN
            BEGIN
                EXECUTE format('DROP TABLE %I', v_name);
            EXCEPTION WHEN lock_not_available THEN
                CONTINUE;
            END;
        END IF;
        RETURN NEXT 'dropped ' || v_name;
    END LOOP;
    IF p_dry_run THEN
        SELECT count(*) INTO v_purged FROM idempotency_audit_default WHERE occurred_at < v_cut;
    ELSE
        DELETE FROM idempotency_audit_default WHERE occurred_at < v_cut;
        GET DIAGNOSTICS v_purged = ROW_COUNT;
    END IF;
    RETURN NEXT 'purged ' || v_purged;
END
$$;
"""


def _columns(seq: sa.Column) -> list[sa.Column]:  # type: ignore[type-arg]
    timestamp = sa.DateTime(timezone=True)
    return [
        seq,
        sa.Column("occurred_at", timestamp, nullable=False),
        sa.Column("tenant", sa.String(255), nullable=False),
        sa.Column("endpoint", sa.String(255), nullable=False),
        sa.Column("key_hash", sa.String(16), nullable=False),
        sa.Column("lookup", sa.LargeBinary(32), nullable=False),
        sa.Column("record_created_at", timestamp, nullable=True),
        sa.Column("event", sa.String(16), nullable=False),
        sa.Column("state", sa.String(16), nullable=True),
        sa.Column("status", sa.Integer, nullable=True),
        sa.Column("fingerprint", sa.LargeBinary(32), nullable=True),
        sa.Column("actor", sa.String(16), nullable=False),
        sa.Column("detail", sa.String(255), nullable=True),
    ]


def upgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        # The rowid (seq INTEGER PRIMARY KEY) orders rows of one millisecond.
        op.create_table(TABLE, *_columns(sa.Column("seq", sa.Integer, primary_key=True)))
        op.create_index("ix_idempotency_audit_tenant_lookup", TABLE, ["tenant", "lookup"])
        return
    # A random id, not a sequence: no global counter on the request path (the table is meant
    # to be distributed by tenant, where a shared sequence is one more cross-node round trip).
    seq = sa.Column("seq", sa.Uuid, nullable=False, server_default=sa.text("gen_random_uuid()"))
    op.create_table(
        TABLE,
        *_columns(seq),
        # A key on a partitioned table must hold the partition key.
        sa.PrimaryKeyConstraint("seq", "occurred_at", name="pk_idempotency_audit"),
        postgresql_partition_by="RANGE (occurred_at)",
    )
    op.create_index("ix_idempotency_audit_tenant_lookup", TABLE, ["tenant", "lookup"])
    op.execute(f"CREATE TABLE {TABLE}_default PARTITION OF {TABLE} DEFAULT")
    op.execute(PARTITIONS_FUNCTION)
    op.execute("SELECT idempotency_audit_partitions(2, NULL, false)")


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(f"DROP FUNCTION IF EXISTS {FUNCTION}")
    op.drop_index("ix_idempotency_audit_tenant_lookup", table_name=TABLE)
    op.drop_table(TABLE)
