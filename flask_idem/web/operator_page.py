"""The operator page: stuck and unknown records, and one key's timeline, read-only.

``GET <prefix>/operator`` lists the records nobody owns (in progress past their lease,
``unknown``, ``reopened``) of the tenants the user may see; a form sends a key (in the POST
body, never in a URL: URLs end up in access logs, proxies and browser histories) and the answer
shows that key's live records and, with ``IDEMPOTENCY_AUDIT``, its audit timeline. It changes
nothing: releasing and reconciling stay in ``flask idem``.

Who may see it is the application's decision: ``Idempotency(operator=...)`` or
``@idem.operator_access`` registers a callable, called after the application's own hooks,
that returns None or False (403), a tenant (a string) or a collection of tenants (strings; an
empty one is 403), or True for every tenant. Anything else (a number, bytes, a mapping, a
user object, a collection holding something other than strings) is the callable's bug, not a
decision: it is logged as a :class:`~flask_idem.core.errors.ConfigurationError` and answered 500
``internal-error``, never guessed at. Without a callable the page does not exist (404).
Records of other tenants are never read: the tenants go into the queries. Stored bodies
appear only with ``IDEMPOTENCY_INSPECT_BODIES``. Server-rendered (Jinja), no JavaScript; the
answer is never cached and may not be framed.
"""

from __future__ import annotations

import collections.abc
import logging
import typing as t

from flask import Blueprint, render_template, request
from flask.typing import ResponseReturnValue
from werkzeug.exceptions import Forbidden, NotFound

from ..core.errors import ConfigurationError, StoreUnavailable
from ..core.idempotency_keys import InvalidKey, key_hash, normalize
from ..core.problem import InternalError
from ..core.serialization import record_schema
from ..state import AppState
from ..store import Store, operator_store

if t.TYPE_CHECKING:
    from .extension import Idempotency

#: What the authorization callable returns: None/False (refused), True (every tenant), a
#: tenant, or a collection of tenants.
Access = bool | str | t.Collection[str] | None
OperatorAccess = t.Callable[[], Access]

log = logging.getLogger("flask_idem")
_REFUSED = "You may not see the idempotency operator page."

#: Stuck records listed on the page.
LIST_LIMIT = 200
#: The longest tenant a record can hold (the column's length).
TENANT_LENGTH = 255
_HEADERS = {
    "Cache-Control": "no-store",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Content-Security-Policy": (
        "default-src 'none'; style-src 'unsafe-inline'; form-action 'self'; frame-ancestors 'none'"
    ),
}


def allowed_tenants(access: object) -> frozenset[str] | None:
    """The tenants ``access`` grants (None: every tenant).

    :raises Forbidden: it grants nothing (None, False, an empty string or collection).
    :raises ConfigurationError: it is none of those values, nor True, a tenant or a collection
        of tenants; the message names its type only (it may be a user object).
    """
    if access is True:
        return None
    if access is None or access is False or access == "":
        raise Forbidden(_REFUSED)
    if isinstance(access, str):
        return frozenset({access})
    if isinstance(access, collections.abc.Collection) and not isinstance(
        access, (bytes, bytearray, collections.abc.Mapping)
    ):
        tenants = frozenset(access)
        if all(isinstance(tenant, str) and tenant for tenant in tenants):
            if not tenants:
                raise Forbidden(_REFUSED)
            return t.cast("frozenset[str]", tenants)
        kinds = sorted({type(tenant).__name__ for tenant in tenants})
        got = f"{type(access).__name__} of {', '.join(kinds)}"
    else:
        got = type(access).__name__
    raise ConfigurationError(
        f"the operator_access callable returned {got}: return None or False (refused), True "
        "(every tenant), a tenant (a non-empty string) or a collection of tenants (strings)"
    )


def register(blueprint: Blueprint, extension: Idempotency) -> None:
    """Add the page to the inspection blueprint. It exists only while an authorization is
    registered, whenever that happened (before or after ``init_app``): else 404."""

    @blueprint.route("/operator", methods=["GET", "POST"])
    @extension.exempt
    def operator_page() -> ResponseReturnValue:
        if extension.operator is None:
            raise NotFound()
        try:
            tenants = allowed_tenants(extension.operator())
        except ConfigurationError as exc:
            log.error("%s", exc)
            return InternalError(
                "The operator page's authorization is misconfigured; see the server log."
            ).get_response()
        state = AppState.current()
        store = operator_store(state.store, "the operator page")
        context: dict[str, t.Any] = {
            "tenants": sorted(tenants) if tenants is not None else None,
            "audit": store.audit,
            "bodies": state.settings.inspect_bodies,
            "lookup": None,
            "error": None,
        }
        try:
            stuck = store.stuck(limit=LIST_LIMIT, tenants=tenants)
            context["stuck"] = [
                record_schema(bodies=False, keys=False).dump(record) for record in stuck
            ]
            context["stuck_limited"] = len(stuck) == LIST_LIMIT
            if request.method == "POST":
                context["lookup"] = _lookup(state, store, tenants)
        except StoreUnavailable:
            context["stuck"], context["error"] = [], "The store cannot be reached; try again."
            return render_template("flask_idem/operator.html", **context), 503, _HEADERS
        except _BadLookup as exc:
            context["error"] = str(exc)
            return render_template("flask_idem/operator.html", **context), 400, _HEADERS
        return render_template("flask_idem/operator.html", **context), 200, _HEADERS


class _BadLookup(Exception):
    """The lookup form was filled in wrongly; the message is shown."""


def _lookup(state: AppState, store: Store, tenants: frozenset[str] | None) -> dict[str, t.Any]:
    form = request.form
    tenant = (form.get("tenant") or "").strip()
    if tenants is not None and len(tenants) == 1 and not tenant:
        (tenant,) = tenants
    if not tenant:
        raise _BadLookup("Choose the tenant whose key this is.")
    if len(tenant) > TENANT_LENGTH or any(ord(char) < 32 or ord(char) == 127 for char in tenant):
        # No record can have it (PostgreSQL refuses a NUL outright, which was a 500).
        raise _BadLookup(
            f"A tenant is at most {TENANT_LENGTH} characters, without control characters."
        )
    if tenants is not None and tenant not in tenants:
        # The same answer as a key nobody used: the page never tells other tenants apart.
        return {"tenant": tenant, "key_hash": None, "records": [], "timeline": []}
    try:
        key = normalize(form.get("key") or "")
    except InvalidKey as exc:
        raise _BadLookup(str(exc)) from None
    records = store.find(tenant, key)
    schema = record_schema(bodies=state.settings.inspect_bodies, keys=False, many=True)
    timeline = store.history(tenant, key) if store.audit else []
    return {
        "tenant": tenant,
        "records": schema.dump(records),
        "timeline": [entry.as_json() for entry in timeline],
        "key_hashes": sorted({key_hash(r.scope) for r in records}),
    }
