"""The inspection endpoint: "did my request go through?", answered from the idempotency record.

``GET <prefix>/requests[?endpoint=POST /v1/payments]`` with the key in the
``Idempotency-Key`` header, or ``POST <prefix>/requests`` with the JSON body
``{"key": "...", "endpoint": "..."}`` (``endpoint`` optional). Never in the URL: URLs end up
in access logs, proxies and browser histories. ``init_app`` registers it under
``IDEMPOTENCY_BLUEPRINT_PREFIX`` (``/idempotency``; None switches it off).

Parameters are validated before any lookup: a key as for protected requests, an endpoint of at
most :data:`MAX_ENDPOINT` printable characters (no NUL or other control characters), and a
POST body of at most :data:`MAX_QUERY_BODY` bytes holding a JSON object; anything else is a
400 ``parameter-invalid`` (or 413 for a larger body), never a database error.

The answer, ``{"requests": [...]}``, lists the key's live records of the caller's tenant, one
per endpoint it was used on: state, first seen, completed at, stored status, whether retries
replay, and when the key expires. Stored bodies and headers only with
``IDEMPOTENCY_INSPECT_BODIES``.

Who may ask for records
    The tenant comes from the extension's tenant resolver, after the application's own
    authentication hooks. No tenant means an anonymous caller: 401 ``authentication-required``
    (not the 500 ``tenant-unresolved`` of protected writes: an anonymous read is a client
    condition, not a configuration error, and must not page anyone).
Isolation
    Records are looked up under the caller's tenant only, so another tenant's key answers the
    very same 404 as a key nobody used: the body cannot tell them apart. A record of a
    principal (``IDEMPOTENCY_PRINCIPAL``) is shown only to that principal, as the application's
    ``IDEMPOTENCY_PRINCIPAL`` resolves the caller; an ``endpoint`` filter finds an account-wide
    record (``scope="account"``) of that endpoint too.

The policy, ``GET <prefix>/policy``, is public (no tenant asked, no record read): what a client
needs before its first request (the header, the methods that claim, whether a key is required,
how long a key is kept, the limit on new keys), the application's defaults, the same for every
caller. A view's own ``ttl=`` is announced on its answers (``Idempotency-Retention``); an
application with such views documents them too (the draft asks a server to publish its expiry
policy).
"""

from __future__ import annotations

import functools
import json
import math
import typing as t

from flask import Blueprint, current_app, request
from flask.typing import ResponseReturnValue
from werkzeug.exceptions import HTTPException

from ..core.errors import StoreUnavailable
from ..core.idempotency_keys import InvalidKey, normalize, read_key
from ..core.problem import (
    AuthenticationRequired,
    KeyInvalid,
    KeyMissing,
    KeyUnknown,
    ParameterInvalid,
    Problem,
    StoreUnavailableProblem,
)
from ..core.scopes import PrincipalInvalid, endpoint_of, resolve_principal, split
from ..core.serialization import request_schema
from ..state import AppState
from ..store import operator_store
from .body import read_body

if t.TYPE_CHECKING:
    from .extension import Idempotency

#: The answer may change at any moment and names a tenant's operations: never cache it.
_NO_STORE = ("Cache-Control", "no-store")
#: The policy document names no one and changes with a deployment only.
_PUBLIC = ("Cache-Control", "public, max-age=300")
#: The longest endpoint filter accepted (records store at most 255 characters).
MAX_ENDPOINT = 512
#: The largest POST body accepted: a key and an endpoint.
MAX_QUERY_BODY = 4096


