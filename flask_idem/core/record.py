"""Plain data passed between the store and the extension: scopes, records, snapshots."""

from __future__ import annotations

import dataclasses
import datetime as dt
import enum
import typing as t


class State(str, enum.Enum):
    """Where a claimed operation stands.

    ``in_progress`` is the only state a claim token can write to. ``completed`` and
    ``unstored`` are final until the record expires; ``unknown`` and ``reopened`` records (and
    in-progress ones whose lease ran out) can be taken over by a retry that runs the operation
    again as the same operation, or settled by a reconciler or an operator.
    """

    IN_PROGRESS = "in_progress"
    #: The view ran and its response snapshot is stored: retries replay it.
    COMPLETED = "completed"
    #: A side effect may have happened but the outcome is not known: retries must not re-run it.
    UNKNOWN = "unknown"
    #: The view ran but its response could not be stored (streamed or too large). The key stays
    #: taken so that a retry can never execute the operation a second time.
    UNSTORED = "unstored"
    #: An operator released an operation that may have happened: the next retry runs it again
    #: as the same operation (same record, so the same downstream keys), whatever its view's
    #: ``recovery``.
    REOPENED = "reopened"


@dataclasses.dataclass(frozen=True)
class Scope:
    """The namespace of one idempotency key: a key means something only inside it.

    ``key`` is the key a client sent, or, for a record read from the table without one, its
    stored digest (``$...``, see :mod:`flask_idem.core.key_digest`).
    """

    tenant: str
    #: ``POST /v1/payments``, ``JOB <name>``, or what a scope option makes of it (``*`` for an
    #: account-wide key, ``principal=<id> ...``: see :mod:`flask_idem.core.scopes`).
    endpoint: str
    key: str
    #: The key as its record stores it, when known: set by the store on the records it
    #: returns (the digest the row carries) and on a request's scope (the current digest).
    #: Not part of the identity: one key keeps its scope across a rotation.
    digest: str | None = dataclasses.field(default=None, compare=False)


#: The statuses a completion stores and a replay sends: final answers only. An interim 1xx
#: (101 Switching Protocols hands the connection over) never ends a request.
STORABLE_STATUSES = range(200, 600)
#: Headers never stored or replayed, whatever ``IDEMPOTENCY_STORED_HEADERS`` says: they
#: describe one connection or one message's framing (RFC 9110, section 7.6.1), which the
#: server sets for the replay itself.
UNREPLAYABLE_HEADERS = frozenset(
    {
        "connection",
        "content-length",
        "keep-alive",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    }
)


@dataclasses.dataclass(frozen=True)
class StoredResponse:
    """The part of a response that is replayed to retries."""

    status: int
    headers: tuple[tuple[str, str], ...]
    body: bytes


@dataclasses.dataclass(frozen=True)
class Record:
    """One row of ``idempotency_keys`` as read at ``now`` (the database clock)."""

    scope: Scope
    fingerprint: bytes
    state: State
    claim_token: str | None
    lease_expires_at: dt.datetime | None
    response: StoredResponse | None
    created_at: dt.datetime
    completed_at: dt.datetime | None
    expires_at: dt.datetime
    now: dt.datetime
    #: Why the stored response cannot be read (then ``response`` is None although the record
    #: completed): its key is not configured, or it fails authentication. Never replayed.
    unreadable: str | None = None
    #: Why the row itself cannot be trusted (a timestamp column holds no timestamp: SQLite
    #: keeps any text), or None. Its timestamps read as ``now``; no claim, job or reconciler
    #: acts on it (a retry gets 503 ``stored-response-unreadable``) until an operator repairs
    #: or deletes it.
    damaged: str | None = None

    @property
    def lease_expired(self) -> bool:
        """True when an in-progress owner has stopped renewing its lease (crashed or hung)."""
        return (
            self.state is State.IN_PROGRESS
            and self.lease_expires_at is not None
            and self.lease_expires_at <= self.now
        )

    @property
    def lease_remaining(self) -> float:
        """Seconds until the lease expires (0 when it has)."""
        if self.lease_expires_at is None:
            return 0.0
        return max(0.0, (self.lease_expires_at - self.now).total_seconds())

    @property
    def kept_for(self) -> float:
        """Seconds the record is still live at :attr:`now` (0 when it is not): its TTL from
        its claim, and its TTL again from the end of its request (its completion, or the
        moment its lease ran out or its outcome was decided), as the store counts it."""
        ended = self.completed_at or self.lease_expires_at or self.created_at
        kept_until = max(self.expires_at, ended + (self.expires_at - self.created_at))
        return max(0.0, (kept_until - self.now).total_seconds())


