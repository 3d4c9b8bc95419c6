"""Bearer API keys: who is calling, which decides the tenant and the rate-limit bucket."""

from __future__ import annotations

import hashlib

from flask import g, request

from . import problems

#: API key -> tenant. A real service would look hashed keys up in its database.
API_KEYS = {"sk_test_alpha": "alpha", "sk_test_beta": "beta"}


def authenticate() -> None:
    """``before_request`` hook: refuse unknown callers with 401 before anything else runs.

    Registered before the rate limiter and the idempotency hooks, because an idempotency key
    is no credential: an unauthenticated request must never claim, replay or count.
    """
    credentials = request.authorization
    token = credentials.token if credentials and credentials.type == "bearer" else None
    tenant = API_KEYS.get(token) if token else None
    if token is None or tenant is None:
        raise problems.unauthorized()
    g.tenant = tenant
    # The rate limiter stores its bucket names in the database: never the secret itself.
    g.api_key_id = hashlib.sha256(token.encode()).hexdigest()[:16]


def current_tenant() -> str | None:
    """The authenticated tenant, which scopes idempotency keys and data (None before auth)."""
    value: str | None = g.get("tenant")
    return value


def tenant() -> str:
    """The authenticated tenant, in views (which only run after :func:`authenticate`)."""
    return str(g.tenant)


def current_api_key_id() -> str:
    """The rate-limit bucket of the authenticated API key."""
    return str(g.api_key_id)
