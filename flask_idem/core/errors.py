"""Exceptions raised by flask_idem outside of HTTP responses."""

from __future__ import annotations

import typing as t

if t.TYPE_CHECKING:
    from .record import Scope


class IdempotencyError(Exception):
    """Root of every flask_idem exception."""


class StoreUnavailable(IdempotencyError):
    """The store could not be reached or failed; callers must fail closed (never run the view)."""

    #: What the 503 may tell the client beyond "cannot be reached", or None: a failure whose
    #: cause is known and has a fix (:class:`SchemaMissing`) says so.
    detail: str | None = None
    #: A claim the server may still carry out after this failure (a silent server that wakes
    #: up and runs the statement it had received), as the scope with its digest and the
    #: token the record would hold; None when no claim can have landed. The caller, which
    #: runs nothing, gives it back (:meth:`flask_idem.lease.LeaseKeeper.give_back`).
    unanswered_claim: tuple[Scope, str] | None = None


#: What to do about a missing or outdated schema, in logs, CLI errors and 503 answers.
UPGRADE_HINT = "run `flask idem db upgrade` (or `flask db upgrade heads` with Flask-Migrate)"


class SchemaMissing(StoreUnavailable):
    """A store statement failed because flask_idem's table, function or column is missing:
    the database was never migrated, or not since flask_idem was upgraded.

    Callers fail closed as for any store failure; the message and :attr:`detail` say how to
    migrate, where a bare 503 would read like an outage.
    """

    def __init__(self, reason: str) -> None:
        super().__init__(f"flask_idem's schema is missing or outdated ({reason}): {UPGRADE_HINT}")
        #: The database's own words (names a table, function or column, never a value).
        self.reason = reason
        self.detail = (
            f"The idempotency store is not migrated: {UPGRADE_HINT}. The request was not executed."
        )


class ConfigurationError(IdempotencyError, ValueError):
    """An ``IDEMPOTENCY_*`` setting or constructor argument is invalid."""


class GuardNotFound(ConfigurationError):
    """An ``@idem.idempotent`` guard was entered under the claim of the outer guard that
    ``protect_blueprint`` or ``IDEMPOTENCY_PROTECT_ALL`` puts around the whole view: the
    decorators above it (authorization) ran after the claim. The view is not run; the request
    fails as if it had raised (500)."""


class UnreadableResponse(IdempotencyError):
    """A stored response cannot be decoded: malformed, encrypted with a key that is not
    configured, or failing authentication. The message names key ids, never key material."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"stored response unreadable: {reason}")
        self.reason = reason


class JobError(IdempotencyError):
    """A delivered job message that was not run; ``retryable`` tells the queue what to do.

    The message is safe to show and log: it names the job and the key hash, never the key.
    """

    #: Whether delivering the message again later can succeed (retry it) or never can.
    retryable: bool = True

    def __init__(self, message: str, *, retry_after: float = 1.0) -> None:
        super().__init__(message)
        #: Seconds after which a redelivery may succeed (a queue's countdown).
        self.retry_after = retry_after


class JobInProgress(JobError):
    """Another worker runs this message now (its lease is held): redeliver it later, when it
    either completed (the redelivery gets its result) or died (the redelivery takes over)."""


class JobOutcomePending(JobError):
    """A run of this message may have had its effect but its outcome is unknown, and the job's
    ``recovery="fail"`` forbids running it again: a reconciler or an operator settles it."""


class JobRefused(JobError):
    """The job answered through ``idem.refuse(value)``: it did nothing, its key was given back,
    and a redelivery runs it again. ``value`` is what it refused with.

    One raised by a job run inline inside another job, and let through by it, says so of the
    inner job only: the outer job's key is left ``unknown`` (it may have had effects before the
    call), as after any other exception."""

    def __init__(self, message: str, *, value: t.Any = None) -> None:
        super().__init__(message)
        self.value = value


class JobKeyReused(JobError):
    """The key came back with different arguments: another operation, never this message's
    redelivery. Retrying cannot help: a new operation needs a new key."""

    retryable = False


class JobResultNotStored(JobError):
    """The message ran but its result was not storable (not JSON, or larger than
    ``IDEMPOTENCY_MAX_BODY``): it cannot be replayed, and it is never run again."""

    retryable = False


class JobResultUnreadable(JobError):
    """The message ran, but its stored result cannot be decrypted here (its encryption key is
    not configured): a redelivery succeeds once it is, and the job is never run again."""

    def __init__(self, message: str, *, retry_after: float = 30) -> None:
        super().__init__(message, retry_after=retry_after)


#: Every exception after which a job's message must go back to the queue, for a queue's retry
#: filter (Celery's ``autoretry_for``): the :class:`JobError` subclasses that are ``retryable``,
#: and :class:`StoreUnavailable` (the database is down: nothing ran, or the run's writes rolled
#: back and its key is given up or expires). A message failed on any of them is lost.
RETRYABLE_JOB_ERRORS: tuple[type[IdempotencyError], ...] = (
    StoreUnavailable,
    JobInProgress,
    JobOutcomePending,
    JobRefused,
    JobResultUnreadable,
)
