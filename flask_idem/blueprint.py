"""The inspection endpoint: "did my request go through?", answered from the idempotency record.

``GET <prefix>/requests/<key>[?endpoint=POST /v1/payments]``, or ``GET <prefix>/requests``
with the key in the ``Idempotency-Key`` header (keys in URLs end up in access logs; the header
form avoids that). ``init_app`` registers it under ``IDEMPOTENCY_BLUEPRINT_PREFIX``
(``/idempotency``; None switches it off).

The answer, ``{"requests": [...]}``, lists the key's live records of the caller's tenant, one
per endpoint it was used on: state, first seen, completed at, stored status, whether retries
replay, and when the key expires. Stored bodies and headers only with
``IDEMPOTENCY_INSPECT_BODIES``.

Who may ask
    The tenant comes from the extension's tenant resolver, after the application's own
    authentication hooks. No tenant means an anonymous caller: 401 ``authentication-required``
    (not the 500 ``tenant-unresolved`` of protected writes: an anonymous read is a client
    condition, not a configuration error, and must not page anyone).
Isolation
    Records are looked up under the caller's tenant only, so another tenant's key answers the
    very same 404 as a key nobody used: the body cannot tell them apart.
"""

from __future__ import annotations

import typing as t

from flask import Blueprint, current_app, request
from flask.typing import ResponseReturnValue
from werkzeug.exceptions import HTTPException

from .errors import StoreUnavailable
from .keys import InvalidKey, normalize, read_key
from .problem import (
    AuthenticationRequired,
    KeyInvalid,
    KeyMissing,
    KeyUnknown,
    StoreUnavailableProblem,
)
from .serialization import request_schema
from .state import AppState

if t.TYPE_CHECKING:
    from .extension import Idempotency

#: The answer may change at any moment and names a tenant's operations: never cache it.
_NO_STORE = ("Cache-Control", "no-store")


def create_blueprint(extension: Idempotency) -> Blueprint:
    """The inspection blueprint of one application (exempt from idempotency protection)."""
    blueprint = Blueprint("flask_idem", __name__)

    @blueprint.get("/requests", defaults={"key": None})
    @blueprint.get("/requests/<path:key>")
    @extension.exempt
    def request_status(key: str | None) -> ResponseReturnValue:
        tenant = extension.current_tenant()
        if tenant is None:
            raise AuthenticationRequired("Authenticate to look up your idempotency keys.")
        state = AppState.current()
        scope_key = _key(key, state.settings.headers)
        endpoint = request.args.get("endpoint")
        try:
            records = state.store.find(
                tenant, scope_key, None if endpoint is None else _record_endpoint(endpoint)
            )
        except StoreUnavailable:
            raise StoreUnavailableProblem(
                "The idempotency store cannot be reached; try again."
            ) from None
        if not records:
            # One body for "nobody used it" and "another tenant used it".
            raise KeyUnknown(
                "No live request with this idempotency key is known for you: it was never "
                "used, or it has expired.",
                headers=[_NO_STORE],
            )
        schema = request_schema(bodies=state.settings.inspect_bodies, many=True)
        return {"requests": schema.dump(records)}, 200, [_NO_STORE]

    return blueprint


def _key(path_key: str | None, headers: t.Sequence[str]) -> str:
    """The key from the URL, else from the idempotency header."""
    try:
        key = normalize(path_key) if path_key is not None else read_key(request.headers, headers)
    except InvalidKey as exc:
        raise KeyInvalid(str(exc)) from None
    if key is None:
        raise KeyMissing(f"Give the key in the URL or in the {headers[0]} header.")
    return key


def _record_endpoint(spelled: str) -> str:
    """The endpoint as records spell it (``POST /v1/orders/<int:id>/refunds``).

    Clients know the path they called (``POST /v1/orders/42/refunds``), not the URL rule, so a
    path that matches a rule is translated; anything else is taken as spelled.
    """
    method, _, path = spelled.strip().partition(" ")
    method = method.upper()
    try:
        rule, _ = current_app.url_map.bind("").match(path, method=method, return_rule=True)
    except HTTPException:  # no such route, wrong method, or a redirect: take it as spelled
        return f"{method} {path}"
    return f"{method} {rule.rule}"
