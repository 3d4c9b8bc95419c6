"""Exceptions raised by flask_idem outside of HTTP responses."""

from __future__ import annotations


class IdempotencyError(Exception):
    """Root of every flask_idem exception."""


class StoreUnavailable(IdempotencyError):
    """The store could not be reached or failed; callers must fail closed (never run the view)."""


class ConfigurationError(IdempotencyError, ValueError):
    """An ``IDEMPOTENCY_*`` setting or constructor argument is invalid."""
