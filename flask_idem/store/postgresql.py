"""PostgreSQL store: a partition-safe atomic claim in one round trip.

Why not ``INSERT ... ON CONFLICT``
    ``idempotency_keys`` is ``PARTITION BY RANGE (created_at)`` so that expired days can be
    dropped instead of deleted. PostgreSQL only accepts unique indexes on a partitioned table
    that contain the partition key, so the best it offers is
    ``UNIQUE (tenant, endpoint, key, created_at)``: two claims of one key made a millisecond
    apart differ in ``created_at`` and both insert, and a key claimed yesterday lives in another
    partition than a retry today. No constraint can see across partitions.

The guard
    The migration installs ``idempotency_claim(...)``, which, in one statement:

    1. takes ``pg_advisory_xact_lock(hashtext('flask_idem'), hashtext(tenant, endpoint, key))``:
       every claim of one scope queues on this lock, whatever partition its row is in;
    2. reads the clock *after* the lock (``clock_timestamp()``), so a claim that waited cannot
       date its row before the row of the claim it waited for;
    3. looks up the live record of the scope in every partition (``expires_at > now``): a live
       record blocks the claim wherever it lives, an expired one never does;
    4. inserts the new record only if none was found, and returns either row.

    The lock is released at commit, after the insert is visible, so the next waiter's lookup
    sees it: two claims of one scope can never both insert. A hash collision between two scopes
    only makes them wait for each other; it cannot merge them, because the lookup compares the
    real columns. The per-partition primary key remains as a safety net.

Round trips
    Primitives run on an autocommit connection: the claim (also when it finds an existing
    record, so a replay costs one statement in all), ``complete``, ``release``, ``renew`` and
    ``mark_unknown`` are each one statement with no ``BEGIN``/``COMMIT`` of their own.
    ``complete`` can instead join the caller's business transaction (no extra commit). Writes
    after the claim pass the record's ``created_at``, so PostgreSQL plans them against one
    partition instead of all of them.

Citus
    ``flask idem citus`` distributes the table by ``tenant`` and this function by ``p_tenant``;
    every other statement is a single-tenant one Citus routes to one shard, and none returns a
    non-immutable expression (``tests/test_citus.py`` checks both). See ``docs/citus.md``.

Partitions
    ``idempotency_create_partitions(ahead)`` creates the current and ``ahead`` next partitions
    (daily by default; the migration fixes the granularity). It never moves rows: a range that
    has rows in DEFAULT (upkeep fell behind) gets no partition, and its rows stay in DEFAULT
    until they expire and are purged in batches, so an owner never loses sight of its record
    mid-request and claims never wait for a bulk move.
    ``idempotency_drop_expired_partitions()`` drops a partition only when it no longer
    receives claims and every row in it is past ``expires_at``, checked under an exclusive
    lock on that partition.
"""

from __future__ import annotations

import contextlib
import typing as t

import sqlalchemy as sa

from ..record import ClaimResult, MaintenanceReport, Scope
from ..table import DEFAULT_PARTITION
from ..table import idempotency_keys as table
from .sql import SQLStore, new_token, record_from_row, translate_errors

# Sent as driver SQL: the hottest statement (every protected request) skips SQLAlchemy's
# statement compilation; psycopg2 already returns bytea, jsonb and timestamptz as Python values.
# On Citus (docs/citus.md) this exact shape is what gets delegated to the tenant's worker: one
# function in FROM, the tenant first, arguments inlined by psycopg2 as constants, and no
# transaction block around it (autocommit), where Citus would run it on the coordinator.
_CLAIM = (
    "SELECT * FROM idempotency_claim(%(tenant)s, %(endpoint)s, %(key)s, %(fingerprint)s, "
    "%(token)s, %(ttl)s, %(lease)s)"
)
_CLAIM_ATOMIC = _CLAIM.replace("idempotency_claim(", "idempotency_claim_atomic(")
_CREATE_PARTITIONS = sa.text("SELECT * FROM idempotency_create_partitions(:ahead, :dry_run)")
_DROP_PARTITIONS = sa.text("SELECT * FROM idempotency_drop_expired_partitions(:dry_run)")
# Live as in idempotency_claim() (migration 0002): a TTL from the claim, and a TTL from the
# end of the request (completion, unknown, or the end of its last lease).
_EXPIRED = (
    "expires_at <= now() AND coalesce(completed_at, lease_expires_at, created_at) "
    "+ (expires_at - created_at) <= now()"
)
_COUNT_EXPIRED_DEFAULT = sa.text(f"SELECT count(*) FROM {DEFAULT_PARTITION} WHERE {_EXPIRED}")
_PURGE_DEFAULT = sa.text(
    f"DELETE FROM {DEFAULT_PARTITION} WHERE ctid = ANY(ARRAY("
    f"SELECT ctid FROM {DEFAULT_PARTITION} WHERE {_EXPIRED} LIMIT :batch))"
)
#: Expired rows deleted from DEFAULT per transaction.
PURGE_BATCH = 5000
#: How long upkeep waits for a lock that claims need too (claims queue behind the wait).
MAINTENANCE_LOCK_TIMEOUT = "200ms"


