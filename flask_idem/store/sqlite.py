"""SQLite store for development and tests: one plain table, claims under ``BEGIN IMMEDIATE``.

SQLite has one writer at a time. Every primitive opens its transaction with ``BEGIN IMMEDIATE``,
which takes the write lock before the lookup, so a claim's lookup and insert cannot interleave
with another claim's, in this process or another one. Expired rows are purged by
:meth:`SQLiteStore.maintain`; until then they never block a claim.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import typing as t

import sqlalchemy as sa

from ..core.idempotency_keys import key_hash
from ..core.record import ClaimResult, MaintenanceReport, Scope, State
from . import commit_count
from .sql import SQLStore, StatementResult, new_token, record_from_row, translate_errors
from .table import idempotency_audit as audit_table
from .table import idempotency_keys as table

# The database clock, in the text layout SQLAlchemy uses for DateTime on SQLite (so that string
# comparison is time comparison): microseconds padded from SQLite's milliseconds.
_CLOCK = "strftime('%Y-%m-%d %H:%M:%f', {now}{modifier}) || '000'"
#: What the clock reads: SQLite's own, unless a test gave the store one (``use_clock``).
_SQLITE_NOW = "'now'"
#: The SQL function each connection gets for a clock given with ``use_clock``.
_CLOCK_FUNCTION = "flask_idem_clock"
#: The SQL function each connection gets for :func:`flask_idem.core.idempotency_keys.key_hash`.
_SCOPE_HASH = "flask_idem_key_hash"


#: The statements :class:`~flask_idem.store.sql.SQLStore` compiles once (with the clock).
_COMPILED = ("_complete_statement", "_release_statement", "_unknown_statement")


def configure_engine(engine: sa.Engine) -> None:
    """Make every transaction on ``engine`` a ``BEGIN IMMEDIATE`` one and wait on busy locks.

    pysqlite's own transaction handling issues a deferred ``BEGIN`` only before DML, so a read
    followed by a write could interleave with another writer. The standard SQLAlchemy recipe
    switches it off and lets the engine's ``begin`` event take the write lock up front.
    """
    if sa.event.contains(engine, "begin", _begin_immediate):
        return
    sa.event.listen(engine, "connect", _on_connect)
    sa.event.listen(engine, "begin", _begin_immediate)


def _on_connect(dbapi_connection: t.Any, _record: t.Any) -> None:
    dbapi_connection.isolation_level = None
    # SQLite has no SHA-256 of its own: lookups by key hash call Python's (SQLiteStore.scope_hash).
    dbapi_connection.create_function(_SCOPE_HASH, 3, _scope_hash, deterministic=True)
    # No PRAGMA busy_timeout: pysqlite's ``timeout`` (5 s by default, the statement timeout of
    # flask_idem's engines) already bounds lock waits. It must stay well below a server's
    # worker timeout (gunicorn: 30 s), or a locked file kills the worker before the 503.
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode = WAL")
    cursor.close()


def _scope_hash(tenant: str, endpoint: str, key: str) -> str:
    return key_hash(Scope(tenant, endpoint, key))


def _begin_immediate(connection: sa.Connection) -> None:
    connection.exec_driver_sql("BEGIN IMMEDIATE")


class SQLiteStore(SQLStore):
    """Store on an SQLite file (the embedded development default)."""

    dialect = "sqlite"

    def __init__(self, engine: sa.Engine) -> None:
        super().__init__(engine)
        configure_engine(engine)
        self._now = _SQLITE_NOW

    def use_clock(self, clock: t.Callable[[], dt.datetime]) -> None:
        """Read the time from ``clock`` (timezone-aware, UTC) instead of SQLite's, so that a test
        moves every record through time at once and replays the same run exactly (the
        interleaving explorer, ``tests/explore``). Called before the store's first statement:
        the statements the store compiles once carry the clock they were built with.

        :raises RuntimeError: the store already built a statement on SQLite's clock.
        """
        if any(name in self.__dict__ for name in _COMPILED):
            raise RuntimeError("use_clock() comes before the store's first statement")

        def read() -> str:
            return clock().astimezone(dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]

        def register(dbapi_connection: t.Any, _record: t.Any) -> None:
            dbapi_connection.create_function(_CLOCK_FUNCTION, 0, read)

        sa.event.listen(self.engine, "connect", register)
        self.engine.dispose()  # pooled connections lack the function
        self._now = f"{_CLOCK_FUNCTION}()"

    def now(self) -> sa.ColumnElement[t.Any]:
        return sa.literal_column(_CLOCK.format(now=self._now, modifier=""), sa.String)

    def now_plus(self, seconds: float) -> sa.ColumnElement[t.Any]:
        modifier = f", '{float(seconds):+f} seconds'"
        return sa.literal_column(_CLOCK.format(now=self._now, modifier=modifier))

    def ttl_after_end(self) -> sa.ColumnElement[bool]:
        julianday = sa.func.julianday
        ended = sa.func.coalesce(table.c.completed_at, table.c.lease_expires_at, table.c.created_at)
        return julianday(ended) + julianday(table.c.expires_at) - julianday(
            table.c.created_at
        ) > julianday(sa.literal_column(self._now))

    def scope_hash(self) -> sa.ColumnElement[str]:
        return sa.Function(
            _SCOPE_HASH, table.c.tenant, table.c.endpoint, table.c.key, type_=sa.String
        )

    @contextlib.contextmanager
    def connect(self) -> t.Iterator[sa.Connection]:
        with commit_count.store_own(), self.engine.begin() as connection:
            yield connection

    def claim(self, scope: Scope, fingerprint: bytes, *, ttl: float, lease: float) -> ClaimResult:
        with translate_errors(), self.connect() as conn:
            return self._claim(conn, scope, fingerprint, ttl=ttl, lease=lease)

    def claim_atomic(
        self, connection: sa.Connection, scope: Scope, fingerprint: bytes, *, ttl: float
    ) -> ClaimResult | None:
        # The caller's BEGIN IMMEDIATE already holds SQLite's one write lock: a duplicate
        # waits for it (the busy timeout), then finds this record committed. Never busy here.
        with translate_errors():
            return self._claim(connection, scope, fingerprint, ttl=ttl, lease=0)

    def _claim(
        self, conn: sa.Connection, scope: Scope, fingerprint: bytes, *, ttl: float, lease: float
    ) -> ClaimResult:
        # Every stored form of the key (a rotation lists several) under BEGIN IMMEDIATE, the
        # one write lock: the lookup and the insert are atomic whatever the secrets.
        live = (
            sa.select(*self._returning())
            .where(self._live(scope))
            .order_by(table.c.created_at.desc())
            .limit(1)
        )
        row = conn.execute(live).first()
        if row is not None:
            return ClaimResult(record_from_row(scope, row, self.sealer), claimed=False)
        # The key and the fingerprint as stored (docs/encryption.md): never the raw key.
        insert = table.insert().values(
            tenant=scope.tenant,
            endpoint=scope.endpoint,
            key=self.keys.stored(scope.tenant, scope.key),
            fingerprint=self.keys.fingerprint(fingerprint),
            state=State.IN_PROGRESS.value,
            claim_token=new_token(),
            lease_expires_at=self.now_plus(lease),
            created_at=self.now(),
            expires_at=self.now_plus(ttl),
        )
        row = conn.execute(insert.returning(*self._returning())).one()
        if self.audit:
            self._append_audit(conn, self._audit_values(scope, "claimed"), [row], False)
        return ClaimResult(record_from_row(scope, row, self.sealer), claimed=True)

    def maintain(self, *, ahead: int, dry_run: bool = False) -> MaintenanceReport:
        expired = sa.not_(self._alive())
        with translate_errors(), self.connect() as conn:
            count = _purge(conn, table, expired, dry_run)
            audited = 0
            if self.audit and self.audit_retention is not None:
                # Retention: the only delete the audit table ever sees.
                cut = audit_table.c.occurred_at < self.now_plus(-self.audit_retention)
                audited = _purge(conn, audit_table, cut, dry_run)
        return MaintenanceReport(purged=count, dry_run=dry_run, audit_purged=audited)

    def _audited(
        self,
        conn: sa.Connection,
        statement: sa.UpdateBase,
        parameters: dict[str, t.Any],
        deleted: bool,
    ) -> StatementResult:
        # SQLite has no data-modifying CTEs: the audit rows follow in the same transaction.
        rows = list(conn.execute(statement, parameters).all())
        if rows:
            self._append_audit(conn, parameters, rows, deleted)
        return StatementResult(rows, len(rows))

    def _append_audit(
        self, conn: sa.Connection, values: dict[str, t.Any], rows: list[t.Any], deleted: bool
    ) -> None:
        conn.execute(
            audit_table.insert().values(occurred_at=self.now()),
            [
                {
                    "tenant": values["a_tenant"],
                    "endpoint": values["a_endpoint"],
                    "key_hash": values["a_key_hash"],
                    "lookup": values["a_lookup"],
                    "record_created_at": row.created_at,
                    "event": values["a_event"],
                    "state": None if deleted else row.state,
                    "status": row.response_status,
                    "fingerprint": row.fingerprint,
                    "actor": values["a_actor"],
                    "detail": values["a_detail"],
                }
                for row in rows
            ],
        )


def _purge(
    conn: sa.Connection, target: sa.Table, where: sa.ColumnElement[bool], dry_run: bool
) -> int:
    if dry_run:
        statement = sa.select(sa.func.count()).select_from(target).where(where)
        return int(conn.execute(statement).scalar_one())
    return int(conn.execute(target.delete().where(where)).rowcount)
