"""Drop the (tenant, key) index: a lookup by key without an endpoint uses the primary key.

Revision 0003 added ``ix_idempotency_keys_tenant_key`` for the lookups by key that name no
endpoint (the inspection endpoint, ``flask idem show``, the operator page): the primary key
starts with (tenant, endpoint), so without it they scanned the tenant's records. Every new key
paid for it: one more B-tree entry holding the key's digest (72 bytes), written with the claim,
about 180 of the 1,080 WAL bytes of a durable new key (claim and completion, measured on
PostgreSQL 15, docs/performance.md).

Those lookups now read the tenant's endpoints off the primary key, one index probe per
endpoint (a recursive CTE: a loose index scan), then probe the primary key with
(tenant, endpoint, key) per endpoint: a tenant has few endpoints, and the claim, the
completion and every request-path statement name their endpoint anyway.

Dropping an index of the partitioned table drops it on every partition, under a short ACCESS
EXCLUSIVE lock on the table (no partition's data is read). The downgrade builds it again on
every partition, which reads every row once.

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-04
"""

from __future__ import annotations

from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None

INDEX = "ix_idempotency_keys_tenant_key"


def upgrade() -> None:
    op.drop_index(INDEX, table_name="idempotency_keys")


def downgrade() -> None:
    op.create_index(INDEX, "idempotency_keys", ["tenant", "key"])