class Reservation(t.Protocol):
    """A record an atomic claim holds without having written it."""

    def complete(self, response: StoredResponse | None) -> bool:
        """Write the record, completed with ``response`` (None: used, not replayable), into the
        claim's transaction.

        :returns: False when the transaction that reserved it has ended meanwhile (and with it
            the claim's hold on the scope): nothing is written.
        """


@dataclasses.dataclass(frozen=True)
class ClaimResult:
    """What a claim found: a fresh record owned by the caller, or somebody else's record."""

    record: Record
    claimed: bool
    #: The claim took over a record nobody owned (set by the attempt, not the store).
    taken_over: bool = False
    #: Set when the record is reserved, not written (PostgreSQL's atomic claim): the scope is
    #: held by the claim's lock until the business transaction ends, and the reservation
    #: writes the record, completed, into that transaction (one row write per new key).
    reservation: Reservation | None = None

    @property
    def token(self) -> str:
        """The claim token that fences every later write of the owner."""
        if not self.claimed or self.record.claim_token is None:
            raise ValueError("only a successful claim carries a token")
        return self.record.claim_token


@dataclasses.dataclass(frozen=True)
class KeyUsage:
    """How many live stored responses one encryption key protects."""

    #: The key id, or None for responses stored unencrypted (plain or only compressed).
    key_id: str | None
    rows: int
    #: When the last of them expires: the key can be retired after that.
    last_expires_at: dt.datetime | None


@dataclasses.dataclass(frozen=True)
class Archive:
    """Expired partitions kept out of the hot table for a while before they are dropped
    (``IDEMPOTENCY_ARCHIVE_RETENTION``; PostgreSQL only, SQLite has no partitions).

    :param schema: where detached partitions go (``IDEMPOTENCY_ARCHIVE_SCHEMA``).
    :param retention: seconds an archived partition is kept after it was detached.
    """

    schema: str
    retention: float


@dataclasses.dataclass(frozen=True)
class MaintenanceReport:
    """What one maintenance run did (or, on a dry run, would do)."""

    created: tuple[str, ...] = ()
    dropped: tuple[str, ...] = ()
    purged: int = 0
    dry_run: bool = False
    #: Audit trail upkeep (``IDEMPOTENCY_AUDIT``): monthly partitions created and dropped past
    #: the retention (PostgreSQL), rows deleted past it (DEFAULT partition, SQLite).
    audit_created: tuple[str, ...] = ()
    audit_dropped: tuple[str, ...] = ()
    audit_purged: int = 0
    #: With an :class:`Archive`: expired partitions detached into its schema (instead of
    #: ``dropped``), and archived ones dropped past its retention.
    archived: tuple[str, ...] = ()
    archive_dropped: tuple[str, ...] = ()

    def as_dict(self) -> dict[str, t.Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Health:
    """What the table says right now, for gauges (``flask idem metrics``, ``/metrics``)."""

    #: Records in progress, and those of them whose lease has expired (their owner is gone).
    in_progress: int
    lease_expired: int
    unknown: int
    reopened: int
    #: Seconds since the oldest record still in progress was claimed; None when there is none.
    oldest_in_progress_age: float | None
    #: Partitions ready after the current one (PostgreSQL); None on SQLite.
    partitions_ahead: int | None = None
    #: Partitions in the archive schema (PostgreSQL with an :class:`Archive`); else None.
    archived_partitions: int | None = None
