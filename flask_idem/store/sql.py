"""SQLAlchemy Core implementation of the primitives both dialects share.

Dialects differ only where :class:`SQLStore`'s abstract methods say: how a primitive gets its
connection (autocommit on PostgreSQL, ``BEGIN IMMEDIATE`` on SQLite), how "now" is spelled
(always the database clock, never the application's), how the TTL counted from a request's end
is compared (``ttl_after_end``), how a row's key hash is computed (``scope_hash``: SQL on
PostgreSQL, a Python function registered on SQLite), how a write appends its audit rows
(``_audited``: one statement on PostgreSQL, a second one in the same transaction on SQLite),
and the claim and maintenance, which live in the dialect modules.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import datetime as dt
import functools
import logging
import secrets
import typing as t

import sqlalchemy as sa

from ..core.errors import SchemaMissing, StoreUnavailable, UnreadableResponse
from ..core.idempotency_keys import key_hash
from ..core.record import ClaimResult, Health, KeyUsage, Record, Scope, State, StoredResponse
from ..core.scopes import PRINCIPAL_PREFIX, split
from ..core.sealing import KEY_ID_OFFSET, KEY_ID_SIZE, MAGIC, Sealer, key_id_of
from . import engines, trail
from .base import Store
from .table import idempotency_audit as audit_table
from .table import idempotency_keys as table
from .trail import AuditEntry

#: Columns read back for a record, in a fixed order shared with the claim function.
RECORD_COLUMNS: tuple[str, ...] = (
    "fingerprint",
    "state",
    "claim_token",
    "lease_expires_at",
    "response_status",
    "response_headers",
    "response_body",
    "created_at",
    "completed_at",
    "expires_at",
)

#: The record's columns an audit row is made of; every audited write returns them.
AUDIT_SOURCE: tuple[str, ...] = ("fingerprint", "state", "response_status", "created_at")
#: The audit row's columns, in the order audited writes fill them.
AUDIT_COLUMNS: tuple[str, ...] = (
    "occurred_at",
    "tenant",
    "endpoint",
    "key_hash",
    "lookup",
    "record_created_at",
    "event",
    "state",
    "status",
    "fingerprint",
    "actor",
    "detail",
)

#: Reads every layout (plain, compressed, encrypted with a configured key).
_READER = Sealer()

log = logging.getLogger("flask_idem")


#: PostgreSQL's SQLSTATEs for a statement naming what the database lacks: undefined_table,
#: undefined_function (also a function whose arguments changed), undefined_column.
_UNDEFINED = frozenset({"42P01", "42883", "42703"})
#: How SQLite's messages for the same begin.
_SQLITE_UNDEFINED = ("no such table:", "no such column:")


@contextlib.contextmanager
def translate_errors() -> t.Iterator[None]:
    """Re-raise every database failure as ``StoreUnavailable``: callers fail closed on it.

    A statement that failed on a missing table, function or column raises
    :class:`SchemaMissing` and logs how to migrate: a database never migrated, or not since
    flask_idem was upgraded, would otherwise look like an outage.
    """
    try:
        yield
    except sa.exc.SQLAlchemyError as exc:
        reason = _undefined(exc)
        if reason is None:
            raise StoreUnavailable(f"idempotency store failed: {type(exc).__name__}") from exc
        missing = SchemaMissing(reason)
        log.error("%s", missing)
        raise missing from exc


def _undefined(exc: sa.exc.SQLAlchemyError) -> str | None:
    """What the failed statement found missing, in the database's words, or None.

    Only the server's primary message: it names a table, function or column, never a value
    (the full error carries the statement).
    """
    driver_error = getattr(exc, "orig", None)
    if getattr(driver_error, "pgcode", None) in _UNDEFINED:
        return str(driver_error.diag.message_primary)  # type: ignore[union-attr]
    if isinstance(exc, sa.exc.OperationalError) and str(driver_error).startswith(_SQLITE_UNDEFINED):
        return str(driver_error)
    return None


def _aware(value: dt.datetime | None) -> dt.datetime | None:
    # SQLite hands back naive datetimes; they are UTC because the store wrote them from UTC.
    if value is not None and value.tzinfo is None:
        return value.replace(tzinfo=dt.timezone.utc)
    return value


def record_from_row(
    scope: Scope | None, row: t.Any, sealer: Sealer = _READER, now: dt.datetime | None = None
) -> Record:
    """Build a :class:`Record` from a row carrying ``RECORD_COLUMNS`` and ``db_now`` (and the
    scope columns when ``scope`` is None).

    A stored response that ``sealer`` cannot open (key not configured, authentication failed)
    leaves ``response`` None and says why in ``unreadable``: reading the record still works
    (for 422, the CLI and the inspection view); only a replay is refused.

    :param now: the database clock, when the row could not carry ``db_now``.
    """
    m = row._mapping
    if scope is None:
        scope = Scope(m["tenant"], m["endpoint"], m["key"], digest=m["key"])
    elif "key" in m:
        scope = dataclasses.replace(scope, digest=m["key"])
    now = _aware(m["db_now"]) if now is None else now
    assert now is not None
    names = ("lease_expires_at", "created_at", "completed_at", "expires_at")
    damaged = [name for name in names if not isinstance(m[name], dt.datetime | None)]
    stamps = {name: now if name in damaged else _aware(m[name]) for name in names}
    record = build_record(
        scope,
        sealer,
        m["fingerprint"],
        m["state"],
        m["claim_token"],
        stamps["lease_expires_at"],
        m["response_status"],
        m["response_headers"],
        m["response_body"],
        stamps["created_at"],
        stamps["completed_at"],
        stamps["expires_at"],
        now,
    )
    if not damaged:
        return record
    reason = f"the row's {', '.join(damaged)} holds no timestamp"
    return dataclasses.replace(record, damaged=reason, unreadable=record.unreadable or reason)


def build_record(
    scope: Scope,
    sealer: Sealer,
    fingerprint: bytes,
    state: str,
    claim_token: str | None,
    lease_expires_at: dt.datetime | None,
    response_status: int | None,
    response_headers: t.Any,
    response_body: bytes | None,
    created_at: dt.datetime | None,
    completed_at: dt.datetime | None,
    expires_at: dt.datetime | None,
    now: dt.datetime | None,
) -> Record:
    """A :class:`Record` from its column values in ``RECORD_COLUMNS`` order, then the
    database clock (timestamps timezone-aware), opening the stored response with
    ``sealer`` (see :func:`record_from_row`)."""
    assert created_at is not None and expires_at is not None and now is not None
    response = None
    unreadable = None
    if response_status is not None and response_body is not None:
        try:
            if not isinstance(response_body, bytes | bytearray | memoryview):
                # SQLite stores whatever a statement wrote, text included.
                raise UnreadableResponse("the stored body is not bytes")
            response = sealer.open(
                scope, created_at, response_status, response_headers, bytes(response_body)
            )
        except UnreadableResponse as exc:
            unreadable = exc.reason
    elif state == State.COMPLETED.value:
        # Every completion writes both: a completed row without them was altered.
        unreadable = "the stored status or body is missing"
    return Record(
        scope=scope,
        fingerprint=bytes(fingerprint),
        state=State(state),
        claim_token=claim_token,
        lease_expires_at=lease_expires_at,
        response=response,
        created_at=created_at,
        completed_at=completed_at,
        expires_at=expires_at,
        now=now,
        unreadable=unreadable,
    )


def _endpoints_of(tenant: str) -> sa.CTE:
    """The endpoints ``tenant`` has records on (and a last NULL), read off the primary key
    (tenant, endpoint, key, created_at) one index probe each: a loose index scan, which
    PostgreSQL 15 does not plan by itself. A lookup by key without an endpoint then probes the
    primary key with (tenant, endpoint, key) once per endpoint, and no second index on
    (tenant, key) is written with every new key (migration 0012)."""
    first = sa.select(sa.func.min(table.c.endpoint).label("endpoint")).where(
        table.c.tenant == tenant
    )
    endpoints = first.cte("endpoints", recursive=True)
    later = table.alias("later")
    following = (
        sa.select(sa.func.min(later.c.endpoint))
        .where(later.c.tenant == tenant, later.c.endpoint > endpoints.c.endpoint)
        .scalar_subquery()
    )
    return endpoints.union_all(sa.select(following).where(endpoints.c.endpoint.is_not(None)))


class SQLStore(Store):
    """Primitives shared by PostgreSQL and SQLite, written once in SQLAlchemy Core."""

    @abc.abstractmethod
    def now(self) -> sa.ColumnElement[t.Any]:
        """The database clock as a SQL expression."""

    @abc.abstractmethod
    def now_plus(self, seconds: float) -> sa.ColumnElement[t.Any]:
        """The database clock plus ``seconds``."""

    @abc.abstractmethod
    def connect(self) -> t.ContextManager[sa.Connection]:
        """A connection for one primitive; it commits when the block exits."""

    @abc.abstractmethod
    def ttl_after_end(self) -> sa.ColumnElement[bool]:
        """True while the record's TTL, counted from the end of its request, has not passed.

        The end is ``completed_at`` (completed or unstored records) or ``lease_expires_at``
        (in progress: when the lease runs out; unknown or reopened: when that was decided);
        the TTL is ``expires_at - created_at``, as set by the claim.
        """

    def _db_now(self) -> sa.ColumnElement[t.Any]:
        return sa.type_coerce(self.now(), sa.DateTime(timezone=True)).label("db_now")

    def _returning(self) -> list[sa.ColumnElement[t.Any]]:
        # The key as stored: the record's scope carries it (which digest, during a rotation).
        return [table.c[name] for name in RECORD_COLUMNS] + [self._db_now(), table.c.key]

    def _stored_key(self, scope: Scope) -> str:
        """The key of ``scope``'s record as stored: the digest the scope carries (the store
        set it on the record the claim returned), else the current digest."""
        if scope.digest is not None:
            return scope.digest
        return self.keys.candidates(scope.tenant, scope.key)[0]

    def _keys_of(self, scope: Scope) -> sa.ColumnElement[bool]:
        """Every stored form of ``scope``'s key a live record may carry (one, unless the
        secrets are rotating)."""
        return table.c.key.in_(self.keys.candidates(scope.tenant, scope.key))

    def _owned(self) -> sa.ColumnElement[bool]:
        """Every write after the claim: fenced by the token, only while in progress.

        ``created_at`` is an optional hint: when given, PostgreSQL folds the ``IS NULL`` test
        away while planning and touches only the record's partition; when NULL the test is
        true and every partition is searched.
        """
        created_at = sa.bindparam("p_created_at", type_=table.c.created_at.type)
        return sa.and_(
            table.c.tenant == sa.bindparam("p_tenant"),
            table.c.endpoint == sa.bindparam("p_endpoint"),
            table.c.key == sa.bindparam("p_key"),
            table.c.claim_token == sa.bindparam("p_token"),
            table.c.state == State.IN_PROGRESS.value,
            sa.or_(
                sa.cast(created_at, table.c.created_at.type).is_(None),
                table.c.created_at == created_at,
            ),
        )

    def _owner(self, scope: Scope, token: str, created_at: dt.datetime | None) -> dict[str, t.Any]:
        # Parameter names differ from column names: SQLAlchemy reserves those in UPDATE.
        return {
            "p_tenant": scope.tenant,
            "p_endpoint": scope.endpoint,
            "p_key": self._stored_key(scope),
            "p_token": token,
            "p_created_at": created_at,
        }

    # The writes of every protected request: built and compiled once per store, so the hot path
    # only binds values.

    @functools.cached_property
    def _complete_statement(self) -> Precompiled:
        return Precompiled(
            table.update()
            .where(self._owned())
            .values(
                state=sa.bindparam("p_state"),
                response_status=sa.bindparam("p_status"),
                response_headers=sa.bindparam("p_headers", type_=table.c.response_headers.type),
                response_body=sa.bindparam("p_body", type_=table.c.response_body.type),
                completed_at=self.now(),
                lease_expires_at=None,
            ),
            self.engine.dialect,
            sent=self._complete_call(),
        )

    def _complete_call(self) -> sa.Select[t.Any] | None:
        """What the server is sent for the completion instead of its ``UPDATE`` (the same
        parameters, one row per record completed), or None for the ``UPDATE`` itself."""
        return None

    @functools.cached_property
    def _release_statement(self) -> Precompiled:
        return Precompiled(table.delete().where(self._owned()), self.engine.dialect)

    @functools.cached_property
    def _unknown_statement(self) -> Precompiled:
        # The lease ends now: the record's TTL counts from here (see ``ttl_after_end``).
        return Precompiled(
            table.update()
            .where(self._owned())
            .values(state=State.UNKNOWN.value, lease_expires_at=self.now()),
            self.engine.dialect,
        )

    def _execute(
        self,
        statement: sa.Executable | Precompiled,
        parameters: dict[str, t.Any] | None = None,
        connection: sa.Connection | None = None,
    ) -> StatementResult:
        with translate_errors(), engines.OneDeadline():
            if connection is not None:
                return StatementResult.of(_run(connection, statement, parameters))
            with self.connect() as conn:
                return StatementResult.of(_run(conn, statement, parameters))

    def _write(
        self,
        statement: sa.Insert | sa.Update | sa.Delete | Precompiled,
        parameters: dict[str, t.Any],
        connection: sa.Connection | None = None,
        *,
        scope: Scope,
        event: str,
        returning: t.Sequence[str] = (),
    ) -> StatementResult:
        """Run a write that changes a record's state, and audit it when the trail is on.

        A :class:`Precompiled` statement is sent as it is when that is all there is to do;
        with ``returning`` or the trail on, its Core statement is extended instead.

        Off, this is :meth:`_execute` of ``statement`` (returning ``returning``): nothing more
        is built or sent. On, one audit row per changed row goes in with the write: in the
        same statement on PostgreSQL, in the same transaction on SQLite; the result then
        counts the changed rows as the write's row count does.
        """
        if isinstance(statement, Precompiled):
            if not returning and not self.audit:
                return StatementResult([], self._send(statement, parameters, connection))
            statement = statement.statement
        if returning:
            statement = statement.returning(*(table.c[name] for name in returning))
        if not self.audit:
            return self._execute(statement, parameters, connection)
        if not returning:
            statement = statement.returning(*(table.c[name] for name in AUDIT_SOURCE))
        values = self._audit_values(scope, event)
        deleted = isinstance(statement, sa.Delete)
        with translate_errors(), engines.OneDeadline():
            if connection is not None:
                return self._audited(connection, statement, {**parameters, **values}, deleted)
            with self.connect() as conn:
                return self._audited(conn, statement, {**parameters, **values}, deleted)

    def _send(
        self,
        statement: Precompiled,
        parameters: dict[str, t.Any],
        connection: sa.Connection | None,
    ) -> int:
        """Run a precompiled write as it is; its row count (PostgreSQL: on the driver's
        cursor, see ``PostgresStore._send``)."""
        return self._execute(statement, parameters, connection).rowcount

    @abc.abstractmethod
    def _audited(
        self,
        conn: sa.Connection,
        statement: sa.UpdateBase,
        parameters: dict[str, t.Any],
        deleted: bool,
    ) -> StatementResult:
        """Run ``statement`` (it returns at least :data:`AUDIT_SOURCE`) and append one audit
        row per row it returns, from the ``a_*`` parameters and those rows."""

    def _audit_values(self, scope: Scope, event: str) -> dict[str, t.Any]:
        actor, detail = trail.current_actor()
        stored = self._stored_key(scope)
        return {
            "a_tenant": scope.tenant,
            "a_endpoint": scope.endpoint,
            "a_key_hash": key_hash(dataclasses.replace(scope, digest=stored)),
            "a_lookup": trail.lookup_digest(scope.tenant, stored),
            "a_event": event,
            "a_actor": actor,
            "a_detail": detail,
        }

    def complete(
        self,
        scope: Scope,
        token: str,
        response: StoredResponse | None,
        *,
        connection: sa.Connection | None = None,
        created_at: dt.datetime | None = None,
    ) -> bool:
        if self.sealer.encrypting and created_at is None:
            # The ciphertext is bound to the record's created_at: read it (the write below
            # then matches only that record).
            created_at = self._owned_created_at(scope, token, connection)
            if created_at is None:
                return False
        parameters = self._owner(scope, token, created_at)
        parameters.update(self._completion(scope, response, created_at))
        event = "unstored" if response is None else "completed"
        result = self._write(
            self._complete_statement, parameters, connection, scope=scope, event=event
        )
        return result.rowcount == 1

    def _completion(
        self, scope: Scope, response: StoredResponse | None, created_at: dt.datetime | None
    ) -> dict[str, t.Any]:
        """The values a completion writes: the state, and the response as stored (sealed)."""
        if response is None:
            return {
                "p_state": State.UNSTORED.value,
                "p_status": None,
                "p_headers": None,
                "p_body": None,
            }
        headers, body = self.sealer.seal(response, scope, created_at)
        return {
            "p_state": State.COMPLETED.value,
            "p_status": response.status,
            "p_headers": headers,
            "p_body": body,
        }

    def _owned_created_at(
        self, scope: Scope, token: str, connection: sa.Connection | None
    ) -> dt.datetime | None:
        statement = sa.select(table.c.created_at).where(self._owned())
        row = self._execute(statement, self._owner(scope, token, None), connection).first
        return None if row is None else _aware(row[0])

    def release(self, scope: Scope, token: str, *, created_at: dt.datetime | None = None) -> bool:
        parameters = self._owner(scope, token, created_at)
        result = self._write(self._release_statement, parameters, scope=scope, event="released")
        return result.rowcount == 1

    def mark_unknown(
        self, scope: Scope, token: str, *, created_at: dt.datetime | None = None
    ) -> bool:
        parameters = self._owner(scope, token, created_at)
        result = self._write(self._unknown_statement, parameters, scope=scope, event="unknown")
        return result.rowcount == 1

    def renew(
        self, scope: Scope, token: str, *, lease: float, created_at: dt.datetime | None = None
    ) -> bool:
        statement = (
            table.update().where(self._owned()).values(lease_expires_at=self.now_plus(lease))
        )
        return self._execute(statement, self._owner(scope, token, created_at)).rowcount == 1

    def take_over(self, scope: Scope, token: str, *, lease: float) -> ClaimResult | None:
        # Row locking makes this exactly-one-winner: a concurrent UPDATE re-checks the WHERE
        # clause against the row the winner wrote, whose token no longer matches. The row (so
        # its ``created_at``, so its downstream keys) stays the same: one logical operation.
        # No clock in the RETURNING: Citus refuses non-IMMUTABLE functions there. The new
        # lease ends at now() + lease, so the clock is read back from it (see lease_start).
        statement = (
            table.update()
            .where(
                table.c.tenant == sa.bindparam("p_tenant"),
                table.c.endpoint == sa.bindparam("p_endpoint"),
                table.c.key == sa.bindparam("p_key"),
                table.c.claim_token == sa.bindparam("p_token"),
                sa.or_(
                    table.c.state.in_([State.UNKNOWN.value, State.REOPENED.value]),
                    sa.and_(
                        table.c.state == State.IN_PROGRESS.value,
                        table.c.lease_expires_at <= self.now(),
                    ),
                ),
                self._alive(),
            )
            .values(
                state=State.IN_PROGRESS.value,
                claim_token=new_token(),
                lease_expires_at=self.now_plus(lease),
            )
        )
        row = self._write(
            statement,
            self._owner(scope, token, None),
            scope=scope,
            event="taken_over",
            returning=RECORD_COLUMNS,
        ).first
        if row is None:
            return None
        now = lease_start(_aware(row.lease_expires_at), lease)
        return ClaimResult(record_from_row(scope, row, self.sealer, now), claimed=True)

    def get(self, scope: Scope) -> Record | None:
        statement = (
            sa.select(*self._returning())
            .where(self._live(scope))
            .order_by(table.c.created_at.desc())
            .limit(1)
        )
        row = self._execute(statement).first
        return None if row is None else record_from_row(scope, row, self.sealer)

    def _alive(self) -> sa.ColumnElement[bool]:
        """A record counts for its TTL from its claim and for its TTL from the end of its
        request: a request running past its TTL never lets a retry run it again, and its
        answer (or its unknown outcome) stays for a whole TTL after it exists."""
        return sa.or_(table.c.expires_at > self.now(), self.ttl_after_end())

    def _live(self, scope: Scope) -> sa.ColumnElement[bool]:
        return sa.and_(
            table.c.tenant == scope.tenant,
            table.c.endpoint == scope.endpoint,
            self._keys_of(scope),
            self._alive(),
        )

    def _stuck(self) -> sa.ColumnElement[bool]:
        """Unknown, reopened, or in progress past the lease: nobody owns the outcome."""
        return sa.and_(
            self._alive(),
            sa.or_(
                table.c.state.in_([State.UNKNOWN.value, State.REOPENED.value]),
                sa.and_(
                    table.c.state == State.IN_PROGRESS.value,
                    table.c.lease_expires_at <= self.now(),
                ),
            ),
        )

    def _scoped_returning(self) -> list[sa.ColumnElement[t.Any]]:
        return [table.c.tenant, table.c.endpoint, *self._returning()]

    @abc.abstractmethod
    def scope_hash(self) -> sa.ColumnElement[str]:
        """Each row's key hash (:func:`~flask_idem.core.idempotency_keys.key_hash` of its
        scope), computed by the database, for lookups by key hash."""

    def find(self, tenant: str, key: str, endpoint: str | None = None) -> list[Record]:
        # The key digested as the claim digested it: the raw key is not in the table.
        return self._find(tenant, table.c.key.in_(self.keys.candidates(tenant, key)), endpoint)

    def find_hashed(self, tenant: str, key_hash: str, endpoint: str | None = None) -> list[Record]:
        # No index can serve it: every live record of the tenant is hashed (operators only).
        return self._find(tenant, self.scope_hash() == key_hash, endpoint)

    def _find(
        self, tenant: str, match: sa.ColumnElement[bool], endpoint: str | None
    ) -> list[Record]:
        statement = (
            sa.select(*self._scoped_returning())
            .where(table.c.tenant == tenant, match, self._alive())
            .order_by(table.c.created_at)
        )
        if endpoint is not None:
            statement = statement.where(table.c.endpoint == endpoint)
        else:
            endpoints = _endpoints_of(tenant)
            statement = statement.where(table.c.endpoint.in_(sa.select(endpoints.c.endpoint)))
        return [record_from_row(None, row, self.sealer) for row in self._execute(statement).rows]

    def stuck(self, *, limit: int = 1000, tenants: t.Collection[str] | None = None) -> list[Record]:
        statement = (
            sa.select(*self._scoped_returning())
            .where(self._stuck())
            .order_by(table.c.created_at)
            .limit(limit)
        )
        if tenants is not None:
            statement = statement.where(table.c.tenant.in_(list(tenants)))
        return [record_from_row(None, row, self.sealer) for row in self._execute(statement).rows]

    def created_between(
        self, start: dt.datetime, end: dt.datetime, *, endpoints: t.Collection[str]
    ) -> list[Record]:
        # Bodies are left out (a day of records would otherwise carry every stored response).
        # The test on completed_at and lease_expires_at reads every partition: a nightly
        # job's price for not missing an operation that ran long after its claim.
        columns = [
            sa.null().label(name) if name.startswith("response_") else column
            for name, column in zip(
                ("tenant", "endpoint", *RECORD_COLUMNS, "db_now", "key"),
                self._scoped_returning(),
                strict=True,
            )
        ]
        # In UTC: SQLite compares the stored UTC text with the parameter's.
        low, high = start.astimezone(dt.timezone.utc), end.astimezone(dt.timezone.utc)
        statement = (
            sa.select(*columns)
            .where(
                # Created in the window, or run in it: a record claimed days earlier and
                # taken over (or settled) today made today's downstream calls.
                sa.or_(
                    *(
                        sa.and_(column >= low, column < high)
                        for column in (
                            table.c.created_at,
                            table.c.completed_at,
                            table.c.lease_expires_at,
                        )
                    )
                ),
                sa.or_(
                    table.c.endpoint.in_(list(endpoints)),
                    # A principal's records of these endpoints ("principal=<id> POST /p"):
                    # LIKE narrows them (on SQLite regardless of case), the test below decides.
                    sa.and_(
                        table.c.endpoint.startswith(PRINCIPAL_PREFIX, autoescape=True),
                        sa.or_(
                            *(
                                table.c.endpoint.endswith(f" {e}", autoescape=True)
                                for e in endpoints
                            )
                        ),
                    ),
                ),
            )
            .order_by(table.c.created_at)
        )
        records = [record_from_row(None, row) for row in self._execute(statement).rows]
        return [record for record in records if split(record.scope.endpoint)[1] in endpoints]

    def resolve(
        self,
        scope: Scope,
        response: StoredResponse,
        *,
        token: str | None,
        created_at: dt.datetime | None = None,
    ) -> bool:
        # Fenced by the token the caller saw: a retry that took the record over meanwhile
        # (and maybe got stuck again) has another token, and its operation is not settled.
        settle = sa.and_(
            self._live(scope), self._stuck(), table.c.claim_token == sa.bindparam("p_token")
        )
        fence = {"p_token": token}
        if self.sealer.encrypting and created_at is None:
            row = self._execute(sa.select(table.c.created_at).where(settle), fence).first
            if row is None:
                return False
            created_at = _aware(row[0])
        if created_at is not None:
            settle = sa.and_(settle, table.c.created_at == created_at)
        headers, body = self.sealer.seal(response, scope, created_at)
        statement = (
            table.update()
            .where(settle)
            .values(
                state=State.COMPLETED.value,
                response_status=response.status,
                response_headers=sa.null() if headers is None else headers,
                response_body=body,
                completed_at=self.now(),
                lease_expires_at=None,
            )
        )
        return self._write(statement, fence, scope=scope, event="completed").rowcount == 1

    def reopen(self, scope: Scope, *, token: str | None) -> bool:
        statement = (
            table.update()
            .where(
                self._live(scope),
                self._stuck(),
                table.c.state != State.REOPENED.value,
                table.c.claim_token == sa.bindparam("p_token"),
            )
            .values(state=State.REOPENED.value, lease_expires_at=self.now())
        )
        reopened = self._write(statement, {"p_token": token}, scope=scope, event="reopened")
        return reopened.rowcount == 1

    def key_usage(self) -> list[KeyUsage]:
        body = table.c.response_body
        # The key id field of an envelope, NULL for plain rows; counted without reading bodies.
        key_field = sa.case(
            (
                sa.and_(
                    table.c.response_headers.is_(None),
                    sa.func.substr(body, 1, len(MAGIC), type_=sa.LargeBinary)
                    == sa.literal(MAGIC, sa.LargeBinary),
                ),
                sa.func.substr(body, KEY_ID_OFFSET, KEY_ID_SIZE, type_=sa.LargeBinary),
            ),
            else_=sa.null(),
        )
        rows = (
            sa.select(key_field.label("key_field"), table.c.expires_at)
            .where(body.is_not(None), self._alive())
            .subquery()
        )
        statement = sa.select(
            rows.c.key_field, sa.func.count(), sa.func.max(rows.c.expires_at)
        ).group_by(rows.c.key_field)
        usage: dict[str | None, KeyUsage] = {}
        for row in self._execute(statement).rows:
            key_field_value, count, last = t.cast("tuple[t.Any, int, t.Any]", tuple(row))
            last = _aware(last)
            key_id = None if key_field_value is None else key_id_of(bytes(key_field_value))
            previous = usage.get(key_id)
            if previous is not None:  # plain rows and compressed-only envelopes
                count += previous.rows
                if previous.last_expires_at is not None and (
                    last is None or previous.last_expires_at > last
                ):
                    last = previous.last_expires_at
            usage[key_id] = KeyUsage(key_id, count, last)
        return sorted(usage.values(), key=lambda u: (u.key_id is None, u.key_id or ""))

    def evict(self, scope: Scope) -> bool:
        statement = table.delete().where(self._live(scope))
        return self._write(statement, {}, scope=scope, event="evicted").rowcount >= 1

    def health(self) -> Health:
        state, count = table.c.state, sa.func.count
        in_progress = state == State.IN_PROGRESS.value
        statement = sa.select(
            count().filter(in_progress).label("in_progress"),
            count().filter(in_progress, table.c.lease_expires_at <= self.now()).label("expired"),
            count().filter(state == State.UNKNOWN.value).label("unknown"),
            count().filter(state == State.REOPENED.value).label("reopened"),
            sa.func.min(table.c.created_at).filter(in_progress).label("oldest"),
            self._db_now(),
        ).where(state.in_([s.value for s in (State.IN_PROGRESS, State.UNKNOWN, State.REOPENED)]))
        row = self._execute(statement.where(self._alive())).rows[0]
        oldest, now = _aware(row.oldest), _aware(row.db_now)
        assert now is not None
        return Health(
            in_progress=row.in_progress,
            lease_expired=row.expired,
            unknown=row.unknown,
            reopened=row.reopened,
            oldest_in_progress_age=None if oldest is None else (now - oldest).total_seconds(),
            partitions_ahead=self.partitions_ahead(),
            archived_partitions=self.archived_partitions(),
        )

    def history(self, tenant: str, key: str, endpoint: str | None = None) -> list[AuditEntry]:
        lookups = trail.lookups(tenant, key, self.keys.candidates(tenant, key))
        return self._history(tenant, audit_table.c.lookup.in_(lookups), endpoint)

    def history_hashed(
        self, tenant: str, key_hash: str, endpoint: str | None = None
    ) -> list[AuditEntry]:
        # Not indexed: reads every audit row of the tenant (operators only).
        return self._history(tenant, audit_table.c.key_hash == key_hash, endpoint)

    def _history(
        self, tenant: str, match: sa.ColumnElement[bool], endpoint: str | None
    ) -> list[AuditEntry]:
        statement = (
            sa.select(*(audit_table.c[name] for name in AUDIT_COLUMNS))
            .where(audit_table.c.tenant == tenant, match)
            .order_by(audit_table.c.occurred_at, audit_table.c.seq)
        )
        if endpoint is not None:
            statement = statement.where(audit_table.c.endpoint == endpoint)
        return [audit_entry(row) for row in self._execute(statement).rows]

    def begin(self) -> sa.Connection:
        with translate_errors(), engines.OneDeadline():
            connection = self.engine.connect()
            try:
                connection.begin()
            except BaseException:
                connection.close()
                raise
            return connection


class Precompiled:
    """A Core statement compiled once for one dialect, executed as driver SQL.

    Executing a Core statement makes SQLAlchemy build its cache key and the full parameter set
    every time (about 0.1 ms of CPU for the completion ``UPDATE``, measured with
    ``python -m bench profile``). The SQL text, the constant values and the bind processors
    (JSON, binary) are computed here once; a call only processes the values it binds. The
    statement still goes through ``Connection.exec_driver_sql``: events, error translation and
    disconnect handling are SQLAlchemy's as before, and the server sees the same text.
    """

    def __init__(
        self,
        statement: sa.Insert | sa.Update | sa.Delete,
        dialect: sa.Dialect,
        *,
        sent: sa.Select[t.Any] | None = None,
    ) -> None:
        #: The Core statement, for what needs more than the precompiled text (RETURNING, the
        #: audit trail's CTE).
        self.statement = statement
        # ``sent``: what the server is sent instead, binding the same names (PostgreSQL: a
        # call of the function holding this statement on a kept plan, one row per row
        # written, so that the row count reads the same).
        compiled = (statement if sent is None else sent).compile(dialect=dialect)
        self.sql = str(compiled)
        self._order = tuple(compiled.positiontup or ()) if compiled.positional else None
        self._constants: dict[str, t.Any] = {}
        self._bound: list[tuple[str, str, t.Callable[[t.Any], t.Any] | None]] = []
        for name, bind in compiled.binds.items():
            processor = bind.type.dialect_impl(dialect).bind_processor(dialect)
            if bind.required:
                self._bound.append((name, bind.key, processor))
            else:
                value = bind.effective_value
                self._constants[name] = value if processor is None else processor(value)

    def parameters(self, values: t.Mapping[str, t.Any]) -> t.Any:
        """The driver's parameters for ``values`` (keyed as the statement's bind names).

        :raises sqlalchemy.exc.StatementError: a bind processor failed (as SQLAlchemy reports
            it: the store fails closed on it).
        """
        bound = dict(self._constants)
        try:
            for name, key, processor in self._bound:
                value = values[key]
                bound[name] = value if processor is None else processor(value)
        except Exception as exc:
            raise sa.exc.StatementError(str(exc), self.sql, None, exc) from exc
        if self._order is None:
            return bound
        return tuple(bound[name] for name in self._order)


def _run(
    connection: sa.Connection,
    statement: sa.Executable | Precompiled,
    parameters: dict[str, t.Any] | None,
) -> sa.CursorResult[t.Any]:
    if isinstance(statement, Precompiled):
        return connection.exec_driver_sql(statement.sql, statement.parameters(parameters or {}))
    return connection.execute(statement, parameters)


def audit_entry(row: t.Any) -> AuditEntry:
    """An :class:`AuditEntry` from a row of :data:`AUDIT_COLUMNS`."""
    m = row._mapping
    occurred_at = _aware(m["occurred_at"])
    assert occurred_at is not None
    return AuditEntry(
        occurred_at=occurred_at,
        tenant=m["tenant"],
        endpoint=m["endpoint"],
        key_hash=m["key_hash"],
        record_created_at=_aware(m["record_created_at"]),
        event=m["event"],
        state=m["state"],
        status=m["status"],
        fingerprint=None if m["fingerprint"] is None else bytes(m["fingerprint"]),
        actor=m["actor"],
        detail=m["detail"],
    )


def lease_start(lease_expires_at: dt.datetime | None, lease: float) -> dt.datetime:
    """The database clock of a write that set ``lease_expires_at`` to ``now() + lease``.

    Exact on PostgreSQL: ``make_interval`` rounds seconds times 10**6 to whole microseconds,
    half to even, as ``round`` does here; SQLite's clock has milliseconds only.
    """
    assert lease_expires_at is not None
    return lease_expires_at - dt.timedelta(microseconds=round(float(lease) * 1_000_000))


def new_token() -> str:
    """A claim token: 128 random bits, so a stale owner can never guess the new one."""
    return secrets.token_hex(16)


class StatementResult(t.NamedTuple):
    """A statement's rows and row count, read before its connection goes back to the pool."""

    rows: list[sa.Row[t.Any]]
    rowcount: int

    @classmethod
    def of(cls, result: sa.CursorResult[t.Any]) -> StatementResult:
        if not result.returns_rows:
            return cls([], result.rowcount)
        # A write with RETURNING, or a function call returning one row per row written
        # (``Precompiled``'s ``sent``): the rows are the count, whatever the driver says of
        # a result read to its end.
        rows = list(result.all())
        return cls(rows, len(rows))

    @property
    def first(self) -> sa.Row[t.Any] | None:
        return self.rows[0] if self.rows else None
