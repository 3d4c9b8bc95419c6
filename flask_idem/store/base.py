"""The storage interfaces: atomic primitives over one (tenant, endpoint, key) scope each.

Two of them:

:class:`RequestStore`
    the request primitives, what protected requests, jobs and leases call (claim, complete,
    release, mark unknown, renew, take over, get, the business transaction): the minimum a
    custom store implements.
:class:`OperatorStore`
    reading and keeping the records for operators: lookups, stuck lists, settling stuck
    records, the audit trail, gauges, key usage and upkeep, what ``flask idem``, the
    inspection endpoint and operator page, reconcilers, the next-day check, the metrics' table
    gauges and ``IDEMPOTENCY_ENSURE_PARTITIONS`` call.

:class:`Store` is both, as the built-in stores are.

The state machine that decides what a request gets (run, replay, 409, 422) lives above these
interfaces. A store only offers primitives that are each atomic on their own, so that the
decisions above never race. Every write after a claim carries the claim's token: once a lease
has been taken over, the stale owner's writes match nothing (fencing).
"""

from __future__ import annotations

import abc
import datetime as dt
import typing as t

import sqlalchemy as sa

from ..core.errors import ConfigurationError
from ..core.key_digest import KeyDigest
from ..core.record import (
    Archive,
    ClaimResult,
    Health,
    KeyUsage,
    MaintenanceReport,
    Record,
    Scope,
    StoredResponse,
)
from ..core.sealing import Sealer
from .trail import AuditEntry


