"""flask_idem: idempotency keys for Flask write endpoints."""

from __future__ import annotations

from . import signals
from .audit import DownstreamRecord
from .errors import (
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
from .extension import Idempotency
from .keys import derive_key
from .options import ViewOptions
from .problem import Problem
from .reconcile import Settlement, Verdict
from .record import (
    ClaimResult,
    MaintenanceReport,
    Record,
    Reservation,
    Scope,
    State,
    StoredResponse,
)
from .store import Store, create_store

__version__ = "0.1.0"

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
    "Problem",
    "Record",
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
