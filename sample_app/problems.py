"""The sample app's own problem documents, built with the extension's :class:`Problem`.

Each is raised (or returned) from a hook or a view; the extension renders it as
``application/problem+json`` and, in a protected view, stores and replays it like any result.
"""

from __future__ import annotations

import re
import typing as t

from werkzeug.exceptions import HTTPException
from werkzeug.wrappers import Response

from flask_idem import Problem
from flask_idem.core.problem import InternalError, StoreUnavailableProblem


def unauthorized() -> Problem:
    return Problem(
        "Send a valid API key as 'Authorization: Bearer <api key>'.",
        problem="unauthorized",
        status=401,
        title="Unauthorized",
        headers=[("WWW-Authenticate", "Bearer")],
    )


def rate_limited(retry_after: int) -> Problem:
    return Problem(
        "This API key sent too many requests; retry after the number of seconds in Retry-After.",
        problem="rate-limited",
        status=429,
        title="Too many requests",
        headers=[("Retry-After", str(retry_after))],
    )


def invalid_request(errors: t.Mapping[str, t.Any]) -> Problem:
    return Problem(
        "The request body is invalid; see 'errors' for the messages of each field.",
        problem="invalid-request",
        status=400,
        title="Invalid request",
        extensions={"errors": errors},
    )


def payment_not_found(payment_id: str) -> Problem:
    return Problem(
        # Shortened: the id comes from the URL and may be anything.
        f"No payment {payment_id[:64]!r} exists for this API key.",
        problem="payment-not-found",
        status=404,
        title="Payment not found",
    )


def refund_exceeds_payment(remaining: int) -> Problem:
    return Problem(
        f"The refund exceeds what is left to refund on this payment ({remaining}).",
        problem="refund-exceeds-payment",
        status=400,
        title="Refund exceeds payment",
        extensions={"errors": {"amount": [f"Must be at most {remaining}."]}},
    )


def invalid_signature() -> Problem:
    return Problem(
        "The webhook's Provider-Signature header is missing, too old, or verified by no "
        "account's signing secret.",
        problem="invalid-signature",
        status=401,
        title="Invalid signature",
    )


def forbidden(scope: str) -> Problem:
    return Problem(
        f"This API key may not do this: it lacks the {scope!r} permission.",
        problem="forbidden",
        status=403,
        title="Forbidden",
    )


def provider_timeout() -> Problem:
    return Problem(
        "The payment provider did not answer in time; the payment may have been taken. Retry "
        "with the same idempotency key: the retry finishes this payment, it never charges twice.",
        problem="provider-timeout",
        status=504,
        title="Provider timeout",
    )


def card_declined() -> Problem:
    return Problem(
        "The payment provider declined the card; no money was taken.",
        problem="card-declined",
        status=402,
        title="Card declined",
    )


def from_http_error(error: HTTPException) -> Response:
    """Every HTTP error of the API as a problem document (404, 405, 500...), not HTML."""
    if isinstance(error, Problem):
        return error.get_response()
    if error.response is not None:
        # The error carries its answer already (Flask-Limiter's 429 from ``on_breach``).
        return t.cast(Response, error.response)
    if (error.code or 500) >= 500:
        problem: Problem = InternalError("The server failed while processing the request.")
    else:
        problem = Problem(
            error.description or error.name,
            problem=re.sub(r"[^a-z0-9]+", "-", error.name.lower()).strip("-"),
            status=error.code,
            title=error.name,
            # Keep what the error says about the resource (Allow on a 405), not its HTML type.
            headers=[(k, v) for k, v in error.get_headers() if k.lower() != "content-type"],
        )
    return problem.get_response()


def database_unavailable(error: Exception) -> Response:
    """The database went away under a view's own query (a stale pooled connection): 503."""
    return StoreUnavailableProblem(
        "The database cannot be reached; the request was not completed. Retry later."
    ).get_response()