class RequestStore(abc.ABC):
    """The request primitives: what a custom store implements at least; implementations raise
    only ``StoreUnavailable``."""

    #: Whether statements may take the driver-cursor shortcut of
    #: :mod:`flask_idem.store.fast_path` (``IDEMPOTENCY_SQLALCHEMY_FAST_PATH``).
    fast_path: bool = True

    def __init__(self, engine: sa.Engine) -> None:
        self.engine = engine
        #: Compresses and encrypts snapshots on the way in, opens them on the way out.
        self.sealer = Sealer()
        self._sealer_configured = False
        #: What stored keys and fingerprints are made of (``IDEMPOTENCY_KEY_SECRETS``).
        self.keys = KeyDigest()
        self._keys_configured = False
        #: Whether every state transition appends a row to the audit trail (written by the
        #: request primitives themselves, with the transition: a request-path setting).
        self.audit = False
        #: Seconds audit rows are kept (None: forever); enforced by ``maintain``.
        self.audit_retention: float | None = None
        self._audit_configured = False
        self._fast_path_configured = False

    def use_fast_path(self, enabled: bool) -> None:
        """Take SQLAlchemy's private shortcuts or not (``IDEMPOTENCY_SQLALCHEMY_FAST_PATH``;
        ``init_app`` calls this). A store already on public API only keeps to it.

        :raises ConfigurationError: the store already serves an application on the fast path
            (its engine's dialect is wrapped) and this one asks for public API only.
        """
        wanted = self.fast_path and enabled
        if self._fast_path_configured and wanted != self.fast_path:
            raise ConfigurationError(
                "this store already serves an application with IDEMPOTENCY_SQLALCHEMY_FAST_PATH "
                "on; give an application that switches it off its own store"
            )
        self.fast_path = wanted
        self._fast_path_configured = True

    def use_audit(self, enabled: bool, retention: float | None = None) -> None:
        """Audit every state transition (``IDEMPOTENCY_AUDIT``; ``init_app`` calls this).

        :param retention: seconds audit rows are kept, or None for ever.
        :raises ConfigurationError: the store already serves an application that audits
            differently.
        """
        wanted = (enabled, retention if enabled else None)
        if self._audit_configured and wanted != (self.audit, self.audit_retention):
            raise ConfigurationError(
                "this store already serves an application with another IDEMPOTENCY_AUDIT or "
                "IDEMPOTENCY_AUDIT_RETENTION; give each application its own store"
            )
        self.audit, self.audit_retention = wanted
        self._audit_configured = True

    def use_sealer(self, sealer: Sealer) -> None:
        """Seal snapshots as an application's settings say (``init_app`` calls this).

        :raises ConfigurationError: the store already serves an application that seals
            differently (two apps sharing one store must agree on keys and compression).
        """
        if self._sealer_configured and sealer != self.sealer:
            raise ConfigurationError(
                "this store already serves an application with other IDEMPOTENCY_ENCRYPTION_KEYS,"
                " IDEMPOTENCY_COMPRESS_MIN or IDEMPOTENCY_REQUIRE_ENCRYPTED; give each "
                "application its own store"
            )
        self.sealer = sealer
        self._sealer_configured = True

    def use_keys(self, keys: KeyDigest) -> None:
        """Digest keys and fingerprints as an application's settings say (``init_app`` calls
        this).

        :raises ConfigurationError: the store already serves an application with other
            secrets (one record would be digested two ways: two claims of one key).
        """
        if self._keys_configured and keys != self.keys:
            raise ConfigurationError(
                "this store already serves an application with other IDEMPOTENCY_KEY_SECRETS; "
                "give each application its own store"
            )
        self.keys = keys
        self._keys_configured = True

    @abc.abstractmethod
    def claim(self, scope: Scope, fingerprint: bytes, *, ttl: float, lease: float) -> ClaimResult:
        """Take the key for the caller, or return the live record that already holds it.

        ``fingerprint`` is the request's SHA-256 fingerprint. A store must keep neither it nor
        the key as given: it keeps the key as :attr:`keys` digests it (``keys.stored``: keyed
        with the current secret of ``IDEMPOTENCY_KEY_SECRETS``; a claim looks up every form
        of ``keys.candidates``) and the fingerprint keyed the same way (``keys.fingerprint``,
        see :class:`~flask_idem.core.key_digest.KeyDigest`); the records it returns carry the
        digest (``scope.digest``) and the stored fingerprint. The contract
        (:mod:`flask_idem.testing.contract`) reads the store's tables to check it.

        :param ttl: seconds the record (and so the key) stays live.
        :param lease: seconds before an owner that stopped renewing counts as gone.
        """

    @abc.abstractmethod
    def claim_atomic(
        self, connection: sa.Connection, scope: Scope, fingerprint: bytes, *, ttl: float
    ) -> ClaimResult | None:
        """:meth:`claim` inside the caller's open business transaction (the atomic mode).

        The new record, the caller's business rows and the completion commit together, or
        not at all: no lease, nothing to release after a crash. The claim's lock on the scope
        is held until that transaction ends, so a concurrent duplicate is not made to wait
        for the whole view: on PostgreSQL it gets None at once (SQLite, which has one writer
        at a time, makes it wait for the commit instead). PostgreSQL refuses it outside READ
        COMMITTED.

        :returns: the claim, or None when a duplicate holds the scope right now.
        """

    def completed_before_claim(self, scope: Scope, connection: sa.Connection) -> Record | None:
        """The live completed record of ``scope``, read on ``connection`` (the business
        connection, before its transaction has begun) in autocommit: an atomic replay in one
        statement, with no transaction. None: claim as usual (no such record, a transaction
        already open on ``connection``, or a store that cannot read outside one)."""
        return None

    @abc.abstractmethod
    def complete(
        self,
        scope: Scope,
        token: str,
        response: StoredResponse | None,
        *,
        connection: sa.Connection | None = None,
        created_at: dt.datetime | None = None,
    ) -> bool:
        """Store the response snapshot; ``None`` marks the key used but not replayable.

        A store must keep the snapshot as :attr:`sealer` seals it
        (:meth:`~flask_idem.core.sealing.Sealer.seal`, bound to the record's ``created_at``):
        with ``IDEMPOTENCY_ENCRYPTION_KEYS`` neither its body nor its headers are kept in
        clear, and :meth:`get` and the claims open it with the same sealer (which refuses one
        stored unencrypted under ``IDEMPOTENCY_REQUIRE_ENCRYPTED``).

        :param connection: run inside the caller's open transaction, so that the business
            writes and the stored response commit together.
        :param created_at: the claimed record's ``created_at``, when known: it lets PostgreSQL
            touch only that record's partition (the same for every write after the claim).
        :returns: False when the token no longer owns the record (lease taken over).
        """

    @abc.abstractmethod
    def release(self, scope: Scope, token: str, *, created_at: dt.datetime | None = None) -> bool:
        """Forget an in-progress claim so that a retry executes afresh."""

    @abc.abstractmethod
    def mark_unknown(
        self, scope: Scope, token: str, *, created_at: dt.datetime | None = None
    ) -> bool:
        """Record that a side effect may have happened, so a retry must never re-execute."""

    @abc.abstractmethod
    def renew(
        self, scope: Scope, token: str, *, lease: float, created_at: dt.datetime | None = None
    ) -> bool:
        """Extend the owner's lease; False when the lease was lost."""

    @abc.abstractmethod
    def take_over(self, scope: Scope, token: str, *, lease: float) -> ClaimResult | None:
        """Run the record's operation again: take an expired lease, an ``unknown`` or a
        ``reopened`` record from the owner holding ``token``; exactly one caller wins.

        The record stays the same row (same ``created_at``), so downstream keys derived from
        it stay the same and a deduplicating provider sees one operation.

        :returns: the new claim, or None when the lease is live, or the record is gone, settled
            or already taken over.
        """

    @abc.abstractmethod
    def get(self, scope: Scope) -> Record | None:
        """Return the live record of the scope, if any.

        A record is live until its TTL has passed both since its claim and since its request
        ended (completion, unknown, or the end of its last lease).
        """

    @abc.abstractmethod
    def begin(self) -> sa.Connection:
        """Open a connection in a transaction for business writes committed with ``complete``."""


