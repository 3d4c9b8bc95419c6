"""The ``idempotency_keys`` table as SQLAlchemy Core sees it.

The migration in ``migrations/versions`` creates it; this module only describes it for queries
(and for the test that compares the migrated database with it). On PostgreSQL the table is
``PARTITION BY RANGE (created_at)``, which is why the primary key has to include ``created_at``
and therefore cannot stop a second claim of the same key on its own: the real guard is the
advisory lock taken by the claim function (see :mod:`flask_idem.store.postgresql`). On
PostgreSQL the migration also adds ``ck_idempotency_keys_commit_flushed`` (revision 0013), a
check that always holds and makes a transaction writing a record commit flushed on Citus: not
described here, as no query uses it.
"""

from __future__ import annotations

import json
import typing as t

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

TABLE_NAME = "idempotency_keys"
DEFAULT_PARTITION = f"{TABLE_NAME}_default"
#: The extension's own Alembic version table, so that it never collides with the application's.
VERSION_TABLE = "flask_idem_alembic_version"

metadata = sa.MetaData(
    naming_convention={
        "ix": "ix_%(table_name)s_%(column_0_N_name)s",
        "ck": "ck_%(table_name)s_%(constraint_name)s",
        "pk": "pk_%(table_name)s",
    }
)


class _StoredTimestamp(sa.TypeDecorator[t.Any]):
    """A timestamp that reads a value which is no timestamp as that value, unparsed.

    SQLite keeps whatever a statement wrote into a timestamp column (PostgreSQL's timestamptz
    accepts only timestamps): one altered row must reach the record builder, which marks it
    damaged (see :attr:`flask_idem.core.record.Record.damaged`), instead of failing the fetch of
    every row read with it (``flask idem reconcile``, the operator page).
    """

    impl = sa.DateTime(timezone=True)
    cache_ok = True

    def result_processor(self, dialect: sa.Dialect, coltype: t.Any) -> t.Any:
        parse = self.impl_instance.dialect_impl(dialect).result_processor(dialect, coltype)
        if parse is None:
            return None

        def process(value: t.Any) -> t.Any:
            try:
                return parse(value)
            except (ValueError, TypeError):
                return value

        return process


_timestamp = _StoredTimestamp()


class _StoredJSON(sa.TypeDecorator[t.Any]):
    """JSON that reads text which is no JSON as that text, unparsed.

    SQLite keeps whatever a statement wrote into a JSON column (PostgreSQL's jsonb accepts only
    JSON): a row altered into text that does not parse, or that nests deeper than the parser's
    stack, must reach the sealer (which refuses it as malformed) instead of failing the fetch.
    """

    impl = sa.JSON
    cache_ok = True

    def result_processor(self, dialect: sa.Dialect, coltype: t.Any) -> t.Any:
        def process(value: t.Any) -> t.Any:
            if not isinstance(value, str | bytes):
                return value
            try:
                return json.loads(value)
            except (ValueError, RecursionError):
                return value

        return process


#: ``response_headers``: None is written as SQL NULL (the mark of a sealed envelope), never the
#: JSON ``null`` SQLAlchemy writes by default, so that SQL can tell the layouts apart.
_headers = _StoredJSON(none_as_null=True).with_variant(
    postgresql.JSONB(none_as_null=True), "postgresql"
)

idempotency_keys = sa.Table(
    TABLE_NAME,
    metadata,
    sa.Column("tenant", sa.String(255), nullable=False),
    sa.Column("endpoint", sa.String(255), nullable=False),
    sa.Column("key", sa.String(255), nullable=False),
    sa.Column("fingerprint", sa.LargeBinary(32), nullable=False),
    sa.Column("state", sa.String(16), nullable=False),
    sa.Column("claim_token", sa.String(32), nullable=True),
    sa.Column("lease_expires_at", _timestamp, nullable=True),
    sa.Column("response_status", sa.Integer, nullable=True),
    sa.Column("response_headers", _headers, nullable=True),
    sa.Column("response_body", sa.LargeBinary, nullable=True),
    sa.Column("created_at", _timestamp, nullable=False),
    sa.Column("completed_at", _timestamp, nullable=True),
    sa.Column("expires_at", _timestamp, nullable=False),
    # Per-partition uniqueness only (PostgreSQL demands the partition key in it): a safety net,
    # not the guard against a second claim.
    sa.PrimaryKeyConstraint("tenant", "endpoint", "key", "created_at"),
    sa.CheckConstraint(
        "state IN ('in_progress', 'completed', 'unknown', 'unstored', 'reopened')", name="state"
    ),
    # SQLite's: the purge deletes expired rows one by one. On PostgreSQL only DEFAULT has one
    # (``ix_idempotency_keys_default_expires_at``, revision 0014): a day's partition is dropped
    # whole, and only DEFAULT's rows are purged one by one.
    sa.Index(None, "expires_at"),
    postgresql_partition_by="RANGE (created_at)",
)

AUDIT_TABLE_NAME = "idempotency_audit"

#: The append-only audit trail (``IDEMPOTENCY_AUDIT``, migration 0005): one row per state
#: transition of a record, written in the same statement or transaction as the transition.
#: Never updated; rows are deleted only by retention (``IDEMPOTENCY_AUDIT_RETENTION``): on
#: PostgreSQL monthly partitions on ``occurred_at`` are dropped whole. The key itself is not
#: stored: ``lookup`` (SHA-256 of tenant and key, see :func:`flask_idem.store.trail.lookup_digest`)
#: finds a key's timeline for whoever knows the key, and ``key_hash`` matches logs and the CLI.
idempotency_audit = sa.Table(
    AUDIT_TABLE_NAME,
    metadata,
    # PostgreSQL: a random uuid (never a global sequence on the request path); SQLite: the rowid.
    sa.Column(
        "seq",
        sa.Uuid().with_variant(sa.Integer(), "sqlite"),
        server_default=sa.FetchedValue(),
        nullable=False,
    ),
    sa.Column("occurred_at", _timestamp, nullable=False),
    sa.Column("tenant", sa.String(255), nullable=False),
    sa.Column("endpoint", sa.String(255), nullable=False),
    sa.Column("key_hash", sa.String(16), nullable=False),
    sa.Column("lookup", sa.LargeBinary(32), nullable=False),
    sa.Column("record_created_at", _timestamp, nullable=True),
    sa.Column("event", sa.String(16), nullable=False),
    sa.Column("state", sa.String(16), nullable=True),
    sa.Column("status", sa.Integer, nullable=True),
    sa.Column("fingerprint", sa.LargeBinary(32), nullable=True),
    sa.Column("actor", sa.String(16), nullable=False),
    sa.Column("detail", sa.String(255), nullable=True),
    sa.PrimaryKeyConstraint("seq", "occurred_at"),
    sa.Index(None, "tenant", "lookup"),
    postgresql_partition_by="RANGE (occurred_at)",
)
