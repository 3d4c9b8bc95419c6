"""Bearer API keys: who is calling, which decides the tenant and the rate-limit bucket."""

from __future__ import annotations

import functools
import hashlib
import typing as t

from flask import g, request

from . import problems

P = t.ParamSpec("P")
R = t.TypeVar("R")

#: API key -> tenant. A real service would look hashed keys up in its database.
API_KEYS = {"sk_test_alpha": "alpha", "sk_test_beta": "beta", "sk_test_alpha_read": "alpha"}
#: What each API key may do (keys not listed may do everything).
PERMISSIONS = {"sk_test_alpha_read": frozenset({"payments:read"})}


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
    g.permissions = PERMISSIONS.get(token)
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


def requires(permission: str) -> t.Callable[[t.Callable[P, R]], t.Callable[P, R]]:
    """View decorator refusing API keys without ``permission`` (403).

    Placed above ``@idem.idempotent``, it runs before the claim: a key without the permission
    never sees a stored response, a 409 or a 422 of a key its tenant used.
    """

    def decorate(view: t.Callable[P, R]) -> t.Callable[P, R]:
        @functools.wraps(view)
        def checked(*args: P.args, **kwargs: P.kwargs) -> R:
            granted = g.get("permissions")
            if granted is not None and permission not in granted:
                raise problems.forbidden(permission)
            return view(*args, **kwargs)

        return checked

    return decorate