class OperatorStore(abc.ABC):
    """Reading and keeping the records for operators (see the module's docstring); what a
    store implements on top of :class:`RequestStore` for ``flask idem`` and the other
    operator tools. Implementations raise only ``StoreUnavailable``."""

    #: SQLAlchemy dialect name this store speaks ("postgresql", "sqlite"), for
    #: ``flask idem upkeep`` (partitions and archives are PostgreSQL's).
    dialect: t.ClassVar[str]
    #: Where :meth:`maintain` moves expired partitions instead of dropping them (None:
    #: dropped at once).
    archive: Archive | None = None
    _archive_configured = False

    def use_archive(self, archive: Archive | None) -> None:
        """Archive expired partitions (``IDEMPOTENCY_ARCHIVE_*``; ``init_app`` calls this on
        a store with the operator interface: only :meth:`maintain` reads it).

        :raises ConfigurationError: the store already serves an application that archives
            differently.
        """
        if self._archive_configured and archive != self.archive:
            raise ConfigurationError(
                "this store already serves an application with another "
                "IDEMPOTENCY_ARCHIVE_RETENTION or IDEMPOTENCY_ARCHIVE_SCHEMA; give each "
                "application its own store"
            )
        self.archive = archive
        self._archive_configured = True

    @abc.abstractmethod
    def find(self, tenant: str, key: str, endpoint: str | None = None) -> list[Record]:
        """Live records of ``key`` in one tenant, on one endpoint or all (operators' view)."""

    def find_hashed(self, tenant: str, key_hash: str, endpoint: str | None = None) -> list[Record]:
        """:meth:`find` by the key hash logs and the CLI print
        (:func:`~flask_idem.core.idempotency_keys.key_hash`) instead of the key, for operators
        who must not type raw keys into a shell. A key hash names one endpoint's key.

        :raises ConfigurationError: the store cannot (the default): look up by key instead.
        """
        raise ConfigurationError(f"{type(self).__name__} cannot look records up by key hash")

    @abc.abstractmethod
    def stuck(self, *, limit: int = 1000, tenants: t.Collection[str] | None = None) -> list[Record]:
        """Records in progress past their lease, records whose outcome is unknown and
        reopened ones no retry has run yet, oldest first, across tenants or of ``tenants``
        only (for operators and reconcilers)."""

    @abc.abstractmethod
    def created_between(
        self, start: dt.datetime, end: dt.datetime, *, endpoints: t.Collection[str]
    ) -> list[Record]:
        """Records of ``endpoints`` (their endpoint column, principal left out: the records of
        ``POST /p`` include ``principal=<id> POST /p``; ``*`` names the account-wide ones)
        created, completed or last leased in ``[start, end)``
        (a takeover of an older record ran in the window too), live or expired but not yet
        purged, oldest first, across tenants, without their stored responses (for the
        next-day audit, :mod:`flask_idem.ops.downstream`)."""

    @abc.abstractmethod
    def resolve(
        self,
        scope: Scope,
        response: StoredResponse,
        *,
        token: str | None,
        created_at: dt.datetime | None = None,
    ) -> bool:
        """Complete a stuck record from outside the request that claimed it (later retries
        replay ``response``).

        Only records that are ``unknown``, ``reopened`` or whose lease has expired can be
        settled, never one whose owner is still alive, and only while the record still
        carries ``token``, the claim token of the record the caller looked at: a retry that
        took the operation over meanwhile is never settled by a stale verdict. There is no
        way to forget a stuck record: an owner whose lease ran out may only be frozen, and a
        new record would give a retry new downstream keys (see :meth:`reopen`).

        :param created_at: the stuck record's ``created_at``, when known: only that record is
            settled (and an encrypted snapshot is bound to it).
        """

    @abc.abstractmethod
    def reopen(self, scope: Scope, *, token: str | None) -> bool:
        """Let the next retry run a stuck record's operation again as the same operation.

        Only ``unknown`` records and in-progress ones past their lease can be reopened, and
        only while they carry ``token`` (see :meth:`resolve`); the record keeps its
        ``created_at`` and therefore its downstream keys. This is what a verdict that the
        operation did not happen does: an owner frozen past its lease that resumes and the
        retry then both reach the provider under the same downstream keys.
        """

    @abc.abstractmethod
    def evict(self, scope: Scope) -> bool:
        """Administrative removal of the live record, whatever its state."""

    @abc.abstractmethod
    def health(self) -> Health:
        """Counts of live records that are not settled, and the age of the oldest one in
        progress, in one read (gauges: computed from the table, not per process)."""

    def partitions_ahead(self) -> int | None:
        """Partitions ready after the current one; None where the table is not partitioned."""
        return None

    def archived_partitions(self) -> int | None:
        """Partitions waiting in the archive; None without partitions or an archive."""
        return None

    @abc.abstractmethod
    def history(self, tenant: str, key: str, endpoint: str | None = None) -> list[AuditEntry]:
        """The audit trail of ``key`` in one tenant (every record it ever had, expired ones
        included, as long as audit rows are kept), oldest first."""

    def history_hashed(
        self, tenant: str, key_hash: str, endpoint: str | None = None
    ) -> list[AuditEntry]:
        """:meth:`history` by key hash (see :meth:`find_hashed`): the audit trail of one
        endpoint's key.

        :raises ConfigurationError: the store cannot (the default): look up by key instead.
        """
        raise ConfigurationError(f"{type(self).__name__} cannot look audit rows up by key hash")

    @abc.abstractmethod
    def key_usage(self) -> list[KeyUsage]:
        """Live stored responses per encryption key id (None: stored unencrypted), for
        ``flask idem keys``."""

    @abc.abstractmethod
    def maintain(self, *, ahead: int, dry_run: bool = False) -> MaintenanceReport:
        """Prepare storage ahead and remove what has expired.

        :param ahead: partitions to keep ready after the current one (PostgreSQL).
        """


class Store(RequestStore, OperatorStore):
    """Both interfaces: the request primitives and the operator's (the built-in stores)."""


def operator_store(store: RequestStore, needed_by: str) -> Store:
    """``store`` as the :class:`OperatorStore` ``needed_by`` reads records through.

    :raises ConfigurationError: the store implements the request primitives only.
    """
    if not isinstance(store, OperatorStore):
        raise ConfigurationError(
            f"{needed_by} reads records through the operator interface "
            f"(flask_idem.store.OperatorStore), which {type(store).__name__} does not "
            "implement: it implements the request primitives only (RequestStore)"
        )
    # A store implementing both interfaces without subclassing Store offers all it has.
    return t.cast(Store, store)
