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
    3. looks up the live record of the scope in every partition that can hold one: a live
       record blocks the claim wherever it lives, an expired one never does. Partitions
       starting a day or more after the claim's clock are pruned (migration 0006): every
       record's ``created_at`` is the clock its own claim read after taking this lock, so it
       is never later than this claim's (a day of slack for a clock stepped back);
    4. inserts the new record only if none was found, and returns either row.

    The atomic claim (``idempotency_claim_reserve``, migration 0007) runs the same steps inside
    the business transaction with a *try*-lock, and step 4 only reserves the record: the
    completion inserts it, completed, in that transaction (:class:`ClaimResult`'s
    ``reservation``), so an atomic request writes its record once, and the lock, held until the
    commit, keeps every duplicate out meanwhile.

    The lock is released at commit, after the insert is visible, so the next waiter's lookup
    sees it: two claims of one scope can never both insert. A hash collision between two scopes
    only makes them wait for each other; it cannot merge them, because the lookup compares the
    real columns. The per-partition primary key remains as a safety net.

Round trips
    Primitives run on an autocommit connection: the claim (also when it finds an existing
    record, so a replay costs one statement in all), ``complete``, ``release``, ``renew`` and
    ``mark_unknown`` are each one statement with no ``BEGIN``/``COMMIT`` of their own.
    ``complete`` can instead join the caller's business transaction (no extra commit). Writes
    after the claim pass the record's ``created_at``, so that only its partition is searched.
    An atomic claim first looks for a completed record of its scope in autocommit, before the
    business transaction opens (``_FIND_COMPLETED``): a replay is that one statement, with no
    transaction, on any worker; a new key pays it as one more statement.

Kept plans
    The completion, the atomic record's insert and the lookup of a completed record are calls
    of PL/pgSQL functions (migration 0014), whose plans each server connection keeps (behind
    PgBouncer in transaction pooling too): sent as text, they were parsed and planned for
    every request, and the completion's planning cost twice its execution. On Citus the
    completions stay statements (see :attr:`PostgresStore._on_citus`).

Citus
    ``flask idem citus`` distributes the table by ``tenant`` and this function by ``p_tenant``.
    Both claims take their lock on the tenant's worker by a write there that deletes nothing
    (the atomic claim, which Citus does not delegate inside a transaction block, from migration
    0009; the durable one from 0010), so that claims through any node exclude each other, during
    a shard move too. Every other statement is a single-tenant one Citus routes to one shard, and
    none returns a non-immutable expression (``tests/store/test_citus.py`` checks both). A
    transaction that writes a record commits flushed on the node holding it (a check
    constraint, migration 0013), or a shard move by logical replication could leave the write
    behind. See ``docs/citus.md``.

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
import dataclasses
import datetime as dt
import functools
import logging
import operator
import typing as t

import sqlalchemy as sa

from ..core.errors import ConfigurationError, SchemaMissing, StoreUnavailable
from ..core.record import (
    Archive,
    ClaimResult,
    MaintenanceReport,
    Record,
    Scope,
    State,
    StoredResponse,
)
from . import commit_count, engines, fast_path
from .sql import (
    AUDIT_COLUMNS,
    Precompiled,
    SQLStore,
    StatementResult,
    build_record,
    new_token,
    record_from_row,
    translate_errors,
)
from .table import DEFAULT_PARTITION
from .table import idempotency_audit as audit_table
from .table import idempotency_keys as table

log = logging.getLogger("flask_idem")

# Sent as driver SQL: the hottest statement (every protected request) skips SQLAlchemy's
# statement compilation; psycopg2 already returns bytea, jsonb and timestamptz as Python values.
# On Citus (docs/citus.md) this exact shape is what gets delegated to the tenant's worker: one
# function in FROM, the tenant first, arguments inlined by psycopg2 as constants, and no
# transaction block around it (autocommit), where Citus would run it on the coordinator.
_CLAIM = (
    "SELECT * FROM idempotency_claim(%(tenant)s, %(endpoint)s, %(key)s, %(fingerprint)s, "
    "%(token)s, %(ttl)s, %(lease)s)"
)
# With IDEMPOTENCY_AUDIT: the same claim, and its audit row when it inserted, in one statement
# (the CTE is materialised, so the claim function runs once).
_CLAIM_AUDITED = (
    f"WITH c AS ({_CLAIM}), logged AS (INSERT INTO idempotency_audit ({', '.join(AUDIT_COLUMNS)}) "
    "SELECT clock_timestamp(), %(tenant)s, %(endpoint)s, %(a_key_hash)s, %(a_lookup)s, "
    "c.created_at, 'claimed', c.state, NULL, c.fingerprint, %(a_actor)s, %(a_detail)s "
    "FROM c WHERE c.claimed) SELECT * FROM c"
)
_AUDIT_PARTITIONS = sa.text(
    "SELECT * FROM idempotency_audit_partitions(:ahead, :retention, :dry_run)"
)
#: Monthly audit partitions kept ready after the current month.
AUDIT_MONTHS_AHEAD = 2
# The atomic claim reserves the record it would insert (migration 0007): its reservation
# inserts it, completed, in the same transaction.
_CLAIM_ATOMIC = _CLAIM.replace("idempotency_claim(", "idempotency_claim_reserve(")


