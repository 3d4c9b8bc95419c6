"""RFC 9457 problem documents: the only place that builds flask_idem's error bodies.

Each problem is a werkzeug ``HTTPException``, so raising one anywhere in a request (a hook or a
view) renders ``application/problem+json`` without any error handler. Its ``type`` is the
configured base URI plus the problem's name, e.g. ``.../problems/idempotency-key-reused``.
"""

from __future__ import annotations

import json
import typing as t

from flask import current_app, has_app_context, has_request_context, request
from werkzeug.exceptions import HTTPException
from werkzeug.wrappers import Response

from . import wire
from .config import DEFAULTS, EXTENSION_NAME

MEDIA_TYPE = "application/problem+json"


class Problem(HTTPException):
    """An HTTP error answered as ``application/problem+json``."""

    #: Last path segment of the ``type`` URI; stable, machine-readable.
    problem: str = "internal-error"
    code: int = 500
    title: str = "Internal Server Error"

    def __init__(
        self,
        detail: str,
        *,
        problem: str | None = None,
        status: int | None = None,
        title: str | None = None,
        headers: t.Iterable[tuple[str, str]] = (),
        extensions: t.Mapping[str, t.Any] | None = None,
    ) -> None:
        """:param problem: override the class's problem name (applications' own problems).
        :param extensions: extra members of the document, e.g. ``{"errors": {...}}``.
        """
        super().__init__(description=detail)
        if problem is not None:
            self.problem = problem
        if status is not None:
            self.code = status
        if title is not None:
            self.title = title
        self.extra_headers = list(headers)
        self.extensions = dict(extensions or {})
        self.type_uri = problem_type(self.problem)
        self.instance = request.path if has_request_context() else None

    def document(self) -> dict[str, t.Any]:
        body: dict[str, t.Any] = {
            "type": self.type_uri,
            "title": self.title,
            "status": self.code,
            "detail": self.description,
        }
        if self.instance is not None:
            body["instance"] = self.instance
        body.update(self.extensions)
        return body

    def get_body(self, environ: t.Any = None, scope: t.Any = None) -> str:
        return json.dumps(self.document(), separators=(",", ":"))

    def get_headers(self, environ: t.Any = None, scope: t.Any = None) -> list[tuple[str, str]]:
        return [("Content-Type", MEDIA_TYPE), *self.extra_headers]

    def get_response(self, environ: t.Any = None, scope: t.Any = None) -> Response:
        """The application's response class when there is one (extensions such as
        Flask-Limiter accept only ``flask.Response``)."""
        response_class = current_app.response_class if has_app_context() else Response
        return response_class(
            self.get_body(environ, scope), self.code, self.get_headers(environ, scope)
        )


def problem_type(name: str) -> str:
    """The absolute ``type`` URI of a problem name under the application's base URI."""
    base = DEFAULTS["IDEMPOTENCY_PROBLEM_BASE"]
    if has_app_context():
        state = current_app.extensions.get(EXTENSION_NAME)
        if state is not None:
            base = state.settings.problem_base
    return f"{base}{name}"


def _retry_after(seconds: int) -> list[tuple[str, str]]:
    return [("Retry-After", str(max(1, int(seconds))))]


class KeyMissing(Problem):
    problem = "idempotency-key-missing"
    code = 400
    title = "Idempotency key missing"


class KeyInvalid(Problem):
    problem = "idempotency-key-invalid"
    code = 400
    title = "Idempotency key invalid"


class RequestInProgress(Problem):
    problem = wire.IN_PROGRESS
    code = 409
    title = "Request in progress"

    def __init__(self, detail: str, *, retry_after: int) -> None:
        super().__init__(detail, headers=_retry_after(retry_after))


class KeyReused(Problem):
    problem = "idempotency-key-reused"
    code = 422
    title = "Idempotency key reused"


class KeyUsedElsewhere(Problem):
    """An account-wide key came back on another endpoint than the one it was first used on
    (``scope="account"``): never a retry, and never that endpoint's answer replayed."""

    problem = "idempotency-key-used-elsewhere"
    code = 422
    title = "Idempotency key used on another endpoint"


class OutcomePending(Problem):
    """The first attempt may have had an effect and nobody knows yet: ``Retry-After`` says
    when to ask again (with the same key), by default the cadence of the documented
    ``flask idem reconcile`` cron, which settles the record."""

    problem = wire.OUTCOME_PENDING
    code = 409
    title = "Outcome pending"

    def __init__(self, detail: str, *, retry_after: int = 300) -> None:
        super().__init__(detail, headers=_retry_after(retry_after))


class KeyRateLimited(Problem):
    """The tenant made more new keys than ``IDEMPOTENCY_KEY_RATE_LIMIT`` (or the view's
    ``key_rate_limit=``) allows: nothing ran and nothing was recorded, so a retry with the same
    key after ``Retry-After`` is a first request."""

    problem = "idempotency-key-rate-limited"
    code = 429
    title = "Too many new idempotency keys"

    def __init__(self, detail: str, *, retry_after: int) -> None:
        super().__init__(detail, headers=_retry_after(retry_after))


class ResponseNotStored(Problem):
    problem = "response-not-stored"
    code = 409
    title = "Response not stored"


class StoreUnavailableProblem(Problem):
    problem = "store-unavailable"
    code = 503
    title = "Idempotency store unavailable"

    def __init__(self, detail: str, *, retry_after: int = 1) -> None:
        super().__init__(detail, headers=_retry_after(retry_after))


class StoredResponseUnreadable(Problem):
    """The operation completed but its stored response cannot be decrypted or decoded.

    503 with ``Retry-After``: the request is not executed again, and a retry with the same key
    replays once an operator restores the missing encryption key.
    """

    problem = "stored-response-unreadable"
    code = 503
    title = "Stored response unreadable"

    def __init__(self, detail: str, *, retry_after: int = 30) -> None:
        super().__init__(detail, headers=_retry_after(retry_after))


class TenantUnresolved(Problem):
    problem = "tenant-unresolved"
    code = 500
    title = "Tenant not resolved"


class PrincipalUnresolved(Problem):
    """The principal callable (``IDEMPOTENCY_PRINCIPAL``, ``principal=``) raised, or returned
    no usable principal: the key's namespace is unknown, so the request is not run."""

    problem = "principal-unresolved"
    code = 500
    title = "Principal not resolved"


class InternalError(Problem):
    problem = "internal-error"
    code = 500
    title = "Internal Server Error"


class AuthenticationRequired(Problem):
    problem = "authentication-required"
    code = 401
    title = "Authentication required"


class KeyUnknown(Problem):
    problem = "idempotency-key-unknown"
    code = 404
    title = "Idempotency key unknown"


class RequestBodyTooLarge(Problem):
    problem = "request-body-too-large"
    code = 413
    title = "Request body too large"


class RequestBodyIncomplete(Problem):
    problem = "request-body-incomplete"
    code = 400
    title = "Request body incomplete"


class ParameterInvalid(Problem):
    problem = "parameter-invalid"
    code = 400
    title = "Parameter invalid"
