"""flask_idem: idempotency keys for Flask write endpoints."""

from __future__ import annotations

from .core import __version__ as __version__
from .core import signals
from .core.errors import (
    RETRYABLE_JOB_ERRORS,
    ConfigurationError,
    IdempotencyError,
    JobError,
    JobInProgress,
    JobKeyReused,
    JobOutcomePending,
    JobRefused,
    JobResultNotStored,
    JobResultUnreadable,
    SchemaMissing,
    StoreUnavailable,
)
from .core.idempotency_keys import derive_key
from .core.options import ViewOptions
from .core.problem import Problem
from .core.record import (
    ClaimResult,
    MaintenanceReport,
    Record,
    Reservation,
    Scope,
    State,
    StoredResponse,
)
from .ops.downstream import DownstreamRecord
from .ops.reconcile import Settlement, Verdict
from .store import OperatorStore, RequestStore, Store, create_store
from .web.extension import Idempotency

__all__ = [
    "RETRYABLE_JOB_ERRORS",
    "ClaimResult",
    "ConfigurationError",
    "DownstreamRecord",
    "Idempotency",
    "IdempotencyError",
    "JobError",
    "JobInProgress",
    "JobKeyReused",
    "JobOutcomePending",
    "JobRefused",
    "JobResultNotStored",
    "JobResultUnreadable",
    "MaintenanceReport",
    "OperatorStore",
    "Problem",
    "Record",
    "RequestStore",
    "Reservation",
    "SchemaMissing",
    "Scope",
    "Settlement",
    "State",
    "Store",
    "StoreUnavailable",
    "StoredResponse",
    "Verdict",
    "ViewOptions",
    "create_store",
    "derive_key",
    "signals",
]