def _ended(row: str) -> str:
    """When the request ended: its completion, else the end of its last lease (in progress,
    unknown or reopened), else its claim. ``row``: a table alias, or empty for none."""
    return f"coalesce({row}completed_at, {row}lease_expires_at, {row}created_at)"


def _live(row: str, clock: str) -> str:
    """Whether a record is live at ``clock``, as the claim functions decide it (migration
    0002): a TTL from the claim, or a TTL from the end of the request. The raw statements' one
    spelling of it (``row``: ``"k."``, or empty); :meth:`PostgresStore.ttl_after_end` is the
    Core one."""
    ttl = f"({row}expires_at - {row}created_at)"
    return f"({row}expires_at > {clock} OR {_ended(row)} + {ttl} > {clock})"


def _past_ttl_immutable(row: str, clock: str) -> str:
    """Whether a record is not live at ``clock``, spelled as Citus accepts on columns in a
    modification: ``clock - ended >= ttl``, interval against interval, IMMUTABLE once the
    clock is a constant (``timestamptz + interval`` is STABLE); the negation of
    :meth:`PostgresStore.ttl_after_end`'s spelling."""
    ttl = f"{row}expires_at - {row}created_at"
    return f"({row}expires_at <= {clock} AND {clock} - {_ended(row)} >= {ttl})"


# The live completed record of a scope, read without the scope's lock (migration 0014: the
# claim functions' liveness and horizon, at the function's clock, on a kept plan). Read twice
# by an atomic request:
# - before its business transaction opens, so that a replay is this one statement, with no
#   BEGIN and no ROLLBACK (with psycopg2 no statement can open a transaction only when it finds
#   nothing: the driver sends BEGIN on its own, so a new key pays this as one more statement);
# - by a claim that found the scope's lock held (the holder may only be *replaying*).
# Safe because a completed record is final while it is live (nothing but an operator's reopen
# changes it, and a claim only inserts when no live record exists): whatever a holder of the
# lock does, this answer is the one a claim serialised just before it would have had. A record
# found live here but expired for a later claim (whose clock is later) is still one that was
# live when this request looked. Anything else (no record, in progress, unknown) is left to
# the reserving claim: a new key, or "busy" (409 or a wait), as before.
_FIND_COMPLETED = "SELECT * FROM idempotency_find_completed(%(tenant)s, %(endpoint)s, %(key)s)"
#: libpq's PQTRANS_IDLE (psycopg2 and psycopg 3 ``info.transaction_status``): no transaction.
_IDLE = 0
#: Set by the reserving claim, local to its transaction: the token of the record it holds.
_RESERVED_SETTING = "flask_idem.reserved"
_CLAIM_ATOMIC_AUDITED = _CLAIM_AUDITED.replace("idempotency_claim(", "idempotency_claim_reserve(")
_CREATE_PARTITIONS = sa.text("SELECT * FROM idempotency_create_partitions(:ahead, :dry_run)")
_DROP_PARTITIONS = sa.text("SELECT * FROM idempotency_drop_expired_partitions(:dry_run)")
# Not live as idempotency_claim() (migration 0002) decides it, at the transaction's clock.
_EXPIRED = f"NOT {_live('', 'now()')}"
_COUNT_EXPIRED_DEFAULT = sa.text(f"SELECT count(*) FROM {DEFAULT_PARTITION} WHERE {_EXPIRED}")
# By primary key, not ctid: a ctid names a row within one shard only, and Citus refuses it in
# a modification with a subquery. Citus runs the batch's SELECT first (where STABLE functions
# of columns are allowed) and the DELETE on every shard after it, so the DELETE checks expiry
# again in the form Citus accepts in a modification (now() evaluated on the coordinator, the
# rest immutable); both must hold, so nothing the claim still counts live is deleted.
_PURGE_DEFAULT = sa.text(
    f"DELETE FROM {DEFAULT_PARTITION} AS d "
    "WHERE (d.tenant, d.endpoint, d.key, d.created_at) IN ("
    f"SELECT tenant, endpoint, key, created_at FROM {DEFAULT_PARTITION} WHERE {_EXPIRED} "
    f"LIMIT :batch) AND {_past_ttl_immutable('d.', 'now()')}"
)
# Partitions of idempotency_keys whose range starts after now (the name carries its start).
_PARTITIONS_AHEAD = sa.text(
    "SELECT count(*) FROM pg_inherits AS i JOIN pg_class AS c ON c.oid = i.inhrelid "
    "WHERE i.inhparent = 'idempotency_keys'::regclass "
    "AND c.relname ~ '^idempotency_keys_p[0-9]{8}$' "
    "AND to_date(substring(c.relname FROM '[0-9]{8}$'), 'YYYYMMDD') > "
    "(now() AT TIME ZONE 'UTC')::date"
)
# The partition of idempotency_keys whose range holds the clock, read from the bounds (whatever
# the granularity): none means new records land in DEFAULT.
_BOUND = r"substring(pg_get_expr(c.relpartbound, c.oid) FROM $${0} \('([^']+)'\)$$)::timestamptz"
_CURRENT_PARTITION = sa.text(
    "SELECT c.relname FROM pg_inherits AS i JOIN pg_class AS c ON c.oid = i.inhrelid "
    "WHERE i.inhparent = 'idempotency_keys'::regclass "
    f"AND {_BOUND.format('FROM')} <= now() AND now() < {_BOUND.format('TO')}"
)
# Archived partitions (an Archive configured): tables of the archive schema named like a
# partition and marked by flask_idem when it detached them, the mark holding the time. A table
# without the mark (put there by someone else) is never dropped.
_ARCHIVED_MARK = "flask_idem archived at "
_ARCHIVED_AT = (
    "substring(obj_description(c.oid, 'pg_class') "
    "FROM '^flask_idem archived at ([0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9:.]+[+-][0-9:]+)$')"
    "::timestamptz"
)
_ARCHIVED = (
    "FROM pg_class AS c JOIN pg_namespace AS n ON n.oid = c.relnamespace "
    "WHERE n.nspname = :schema AND c.relkind = 'r' "
    f"AND c.relname ~ '^idempotency_keys_p[0-9]{{8}}$' AND {_ARCHIVED_AT} IS NOT NULL"
)
_COUNT_ARCHIVED = sa.text(f"SELECT count(*) {_ARCHIVED}")
_ARCHIVED_PAST_RETENTION = sa.text(
    f"SELECT c.relname {_ARCHIVED} "
    f"AND {_ARCHIVED_AT} + make_interval(secs => :retention) <= now() ORDER BY c.relname"
)
# Still a partition, and nothing in it live: checked again under the parent's exclusive lock,
# as idempotency_drop_expired_partitions() does before a drop (a frozen owner's late renewal
# could have made a row live since the candidates were listed).
_STILL_EXPIRED = (
    "SELECT EXISTS (SELECT 1 FROM pg_inherits AS i JOIN pg_class AS c ON c.oid = i.inhrelid "
    "WHERE i.inhparent = 'idempotency_keys'::regclass AND c.relname = :name) "
    "AND NOT EXISTS (SELECT 1 FROM {partition} WHERE NOT ({expired}))"
)
#: A relation of the partition's name already in the archive schema (an operator's copy, a
#: restore): the move would fail, and with it every later run's upkeep.
_ARCHIVE_NAME_TAKEN = sa.text(
    "SELECT EXISTS (SELECT 1 FROM pg_class AS c JOIN pg_namespace AS n ON n.oid = c.relnamespace "
    "WHERE n.nspname = :schema AND c.relname = :name)"
)
#: SQLSTATE lock_not_available: lock_timeout ran out.
_LOCK_NOT_AVAILABLE = "55P03"
#: Expired rows deleted from DEFAULT per transaction.
PURGE_BATCH = 5000
#: How long upkeep waits for a lock that claims need too (claims queue behind the wait).
MAINTENANCE_LOCK_TIMEOUT = "200ms"


