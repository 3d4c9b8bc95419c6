"""Exceptions raised by flask_idem outside of HTTP responses."""

from __future__ import annotations


class IdempotencyError(Exception):
    """Root of every flask_idem exception."""


class StoreUnavailable(IdempotencyError):
    """The store could not be reached or failed; callers must fail closed (never run the view)."""


class ConfigurationError(IdempotencyError, ValueError):
    """An ``IDEMPOTENCY_*`` setting or constructor argument is invalid."""


class UnreadableResponse(IdempotencyError):
    """A stored response cannot be decoded: malformed, encrypted with a key that is not
    configured, or failing authentication. The message names key ids, never key material."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"stored response unreadable: {reason}")
        self.reason = reason