def _claim_parameters(
    scope: Scope, fingerprint: bytes, ttl: float, lease: float
) -> dict[str, t.Any]:
    return {
        "tenant": scope.tenant,
        "endpoint": scope.endpoint,
        "key": scope.key,
        "fingerprint": fingerprint,
        "token": new_token(),
        "ttl": float(ttl),
        "lease": float(lease),
    }


class PostgresStore(SQLStore):
    """Store on PostgreSQL >= 13 with the schema of ``alembic upgrade head``."""

    dialect = "postgresql"

    def now(self) -> sa.ColumnElement[t.Any]:
        return sa.func.now()

    def now_plus(self, seconds: float) -> sa.ColumnElement[t.Any]:
        return sa.func.now() + sa.func.make_interval(0, 0, 0, 0, 0, 0, float(seconds))

    def ttl_after_end(self) -> sa.ColumnElement[bool]:
        # Spelled as interval < interval: ``timestamptz + interval`` is STABLE, which Citus
        # refuses on columns in an UPDATE or DELETE (docs/citus.md); this form is IMMUTABLE
        # once now() is a constant.
        ended = sa.func.coalesce(table.c.completed_at, table.c.lease_expires_at, table.c.created_at)
        return sa.func.now() - ended < table.c.expires_at - table.c.created_at

    @contextlib.contextmanager
    def connect(self) -> t.Iterator[sa.Connection]:
        """A pooled connection in autocommit: no BEGIN/COMMIT round trips around a primitive.

        The driver's autocommit flag is flipped directly: SQLAlchemy's ``AUTOCOMMIT`` isolation
        level would cost one more round trip (``SET default_transaction_isolation``) when the
        connection returns to the pool.
        """
        with self.engine.connect() as connection:
            dbapi_connection = connection.connection.dbapi_connection
            assert dbapi_connection is not None
            dbapi_connection.autocommit = True
            try:
                yield connection
            finally:
                if not dbapi_connection.closed:
                    dbapi_connection.autocommit = False

    def claim(self, scope: Scope, fingerprint: bytes, *, ttl: float, lease: float) -> ClaimResult:
        parameters = _claim_parameters(scope, fingerprint, ttl, lease)
        with translate_errors(), self.connect() as conn:
            row = conn.exec_driver_sql(_CLAIM, parameters).one()
        return ClaimResult(record_from_row(scope, row, self.sealer), claimed=bool(row.claimed))

    def claim_atomic(
        self, connection: sa.Connection, scope: Scope, fingerprint: bytes, *, ttl: float
    ) -> ClaimResult | None:
        parameters = _claim_parameters(scope, fingerprint, ttl, lease=0)
        with translate_errors():
            row = connection.exec_driver_sql(_CLAIM_ATOMIC, parameters).first()
        if row is None:
            return None  # the scope's lock is held: a duplicate is running
        return ClaimResult(record_from_row(scope, row, self.sealer), claimed=bool(row.claimed))

    def maintain(self, *, ahead: int, dry_run: bool = False) -> MaintenanceReport:
        # Rows land in DEFAULT only when upkeep fell behind; expire them row by row, in
        # batches that each stay well within the statement timeout, and first: a range whose
        # rows have all gone gets its partition in this same run.
        with translate_errors():
            if dry_run:
                with self.engine.begin() as conn:
                    purged = int(conn.execute(_COUNT_EXPIRED_DEFAULT).scalar_one())
            else:
                purged = 0
                while True:
                    with self.engine.begin() as conn:
                        batch = conn.execute(_PURGE_DEFAULT, {"batch": PURGE_BATCH}).rowcount
                    purged += batch
                    if batch < PURGE_BATCH:
                        break
        # One transaction per step, and per new partition: a step's locks must not be held
        # while the next one waits for the parent table (a claim queued between them closes a
        # deadlock cycle), and attaching a partition holds DEFAULT locked while it checks it,
        # so claims never wait for more than one such check.
        if dry_run:
            created = self._maintenance_step(_CREATE_PARTITIONS, ahead=ahead, dry_run=True)
        else:
            created = []
            for step in range(ahead + 1):
                created += self._maintenance_step(_CREATE_PARTITIONS, ahead=step, dry_run=False)
        # Claims wait behind the drop's exclusive lock: give up quickly, retry next run.
        dropped = self._maintenance_step(_DROP_PARTITIONS, dry_run=dry_run)
        return MaintenanceReport(tuple(created), tuple(dropped), purged, dry_run)

    def _maintenance_step(self, statement: sa.TextClause, **parameters: t.Any) -> list[str]:
        with translate_errors(), self.engine.begin() as conn:
            # Partition DDL waits for running claims, and claims queue behind a waiting DDL
            # lock: never make them wait long; a partition left out is taken next run.
            conn.exec_driver_sql(f"SET LOCAL lock_timeout = '{MAINTENANCE_LOCK_TIMEOUT}'")
            return list(conn.execute(statement, parameters).scalars())