# The claim function's lock keys for each stored form of a key, in the order every rotating
# claim takes them (so two never wait for each other in a cycle).
_LOCK_KEYS = sa.text(
    "SELECT DISTINCT hashtext(:t || chr(31) || :e || chr(31) || k) AS h "
    "FROM unnest(CAST(:k AS text[])) AS f(k) ORDER BY h"
)
_LOCK = sa.text("SELECT pg_advisory_xact_lock(hashtext('flask_idem'), :h)::text")
_TRY_LOCK = sa.text("SELECT pg_try_advisory_xact_lock(hashtext('flask_idem'), :h)")


class _Busy(Exception):
    """An atomic claim found one of its key's locks held."""


_first_row = operator.methodcaller("fetchone")
_row_count = operator.attrgetter("rowcount")


@contextlib.contextmanager
def _isolation_explained() -> t.Iterator[None]:
    """Say why a claim refused to run, in the log: the 503 alone reads like an outage."""
    try:
        yield
    except StoreUnavailable as exc:
        if "needs READ COMMITTED" in str(exc.__cause__):
            log.error(
                "the idempotency claim refused to run outside READ COMMITTED: configure "
                "IDEMPOTENCY_ENGINE (or the database's default_transaction_isolation) for it"
            )
        raise


def _claim_parameters(
    scope: Scope, fingerprint: bytes, ttl: float, lease: float
) -> dict[str, t.Any]:
    """The claim function's arguments: ``scope`` carries the current digest of its key, and
    ``fingerprint`` is keyed (:meth:`PostgresStore._claimed`)."""
    assert scope.digest is not None
    return {
        "tenant": scope.tenant,
        "endpoint": scope.endpoint,
        "key": scope.digest,
        "fingerprint": fingerprint,
        "token": new_token(),
        "ttl": float(ttl),
        "lease": float(lease),
    }


@dataclasses.dataclass(frozen=True)
class _Reservation:
    """:class:`~flask_idem.core.record.Reservation` of :meth:`PostgresStore.claim_atomic`."""

    store: PostgresStore
    connection: sa.Connection
    record: Record

    def complete(self, response: StoredResponse | None) -> bool:
        return self.store.complete_reserved(self.connection, self.record, response)