def create_blueprint(extension: Idempotency) -> Blueprint:
    """The inspection blueprint of one application (exempt from idempotency protection)."""
    blueprint = Blueprint("flask_idem", __name__, template_folder="templates")

    @blueprint.route("/requests", methods=["GET", "POST"])
    @extension.exempt
    @_returning_problems
    def request_status() -> ResponseReturnValue:
        tenant = extension.current_tenant()
        if tenant is None:
            raise AuthenticationRequired("Authenticate to look up your idempotency keys.")
        state = AppState.current()
        if request.method == "POST":
            scope_key, endpoint = _from_body(state.settings.headers)
        else:
            scope_key = _key(None, state.settings.headers)
            endpoint = _endpoint(request.args.get("endpoint"))
        try:
            found = operator_store(state.store, "the inspection endpoint").find(tenant, scope_key)
        except StoreUnavailable:
            raise StoreUnavailableProblem(
                "The idempotency store cannot be reached; try again."
            ) from None
        wanted = None if endpoint is None else _record_endpoint(endpoint)
        try:
            principal = resolve_principal(state.settings.principal)
        except PrincipalInvalid:
            # Then only the records of no principal are shown (a principal's records never
            # to a caller who is not it).
            principal = None
        records = [
            record
            for record in found
            if split(record.scope.endpoint)[0] in (None, principal)
            and (wanted is None or endpoint_of(record, (wanted,), state.store.keys) == wanted)
        ]
        if not records:
            # One body for "nobody used it" and "another tenant used it".
            raise KeyUnknown(
                "No live request with this idempotency key is known for you: it was never "
                "used, or it has expired.",
                headers=[_NO_STORE],
            )
        schema = request_schema(bodies=state.settings.inspect_bodies, many=True)
        return {"requests": schema.dump(records)}, 200, [_NO_STORE]

    @blueprint.route("/policy", methods=["GET"])
    @extension.exempt
    def policy() -> ResponseReturnValue:
        # The same for every caller, and read before any request: no tenant, no records.
        settings = AppState.current().settings
        document = {
            "header": settings.header,
            "methods": sorted(settings.methods),
            "key_required": settings.key_required,
            "retention_seconds": math.floor(settings.ttl),
            "key_rate_limit": settings.key_rate_limit,
        }
        return document, 200, [_PUBLIC]

    from . import operator_page as operator

    operator.register(blueprint, extension)
    return blueprint


def _returning_problems(
    view: t.Callable[[], ResponseReturnValue],
) -> t.Callable[[], ResponseReturnValue]:
    """Return flask_idem's problems as the answer, never raise them through the application's
    error handlers: an ``errorhandler(Exception)`` or ``errorhandler(HTTPException)`` would
    answer its own 500 or JSON instead of the documented problem document."""

    @functools.wraps(view)
    def answer() -> ResponseReturnValue:
        try:
            return view()
        except Problem as problem:
            return problem.get_response()

    return answer


def _key(given: t.Any, headers: t.Sequence[str]) -> str:
    """The key from the POST body, else from the idempotency header."""
    if given is not None and not isinstance(given, str):
        raise ParameterInvalid("'key' must be a string.")
    try:
        key = normalize(given) if given is not None else read_key(request.headers, headers)
    except InvalidKey as exc:
        raise KeyInvalid(str(exc)) from None
    if key is None:
        raise KeyMissing(
            f"Give the key in the {headers[0]} header, or as 'key' in a POST body; never in "
            "the URL."
        )
    return key


def _from_body(headers: t.Sequence[str]) -> tuple[str, str | None]:
    raw = read_body(request, MAX_QUERY_BODY)
    try:
        document = json.loads(raw) if raw else {}
    except (ValueError, RecursionError):
        raise ParameterInvalid("The body must be a JSON object.") from None
    if not isinstance(document, dict) or set(document) - {"key", "endpoint"}:
        raise ParameterInvalid("The body must be a JSON object with 'key' and 'endpoint'.")
    return _key(document.get("key"), headers), _endpoint(document.get("endpoint"))


def _endpoint(spelled: t.Any) -> str | None:
    """A validated endpoint filter: printable text (no NUL), a method and a path."""
    if spelled is None:
        return None
    if (
        not isinstance(spelled, str)
        or not 0 < len(spelled) <= MAX_ENDPOINT
        or not spelled.isprintable()
        or not spelled.isascii()
    ):
        raise ParameterInvalid(
            f"'endpoint' must be 1 to {MAX_ENDPOINT} printable ASCII characters, e.g. "
            "'POST /v1/payments'."
        )
    method, _, path = spelled.strip().partition(" ")
    if not method.isalpha() or not path.startswith("/"):
        raise ParameterInvalid("'endpoint' must be a method and a path, e.g. 'POST /v1/payments'.")
    return spelled


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
