"""Index (tenant, key) for the inspection lookup; partition upkeep that never moves rows.

The inspection endpoint looks a key up without its endpoint; the primary key starts with
(tenant, endpoint), so without this index that lookup scans the tenant's records.

``idempotency_create_partitions`` used to move rows that fell into DEFAULT into the partition
it created for them. A move is a DELETE and an INSERT: a request in flight whose record moved
found nothing to complete (409 "lost its claim", its work rolled back, and on
``recovery="fail"`` views the key stuck at ``outcome-pending``), and claims stalled behind the
ACCESS EXCLUSIVE lock on DEFAULT for as long as the move took. Now a range that has rows in
DEFAULT gets no partition: they stay where they are until they expire and are purged row by
row, and only ranges with no such rows get one (future days, normally). A partition that
cannot be attached at once (its lock is busy, or a claim just put a row of its range into
DEFAULT) is left for the next run.

The text below is the whole function; the downgrade restores revision 0001's, copied.
The granularity (``{unit}``) was fixed by 0001; it is read back from the installed function.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01
"""

from __future__ import annotations

import re

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

INDEX = "ix_idempotency_keys_tenant_key"
SIGNATURE = "idempotency_create_partitions(integer, boolean, integer)"

#: The partition upkeep from this revision on: it never moves rows out of DEFAULT.
CREATE_PARTITIONS_FUNCTION = r"""
CREATE OR REPLACE FUNCTION idempotency_create_partitions(
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
        -- Rows of this range in DEFAULT stay there until they expire: moving them would hide
        -- live records from their owners and lock DEFAULT for as long as the move takes.
        CONTINUE WHEN EXISTS (
            SELECT 1 FROM idempotency_keys_default
             WHERE created_at >= v_lo AT TIME ZONE 'UTC' AND created_at < v_hi AT TIME ZONE 'UTC');
        IF NOT p_dry_run THEN
            BEGIN
                EXECUTE format(
                    'CREATE TABLE %I (LIKE idempotency_keys'
                    ' INCLUDING DEFAULTS INCLUDING CONSTRAINTS)', v_name);
                -- Scans DEFAULT under its lock (nothing to move): the caller keeps lock_timeout
                -- short and attaches one partition per transaction.
                EXECUTE format(
                    'ALTER TABLE idempotency_keys ATTACH PARTITION %I FOR VALUES FROM (%L) TO (%L)',
                    v_name, v_lo AT TIME ZONE 'UTC', v_hi AT TIME ZONE 'UTC');
            EXCEPTION WHEN lock_not_available OR check_violation THEN
                -- Busy, or a claim put a row of this range into DEFAULT meanwhile: next run.
                CONTINUE;
            END;
        END IF;
        RETURN NEXT v_name;
    END LOOP;
END
$$;
"""

#: Revision 0001's partition upkeep (it moved rows), restored by the downgrade.
CREATE_PARTITIONS_FUNCTION_0001 = r"""
CREATE OR REPLACE FUNCTION idempotency_create_partitions(
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


def _unit() -> str:
    definition = (
        op.get_bind()
        .execute(sa.text(f"SELECT pg_get_functiondef('{SIGNATURE}'::regprocedure)"))
        .scalar_one()
    )
    found = re.search(r"date_trunc\('(day|week|month)'", definition)
    if found is None:
        raise SystemExit("idempotency_create_partitions(): cannot read its granularity back")
    return found.group(1)


def upgrade() -> None:
    op.create_index(INDEX, "idempotency_keys", ["tenant", "key"])
    if op.get_bind().dialect.name == "postgresql":
        op.execute(CREATE_PARTITIONS_FUNCTION.replace("{unit}", _unit()))


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(CREATE_PARTITIONS_FUNCTION_0001.replace("{unit}", _unit()))
    op.drop_index(INDEX, table_name="idempotency_keys")