class PostgresStore(SQLStore):
    """Store on PostgreSQL >= 13 with the schema of ``alembic upgrade head``."""

    dialect = "postgresql"

    def now(self) -> sa.ColumnElement[t.Any]:
        # The statement's own clock, not now(): that is the *transaction's* start, and a
        # completion joins a business transaction opened before the view ran, so a view that
        # ran longer than its TTL would complete into a record already dead.
        return sa.func.statement_timestamp()

    def now_plus(self, seconds: float) -> sa.ColumnElement[t.Any]:
        return self.now() + sa.func.make_interval(0, 0, 0, 0, 0, 0, float(seconds))

    def ttl_after_end(self) -> sa.ColumnElement[bool]:
        # Spelled as interval < interval: ``timestamptz + interval`` is STABLE, which Citus
        # refuses on columns in an UPDATE or DELETE (docs/citus.md); this form is IMMUTABLE
        # once the statement's clock is a constant.
        ended = sa.func.coalesce(table.c.completed_at, table.c.lease_expires_at, table.c.created_at)
        return self.now() - ended < table.c.expires_at - table.c.created_at

    def scope_hash(self) -> sa.ColumnElement[str]:
        # key_hash(): SHA-256 over tenant, endpoint and key joined by U+001F, 16 hex digits.
        separator = sa.func.chr(31, type_=sa.String)
        material = table.c.tenant + separator + table.c.endpoint + separator + table.c.key
        digest = sa.func.sha256(sa.func.convert_to(material, "UTF8", type_=sa.LargeBinary))
        return sa.func.substr(sa.func.encode(digest, "hex", type_=sa.String), 1, 16)

    @contextlib.contextmanager
    def connect(self) -> t.Iterator[sa.Connection]:
        """A pooled connection in autocommit (:class:`.fast_path.Autocommit`): no BEGIN/COMMIT round
        trips around a primitive."""
        with commit_count.store_own(), self.engine.connect() as connection:
            dbapi_connection = connection.connection.dbapi_connection
            assert dbapi_connection is not None
            try:
                with fast_path.Autocommit(dbapi_connection):
                    yield connection
            except self.engine.dialect.loaded_dbapi.Error as exc:
                # A driver error, not SQLAlchemy's: the flag could not be switched (closed, or
                # in a transaction a checkout listener opened). Fail closed (503).
                if dbapi_connection.closed:
                    connection.invalidate(exc)
                raise self._wrapped(
                    exc, None, None, invalidated=bool(dbapi_connection.closed)
                ) from exc

    def claim(self, scope: Scope, fingerprint: bytes, *, ttl: float, lease: float) -> ClaimResult:
        scope, fingerprint = self._claimed(scope, fingerprint)
        parameters = _claim_parameters(scope, fingerprint, ttl, lease)
        statement = _CLAIM
        if self.audit:
            statement = _CLAIM_AUDITED
            parameters.update(self._audit_values(scope, "claimed"))
        try:
            with _isolation_explained(), translate_errors(), engines.OneDeadline():
                if self.keys.rotating:
                    # One transaction: the locks of every stored form, then the claim (a
                    # claim left without its COMMIT rolls back: nothing can land).
                    with commit_count.store_own(), self.engine.begin() as conn:
                        found = self._previous(conn, scope, wait=True)
                        if found is not None:
                            return found
                        values = tuple(conn.exec_driver_sql(statement, parameters).one())
                else:
                    row = self._row_alone(statement, parameters)
                    if row is None:
                        raise sa.exc.NoResultFound("the claim returned no row")
                    values = row
        except StoreUnavailable as exc:
            if not self.keys.rotating and not isinstance(exc, SchemaMissing):
                # One autocommitted statement: a server silent past the deadline may still
                # run it when it wakes, and commit a claim nobody will run.
                exc.unanswered_claim = (scope, parameters["token"])
            raise
        claimed, *columns = values
        return ClaimResult(build_record(scope, self.sealer, *columns), claimed=bool(claimed))

    def _claimed(self, scope: Scope, fingerprint: bytes) -> tuple[Scope, bytes]:
        """The scope with its key's current digest, and the fingerprint keyed, as a claim
        writes them."""
        stored = self.keys.current_of(scope)
        if stored is not scope.digest:
            scope = dataclasses.replace(scope, digest=stored)
        return scope, self.keys.fingerprint(fingerprint)

    def _previous(self, conn: sa.Connection, scope: Scope, *, wait: bool) -> ClaimResult | None:
        """During a rotation: lock every stored form of the key, then find a live record
        under a form other than the current one (the claim function then looks up and
        inserts the current one under the same locks, in the same transaction).

        The locks are the claim function's own (the same two keys), taken in one order (by
        lock key) by every claim, so that a claim under any listed secret waits for this one
        and finds what it wrote. Plain PostgreSQL only: on Citus the function locks on the
        tenant's worker (docs/encryption.md).

        :param wait: False (an atomic claim): try the locks; a held one raises
            :class:`_Busy`.
        """
        forms = self.keys.candidates(scope.tenant, scope.key)
        locks = conn.execute(_LOCK_KEYS, {"t": scope.tenant, "e": scope.endpoint, "k": list(forms)})
        lock = _LOCK if wait else _TRY_LOCK
        for (lock_key,) in locks.all():
            taken = conn.execute(lock, {"h": lock_key}).scalar_one()
            if not wait and not taken:
                raise _Busy
        return self._live_among(conn, scope, forms[1:])

    def _live_among(
        self, conn: sa.Connection, scope: Scope, forms: t.Sequence[str], *, completed: bool = False
    ) -> ClaimResult | None:
        """The newest live record of ``scope`` under one of ``forms`` of its key, found (not
        claimed); only a completed one with ``completed``."""
        statement = (
            sa.select(*self._returning())
            .where(
                table.c.tenant == scope.tenant,
                table.c.endpoint == scope.endpoint,
                table.c.key.in_(forms),
                self._alive(),
            )
            .order_by(table.c.created_at.desc())
            .limit(1)
        )
        if completed:
            statement = statement.where(table.c.state == State.COMPLETED.value)
        row = conn.execute(statement).first()
        if row is None:
            return None
        return ClaimResult(record_from_row(scope, row, self.sealer), claimed=False)

    def _row_alone(self, statement: str, parameters: dict[str, t.Any]) -> tuple[t.Any, ...] | None:
        """The first row of ``statement``, run as its own transaction on a pooled connection:
        through the driver's cursor (:func:`.fast_path.autocommitted`) on the fast path."""
        if not self._fast():
            with self.connect() as conn:
                row = conn.exec_driver_sql(statement, parameters).first()
            return None if row is None else tuple(row)
        values = fast_path.autocommitted(self.engine, statement, parameters, _first_row)
        return t.cast("tuple[t.Any, ...] | None", values)

    def _send(
        self,
        statement: Precompiled,
        parameters: dict[str, t.Any],
        connection: sa.Connection | None,
    ) -> int:
        """A precompiled write (the completion, a release) through the driver's cursor, in
        ``connection``'s transaction or on its own: SQLAlchemy's execution of it was a tenth
        of a new key's Python calls, for a statement whose row count is all that is read."""
        if not self._fast() or not (connection is None or connection.in_transaction()):
            # A view that ended idem.connection()'s transaction itself (commit as you go):
            # SQLAlchemy begins the next one, which the completion then commits with.
            return super()._send(statement, parameters, connection)
        with translate_errors(), engines.OneDeadline():
            bound = statement.parameters(parameters)
            if connection is None:
                sent = fast_path.autocommitted(self.engine, statement.sql, bound, _row_count)
                return t.cast(int, sent)
            pooled = connection.connection
            sent = fast_path.on_cursor(
                self.engine, pooled, connection, statement.sql, bound, _row_count
            )
            return t.cast(int, sent)

    def _fast(self) -> bool:
        """Whether statements go on the driver's cursor (:mod:`.fast_path`): the switch is on
        and nothing watches the engine's statements."""
        return self.fast_path and not fast_path.observed(self.engine)

    def _wrapped(
        self,
        exc: BaseException,
        statement: str | None,
        parameters: dict[str, t.Any] | None,
        *,
        invalidated: bool,
    ) -> sa.exc.DBAPIError:
        return fast_path.dbapi_error(
            self.engine, exc, statement, parameters, invalidated=invalidated
        )

    def claim_atomic(
        self, connection: sa.Connection, scope: Scope, fingerprint: bytes, *, ttl: float
    ) -> ClaimResult | None:
        dbapi_connection = connection.connection.dbapi_connection
        if getattr(dbapi_connection, "autocommit", False):
            # Each statement would be its own transaction: the claim's lock and its row would
            # be gone before the view's writes, and a duplicate could run the view again.
            raise ConfigurationError(
                "an atomic view needs a real transaction: the business connection is in "
                "autocommit (IDEMPOTENCY_ENGINE with isolation_level='AUTOCOMMIT'?)"
            )
        commit_count.resynchronise(dbapi_connection)
        scope, fingerprint = self._claimed(scope, fingerprint)
        parameters = _claim_parameters(scope, fingerprint, ttl, lease=0)
        statement = _CLAIM_ATOMIC
        if self.audit:
            # The audit row commits with the claim, that is with the business transaction.
            statement = _CLAIM_ATOMIC_AUDITED
            parameters.update(self._audit_values(scope, "claimed"))
        with _isolation_explained(), translate_errors():
            if self.keys.rotating:
                try:
                    found = self._previous(connection, scope, wait=False)
                except _Busy:
                    # As _FIND_COMPLETED, under every form: a completed record is final.
                    forms = self.keys.candidates(scope.tenant, scope.key)
                    return self._live_among(connection, scope, forms, completed=True)
                if found is not None:
                    return found
            values = self._atomic_row(connection, statement, parameters)
            if values is None:
                # The scope's lock is held: a duplicate is running, or only replaying a
                # completed record, which this request may replay too (see _FIND_COMPLETED).
                values = self._atomic_row(connection, _FIND_COMPLETED, parameters)
                if values is None:
                    return None
        claimed, *columns = values
        record = build_record(scope, self.sealer, *columns)
        if not claimed:
            return ClaimResult(record, claimed=False)
        reservation = _Reservation(self, connection, record)
        return ClaimResult(record, claimed=True, reservation=reservation)

    def completed_before_claim(self, scope: Scope, connection: sa.Connection) -> Record | None:
        dbapi_connection: t.Any = connection.connection.dbapi_connection
        with translate_errors():
            commit_count.resynchronise(dbapi_connection)  # a hook's COMMIT sent as SQL
            if dbapi_connection.info.transaction_status != _IDLE:
                return None  # a hook's transaction: the claim in it answers, as it would have
            try:
                with fast_path.Autocommit(dbapi_connection):
                    return self._live_completed(connection, scope)
            except self.engine.dialect.loaded_dbapi.Error as exc:
                # The driver refused to leave autocommit (see fast_path.Autocommit).
                connection.invalidate(exc)
                raise fast_path.dbapi_error(self.engine, exc, None, None, invalidated=True) from exc

    def _live_completed(self, connection: sa.Connection, scope: Scope) -> Record | None:
        """:data:`_FIND_COMPLETED` for ``scope`` (while secrets rotate: under every form of its
        key), on ``connection`` as it is."""
        if self.keys.rotating:
            forms = self.keys.candidates(scope.tenant, scope.key)
            found = self._live_among(connection, scope, forms, completed=True)
            return None if found is None else found.record
        digest = self.keys.current_of(scope)
        if digest is not scope.digest:
            scope = dataclasses.replace(scope, digest=digest)
        parameters = {"tenant": scope.tenant, "endpoint": scope.endpoint, "key": digest}
        values = self._atomic_row(connection, _FIND_COMPLETED, parameters)
        if values is None:
            return None
        return build_record(scope, self.sealer, *values[1:])

    def _atomic_row(
        self, connection: sa.Connection, statement: str, parameters: dict[str, t.Any]
    ) -> tuple[t.Any, ...] | None:
        """The first row of an atomic claim's statement, in the business transaction."""
        if not self._fast():
            row = connection.exec_driver_sql(statement, parameters).first()
            return None if row is None else tuple(row)
        pooled = connection.connection
        return t.cast(
            "tuple[t.Any, ...] | None",
            fast_path.on_cursor(self.engine, pooled, connection, statement, parameters, _first_row),
        )

    @functools.cached_property
    def _insert_completed_statement(self) -> Precompiled:
        """The reserved record, completed (the columns the claim and the completion write),
        inserted only by the transaction that reserved it (migration 0007)."""
        timestamp = table.c.created_at.type
        token = sa.bindparam("p_token", type_=table.c.claim_token.type)
        values = {
            "tenant": sa.bindparam("p_tenant", type_=table.c.tenant.type),
            "endpoint": sa.bindparam("p_endpoint", type_=table.c.endpoint.type),
            "key": sa.bindparam("p_key", type_=table.c.key.type),
            "fingerprint": sa.bindparam("p_fingerprint", type_=table.c.fingerprint.type),
            "state": sa.bindparam("p_state", type_=table.c.state.type),
            "claim_token": token,
            "response_status": sa.bindparam("p_status", type_=table.c.response_status.type),
            "response_headers": sa.bindparam("p_headers", type_=table.c.response_headers.type),
            "response_body": sa.bindparam("p_body", type_=table.c.response_body.type),
            "created_at": sa.bindparam("p_created_at", type_=timestamp),
            "completed_at": self.now(),
            "expires_at": sa.bindparam("p_expires_at", type_=timestamp),
        }
        holder = sa.func.current_setting(_RESERVED_SETTING, True) == token
        rows = sa.select(*values.values()).where(holder)
        insert = table.insert().from_select(list(values), rows)
        if self._on_citus:
            return Precompiled(insert, self.engine.dialect)
        # Sent as the call of migration 0014's function: the same INSERT, on a kept plan.
        call = sa.select(
            sa.func.idempotency_complete_reserved(
                *(values[name] for name in ("tenant", "endpoint", "key", "fingerprint")),
                token,
                values["created_at"],
                values["expires_at"],
                *(values[name] for name in ("state", "response_status", "response_headers")),
                values["response_body"],
            )
        )
        return Precompiled(insert, self.engine.dialect, sent=call)

    @property
    def _on_citus(self) -> bool:
        """Whether Citus is loaded (:meth:`_learn_citus` read it): there the writes go as
        statements, not as calls of migration 0014's functions. Citus commits a write made
        inside a function with the business transaction's other writes in one phase (no
        two-phase commit when the business row is in a local table of the coordinator), where
        the same write sent as a statement commits in two."""
        if self._citus is None:
            self._learn_citus(None)
        return bool(self._citus)

    _citus: bool | None = None

    def _learn_citus(self, connection: sa.Connection | None) -> None:
        """Once per store, at its first completion: what its connection learnt when it was
        opened (:func:`.engines.remember_citus`), else read on it. The completion's own
        connection when it has one: a second one taken while a request holds one could wait
        for the pool."""
        if self._citus is not None:
            return
        with translate_errors(), contextlib.ExitStack() as stack:
            if connection is None:
                connection = stack.enter_context(self.connect())
            known = connection.connection.info.get(engines.CITUS_LOADED)
            if known is None:
                known = connection.exec_driver_sql(engines.CITUS_VERSION).scalar() is not None
        self._citus = bool(known)

    def complete(
        self,
        scope: Scope,
        token: str,
        response: StoredResponse | None,
        *,
        connection: sa.Connection | None = None,
        created_at: dt.datetime | None = None,
    ) -> bool:
        self._learn_citus(connection)
        return super().complete(
            scope, token, response, connection=connection, created_at=created_at
        )

    def _complete_call(self) -> sa.Select[t.Any] | None:
        # Migration 0014's function: the same UPDATE, on a plan the server connection keeps.
        if self._on_citus:
            return None
        timestamp = table.c.created_at.type
        return sa.select(
            sa.func.idempotency_complete(
                sa.bindparam("p_tenant", type_=table.c.tenant.type),
                sa.bindparam("p_endpoint", type_=table.c.endpoint.type),
                sa.bindparam("p_key", type_=table.c.key.type),
                sa.bindparam("p_token", type_=table.c.claim_token.type),
                sa.bindparam("p_created_at", type_=timestamp),
                sa.bindparam("p_state", type_=table.c.state.type),
                sa.bindparam("p_status", type_=table.c.response_status.type),
                sa.bindparam("p_headers", type_=table.c.response_headers.type),
                sa.bindparam("p_body", type_=table.c.response_body.type),
            )
        )

    def complete_reserved(
        self, connection: sa.Connection, record: Record, response: StoredResponse | None
    ) -> bool:
        """Insert the record :meth:`claim_atomic` reserved, completed with ``response``, into
        ``connection``'s transaction, if it is still the one that reserved it (see
        :class:`~flask_idem.core.record.Reservation`)."""
        self._learn_citus(connection)
        scope = record.scope
        parameters = {
            "p_tenant": scope.tenant,
            "p_endpoint": scope.endpoint,
            "p_key": self._stored_key(scope),
            "p_fingerprint": record.fingerprint,
            "p_token": record.claim_token,
            "p_created_at": record.created_at,
            "p_expires_at": record.expires_at,
            **self._completion(scope, response, record.created_at),
        }
        event = "unstored" if response is None else "completed"
        result = self._write(
            self._insert_completed_statement, parameters, connection, scope=scope, event=event
        )
        return result.rowcount == 1

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
        if self.archive is None:
            # Claims wait behind the drop's exclusive lock: give up quickly, retry next run.
            dropped = self._maintenance_step(_DROP_PARTITIONS, dry_run=dry_run)
            report = MaintenanceReport(tuple(created), tuple(dropped), purged, dry_run)
        else:
            report = MaintenanceReport(
                tuple(created),
                (),
                purged,
                dry_run,
                archived=tuple(self._archive_expired(self.archive, dry_run)),
                archive_dropped=tuple(self._drop_archived(self.archive, dry_run)),
            )
        return self._maintain_audit(report) if self.audit else report

    def _archive_expired(self, archive: Archive, dry_run: bool) -> list[str]:
        """Detach into the archive schema the partitions the drop would drop.

        The candidates are the drop function's own (listed by its dry run); each moves in a
        transaction of its own, under the lock order the drop uses (flask_idem's maintenance
        lock, then the parent table), so claims wait behind at most one short detach.
        """
        candidates = self._maintenance_step(_DROP_PARTITIONS, dry_run=True)
        if dry_run or not candidates:
            return candidates
        quote = self.engine.dialect.identifier_preparer.quote
        schema = quote(archive.schema)
        with translate_errors(), self.engine.begin() as conn:
            conn.exec_driver_sql(f"CREATE SCHEMA IF NOT EXISTS {schema}")
        archived = []
        for name in candidates:
            partition = quote(name)
            still_expired = sa.text(_STILL_EXPIRED.format(partition=partition, expired=_EXPIRED))
            try:
                with translate_errors(), self.engine.begin() as conn:
                    conn.exec_driver_sql(f"SET LOCAL lock_timeout = '{MAINTENANCE_LOCK_TIMEOUT}'")
                    conn.exec_driver_sql("SELECT pg_advisory_xact_lock(hashtext('flask_idem'), 0)")
                    conn.exec_driver_sql("LOCK TABLE idempotency_keys IN ACCESS EXCLUSIVE MODE")
                    if not conn.execute(still_expired, {"name": name}).scalar_one():
                        continue
                    taken = {"schema": archive.schema, "name": name}
                    if conn.execute(_ARCHIVE_NAME_TAKEN, taken).scalar_one():
                        log.warning(
                            "partition %s stays attached (nothing lost): %s.%s already exists; "
                            "rename or drop that table for the partition to be archived",
                            name,
                            archive.schema,
                            name,
                        )
                        continue
                    archived_at = conn.execute(sa.text("SELECT now()")).scalar_one()
                    conn.exec_driver_sql(
                        f"ALTER TABLE idempotency_keys DETACH PARTITION {partition}"
                    )
                    conn.exec_driver_sql(f"ALTER TABLE {partition} SET SCHEMA {schema}")
                    # A literal (COMMENT takes no parameters) of flask_idem's own timestamp.
                    mark = f"{_ARCHIVED_MARK}{archived_at.isoformat()}"
                    conn.exec_driver_sql(f"COMMENT ON TABLE {schema}.{partition} IS '{mark}'")
            except StoreUnavailable as exc:
                if _sqlstate(exc) != _LOCK_NOT_AVAILABLE:
                    raise
                continue  # the table stayed busy: the partition is archived next run
            archived.append(name)
        return archived

    def _drop_archived(self, archive: Archive, dry_run: bool) -> list[str]:
        """Drop the archived partitions kept for the archive's retention since detached."""
        parameters = {"schema": archive.schema, "retention": archive.retention}
        with translate_errors(), self.engine.connect() as conn:
            due = list(conn.execute(_ARCHIVED_PAST_RETENTION, parameters).scalars())
        if dry_run:
            return due
        quote = self.engine.dialect.identifier_preparer.quote
        for name in due:
            with translate_errors(), self.engine.begin() as conn:
                conn.exec_driver_sql(f"SET LOCAL lock_timeout = '{MAINTENANCE_LOCK_TIMEOUT}'")
                conn.exec_driver_sql(f"DROP TABLE IF EXISTS {quote(archive.schema)}.{quote(name)}")
        return due

    def archived_partitions(self) -> int | None:
        if self.archive is None:
            return None
        with translate_errors(), self.engine.connect() as conn:
            return int(conn.execute(_COUNT_ARCHIVED, {"schema": self.archive.schema}).scalar_one())

    def _maintain_audit(self, report: MaintenanceReport) -> MaintenanceReport:
        """Monthly audit partitions ahead; whole months past the retention dropped (rows of
        DEFAULT past it deleted): the only deletes the audit table ever sees."""
        done: dict[str, list[str]] = {"created": [], "dropped": [], "purged": []}
        for action_and_name in self._maintenance_step(
            _AUDIT_PARTITIONS,
            ahead=AUDIT_MONTHS_AHEAD,
            retention=self.audit_retention,
            dry_run=report.dry_run,
        ):
            action, _, name = action_and_name.partition(" ")
            done[action].append(name)
        return dataclasses.replace(
            report,
            audit_created=tuple(done["created"]),
            audit_dropped=tuple(done["dropped"]),
            audit_purged=sum(int(n) for n in done["purged"]),
        )

    def _audited(
        self,
        conn: sa.Connection,
        statement: sa.UpdateBase,
        parameters: dict[str, t.Any],
        deleted: bool,
    ) -> StatementResult:
        # WITH changed AS (<write> RETURNING ...), logged AS (INSERT INTO idempotency_audit
        # SELECT ... FROM changed) SELECT * FROM changed: one statement, one round trip.
        changed = statement.cte("changed")
        rows = sa.select(
            sa.func.clock_timestamp(),
            sa.bindparam("a_tenant", type_=sa.String),
            sa.bindparam("a_endpoint", type_=sa.String),
            sa.bindparam("a_key_hash", type_=sa.String),
            sa.bindparam("a_lookup", type_=sa.LargeBinary),
            changed.c.created_at,
            sa.bindparam("a_event", type_=sa.String),
            sa.null() if deleted else changed.c.state,
            changed.c.response_status,
            changed.c.fingerprint,
            sa.bindparam("a_actor", type_=sa.String),
            sa.bindparam("a_detail", type_=sa.String),
        ).select_from(changed)
        logged = audit_table.insert().from_select(list(AUDIT_COLUMNS), rows).cte("logged")
        found = list(conn.execute(sa.select(changed).add_cte(logged), parameters).all())
        return StatementResult(found, len(found))

    def partitions_ahead(self) -> int | None:
        with translate_errors(), self.engine.connect() as conn:
            return int(conn.execute(_PARTITIONS_AHEAD).scalar_one())

    def current_partition(self) -> str | None:
        """The partition that receives the records claimed now; None when they go to DEFAULT
        (upkeep fell behind: ``flask idem maintain``)."""
        with translate_errors(), self.engine.connect() as conn:
            return conn.execute(_CURRENT_PARTITION).scalar()

    def _maintenance_step(self, statement: sa.TextClause, **parameters: t.Any) -> list[str]:
        with translate_errors(), self.engine.begin() as conn:
            # Partition DDL waits for running claims, and claims queue behind a waiting DDL
            # lock: never make them wait long; a partition left out is taken next run.
            conn.exec_driver_sql(f"SET LOCAL lock_timeout = '{MAINTENANCE_LOCK_TIMEOUT}'")
            return list(conn.execute(statement, parameters).scalars())


def _sqlstate(exc: BaseException) -> str | None:
    """The SQLSTATE behind a wrapped database error, or None (``diag.sqlstate``: psycopg2 and
    psycopg 3 both have it)."""
    driver_error = getattr(exc.__cause__, "orig", None)
    return getattr(getattr(driver_error, "diag", None), "sqlstate", None)
