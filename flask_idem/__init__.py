"""flask_idem: idempotency keys for Flask write endpoints."""

from __future__ import annotations

from .errors import ConfigurationError, IdempotencyError, StoreUnavailable
from .record import ClaimResult, MaintenanceReport, Record, Scope, State, StoredResponse
from .store import Store, create_store

__version__ = "0.1.0"

__all__ = [
    "ClaimResult",
    "ConfigurationError",
    "IdempotencyError",
    "MaintenanceReport",
    "Record",
    "Scope",
    "State",
    "Store",
    "StoreUnavailable",
    "StoredResponse",
    "create_store",
]
