"""Who is calling, which decides the tenant and the rate-limit bucket: Bearer API keys, and
the provider's signature on its webhooks."""

from __future__ import annotations

import functools
import hashlib
import hmac
import time
import typing as t

from flask import current_app, g, request

from . import problems

P = t.ParamSpec("P")
R = t.TypeVar("R")

#: API key -> tenant. A real service would look hashed keys up in its database.
#: ``sk_test_alpha_2`` is a second key of the alpha account that writes too: with
#: ``SAMPLE_KEYS_PER_API_KEY`` each API key has idempotency keys of its own.
API_KEYS = {
    "sk_test_alpha": "alpha",
    "sk_test_beta": "beta",
    "sk_test_alpha_read": "alpha",
    "sk_test_alpha_2": "alpha",
}
#: What each API key may do (keys not listed may do everything).
PERMISSIONS = {"sk_test_alpha_read": frozenset({"payments:read"})}
#: The provider's webhook signing secret of each merchant account -> tenant. The secret that
#: verifies a delivery's signature names whose event it is.
WEBHOOK_SECRETS = {"whsec_alpha": "alpha", "whsec_beta": "beta"}
SIGNATURE_HEADER = "Provider-Signature"
#: Deliveries signed longer ago than this are refused (replayed captures of old requests).
SIGNATURE_TOLERANCE = 300
#: More digits than any Unix time of the next centuries has: such a ``t=`` is refused unread.
TIMESTAMP_DIGITS = 12
#: The endpoint that authenticates by signature instead of an API key.
WEBHOOK_ENDPOINT = "webhooks.provider_event"
#: Operators' session tokens (a cookie) -> the tenants whose records they may see (True: all).
#: A real service would use its own staff login; API keys never open the operator page.
OPERATOR_TOKENS: dict[str, str | bool] = {"op_alpha": "alpha", "op_beta": "beta", "op_all": True}
OPERATOR_COOKIE = "sample_operator"
#: Operator endpoints that API keys do not open: the operator page (its own authorization,
#: :func:`operator_access`) and ``/metrics`` (``SAMPLE_METRICS_TOKEN``, if set).
OPERATOR_ENDPOINTS = ("flask_idem.operator_page", "metrics")


def authenticate() -> None:
    """``before_request`` hook: refuse unknown callers with 401 before anything else runs.

    Registered before the rate limiter and the idempotency hooks, because an idempotency key
    is no credential: an unauthenticated request must never claim, replay or count. The
    provider's webhooks are authenticated by their signature instead, also before the claim.
    """
    if request.endpoint == WEBHOOK_ENDPOINT:
        return _authenticate_webhook()
    if request.endpoint in OPERATOR_ENDPOINTS:
        return _authenticate_operator_endpoint()
    credentials = request.authorization
    token = credentials.token if credentials and credentials.type == "bearer" else None
    tenant = API_KEYS.get(token) if token else None
    if token is None or tenant is None:
        raise problems.unauthorized()
    g.tenant = tenant
    g.permissions = PERMISSIONS.get(token)
    # The rate limiter stores its bucket names in the database: never the secret itself.
    g.api_key_id = hashlib.sha256(token.encode()).hexdigest()[:16]


def api_key_id() -> str | None:
    """The principal of ``SAMPLE_KEYS_PER_API_KEY`` (``IDEMPOTENCY_PRINCIPAL``): the caller's
    API key id that :func:`authenticate` set, never the key itself."""
    return g.get("api_key_id")


def sign(secret: str, body: bytes, timestamp: int | None = None) -> str:
    """The provider's ``Provider-Signature`` header for ``body``:
    ``t=<unix time>,v1=<hex HMAC-SHA256(secret, "<t>." + body)>``."""
    timestamp = int(time.time()) if timestamp is None else timestamp
    mac = hmac.new(secret.encode(), f"{timestamp}.".encode() + body, hashlib.sha256)
    return f"t={timestamp},v1={mac.hexdigest()}"


def _authenticate_webhook() -> None:
    """Refuse a delivery whose signature no account's secret verifies (401); otherwise the
    account is the tenant. Several ``v1=`` values may come during a secret rotation. The
    header is checked before the body is read, and the body is read bounded (413)."""
    fields = [part.partition("=") for part in request.headers.get(SIGNATURE_HEADER, "").split(",")]
    stamps = [value for name, _, value in fields if name.strip() == "t"]
    signatures = [value.strip() for name, _, value in fields if name.strip() == "v1"]
    timestamp = _timestamp(stamps[0]) if len(stamps) == 1 else None
    if timestamp is None or not signatures:
        raise problems.invalid_signature()
    if abs(int(time.time()) - timestamp) > SIGNATURE_TOLERANCE:
        raise problems.invalid_signature()
    # Bounded (IDEMPOTENCY_MAX_REQUEST_BODY, 413): request.get_data() would read and hash
    # whatever an unsigned caller sends, hundreds of MiB, before refusing it. Imported here:
    # the extensions module imports this one.
    from .extensions import idem

    body = idem.request_body()
    for secret, account in WEBHOOK_SECRETS.items():
        expected = sign(secret, body, timestamp).rpartition("v1=")[2]
        if any(hmac.compare_digest(expected, given) for given in signatures):
            g.tenant = account
            g.permissions = frozenset({"webhooks:receive"})
            g.api_key_id = hashlib.sha256(f"webhook {account}".encode()).hexdigest()[:16]
            return
    raise problems.invalid_signature()


def _timestamp(value: str) -> int | None:
    """The signature's Unix time, or None when ``value`` is not one.

    Bounded in length before ``int()``: a timestamp of thousands of digits would otherwise
    raise (the integer-string limit, or an overflow when compared with ``time.time()``).
    """
    value = value.strip()
    if not (len(value) <= TIMESTAMP_DIGITS and value.isascii() and value.isdigit()):
        return None
    return int(value)


def _authenticate_operator_endpoint() -> None:
    """``/metrics`` is for the scraper: open on a private network, or behind
    ``SAMPLE_METRICS_TOKEN`` (a Bearer token) when that is set. The operator page authorizes
    in :func:`operator_access`."""
    if request.endpoint != "metrics":
        return
    token = current_app.config.get("SAMPLE_METRICS_TOKEN")
    credentials = request.authorization
    given = credentials.token if credentials and credentials.type == "bearer" else None
    if token and not (given and hmac.compare_digest(given, token)):
        raise problems.unauthorized()


def operator_access() -> str | bool | None:
    """Who may see the idempotency operator page: an operator's session cookie names the
    tenants (None: 403)."""
    return OPERATOR_TOKENS.get(request.cookies.get(OPERATOR_COOKIE, ""))


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
