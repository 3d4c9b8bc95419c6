"""The HTTP adapter of an attempt: a protected request, top to bottom.

The guard (:mod:`.guard`) calls in when Flask dispatches to a protected view, after every
``before_request`` hook and every decorator above ``@idem.idempotent``. Then:

``claim``   read the key (400), resolve the tenant, fingerprint the request, claim; a record
            already holding the key answers instead of the view
            (:meth:`~flask_idem.attempt.Attempt.acquire`);
``run``     the view runs; an exception it raises marks the request *crashed*, whatever error
            handler renders it afterwards (a raised ``HTTPException`` is an answer, not a crash);
``finish``  (``after_request``) answer what the attempt decided at the end of the view
            (:meth:`~flask_idem.attempt.Attempt.end_run`): the snapshot stored, committed with
            the business transaction, or the key given up;
``teardown`` a request that never reached ``finish`` (``SystemExit`` from gunicorn's worker
            timeout or SIGQUIT/SIGINT, ``KeyboardInterrupt``, propagated exceptions) is
            abandoned (:meth:`~flask_idem.attempt.Attempt.abandon`): the key is given up.

Giving up rolls the business transaction back, then *releases* the key only when the attempt
provably committed nothing: the view answered through ``idem.refuse()``, or promised to declare
its contact with the outside world (``release_before_contact=True``), and in both cases had not
yet declared it (``idem.downstream_key()`` or ``idem.side_effect()``). Every other failure
leaves the key ``unknown``, never free.

A protected view's request that claims nothing (``IDEMPOTENCY_ENABLED`` off, a method outside
``IDEMPOTENCY_METHODS``, an optional key left out) has its business transaction settled the same
way: committed with a storable answer, rolled back otherwise. flask_idem's own answers (400,
409, 413, 422, 503) are returned by the guard, never raised through the application's error
handlers.

The decisions that do not depend on HTTP (what an existing record leads to, whether the
result is recorded or the key given up, recording it) live in :mod:`flask_idem.attempt`,
shared with background jobs (:mod:`flask_idem.jobs`), so that a view and a job follow one
outcome model: what to do next is read from the attempt's phase, and what a found record or a
failure answers from :data:`flask_idem.attempt.OUTCOMES` (its HTTP column).

The outcome table (the behaviour contract; docs/outcomes.md mirrors it):

=============================================  =========================  ======================
How the attempt ended                          The key afterwards         What a retry gets
=============================================  =========================  ======================
a response (returned, or a raised              completed (snapshot and    the stored response,
``HTTPException``), status storable            business rows commit       ``Idempotent-Replayed``
                                               together)
a never-stored status (``NEVER_STORE``),       released if releasable,    released: runs again;
an exception (even one an error handler        else ``unknown``; the      ``unknown``: see below
renders), ``SystemExit``, ``KeyboardInterrupt``  business txn rolls back
killed (kill -9, OOM)                          in progress, then stuck    409 ``request-in-
                                               when its lease runs out    progress``, then below
the store fails while storing                  released if releasable,    503; then as released
                                               else ``unknown`` (best     or ``unknown``
                                               effort)
a 4xx streamed or larger than ``MAX_BODY``,    released                   the same 4xx again
releasable (nothing committed)
any other answer streamed or larger than       ``unstored`` (sent with    409 ``response-not-
``MAX_BODY``                                   ``Idempotent-Stored``)     stored``
lost its lease to a takeover                   the taker's                409 ``request-in-
                                                                          progress``
its business transaction rolled back by the    given up as after an       as released or
view or a later hook, then a success answer    exception (500)            ``unknown``
=============================================  =========================  ======================

Every answer of a claimed request that no retry gets back (released, ``unknown``, ``unstored``,
the taker's) says so with ``Idempotent-Stored: false`` (:func:`unreplayed`), except the 503 of a
commit that may have gone through; a stored answer and its replays carry
``Idempotency-Retention``, the whole seconds the key still replays it. A new key over the
tenant's limit (:mod:`.key_limit`) is refused 429 before the claim.

An ``unknown`` record (or one in progress past its lease) is re-run by a retry only on a
``recovery="reexecute"`` view, as a fenced takeover of the same record: one winner, and the
same downstream keys, so a deduplicating provider sees one operation. On ``recovery="fail"``
views it answers 409 ``outcome-pending`` until a reconciler or an operator settles it; an
operator's release (``reopened``) lets the next retry re-run it, with the same downstream keys.

A record stays live for its TTL from its claim and for its TTL from the end of its request, so
an answer that took longer than the TTL still replays for a whole TTL.

An *atomic* view (``@idem.idempotent(atomic=True)``) claims inside its business transaction
(:meth:`~flask_idem.attempt.Attempt.acquire`): the claim, the business rows and the answer
commit once, and every failure of the table above rolls all of it back, so the key is simply
free again (there is no lease, nothing is ever ``unknown``). A duplicate that finds the scope
locked answers 409, at once or after the bounded wait of ``IDEMPOTENCY_WAIT``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
import time
import typing as t

from flask import Request, current_app, request
from flask.typing import ResponseReturnValue
from werkzeug.exceptions import HTTPException, InternalServerError
from werkzeug.wrappers import Response

from ..attempt import OUTCOMES, Attempt, Ending, Failure, Phase
from ..core import signals
from ..core.config import Settings
from ..core.errors import StoreUnavailable
from ..core.fingerprint import fingerprint as canonical_fingerprint
from ..core.idempotency_keys import InvalidKey, check_key, echo_of_invalid, key_hash, read_key
from ..core.options import ViewOptions
from ..core.problem import (
    InternalError,
    KeyInvalid,
    KeyMissing,
    PrincipalUnresolved,
    Problem,
    StoreUnavailableProblem,
    TenantUnresolved,
)
from ..core.record import Scope, StoredResponse
from ..core.scopes import PrincipalInvalid, account_fingerprint, namespace, resolve_principal
from ..core.snapshot import response_snapshot
from ..core.wire import REPLAYED_HEADER, RETENTION_HEADER, STORED_HEADER
from ..sessions import has_unmanaged_writes
from ..state import AppState
from ..store import redacted
from .body import read_body
from .key_limit import KeyLimit

log = logging.getLogger("flask_idem")


# -- claim, or answer from the existing record ----------------------------------------------


def unclaimed(app_state: AppState, options: ViewOptions) -> None:
    """Give a protected view's unclaimed request (``IDEMPOTENCY_ENABLED`` off, an unsafe
    method outside ``IDEMPOTENCY_METHODS``, an optional key left out) the business
    transaction of a claimed one: the view is written for flask_idem to commit it, so
    ``finish`` commits it with a storable answer and rolls it back otherwise, as it would a
    claimed request's. A transaction a hook opened earlier (``idem.connection()``) is kept."""
    attempt = _start(Attempt(app_state, None, options))
    if app_state.sessions is not None:
        attempt.attach_session()


def claim(
    app_state: AppState, options: ViewOptions, *, around_view: bool = False
) -> Response | None:
    """Take the key for this request, or answer from the record that holds it.

    :param around_view: the outer guard claims, around the whole view function
        (:attr:`.Attempt.claimed_around_view`).

    :returns: None when the view may run (the key is ours, or the request carries no key and
        does not need one); otherwise the replayed response. Problems are raised.
    """
    settings = app_state.settings
    # The request itself, not the proxy: this path reads a dozen of its attributes.
    req: Request = request._get_current_object()  # type: ignore[attr-defined]
    # The whole body, as declared, within IDEMPOTENCY_MAX_REQUEST_BODY: a truncated upload is
    # a 400 and an oversized one a 413, before any claim (never a fingerprint of half a body).
    # Before a key= function, which parses it: never a body of any size.
    body = read_body(req, settings.max_request_body) if options.key is not None else None
    try:
        key = _read_key(req, settings, options)
    except InvalidKey as exc:
        echo = echo_of_invalid(req.headers, settings.headers)
        _start(Attempt(app_state, None, options, echo=echo))
        raise KeyInvalid(str(exc)) from None
    if key is None:
        required = settings.key_required if options.required is None else options.required
        if required:
            raise KeyMissing(f"This endpoint requires an {settings.header} header.")
        return None
    assert req.url_rule is not None
    endpoint = f"{req.method} {req.url_rule.rule}"
    scope_name = options.scope or settings.scope
    tenant = _tenant(app_state)
    try:
        principal = resolve_principal(options.principal or settings.principal)
        name = namespace(endpoint, scope_name, principal)
    except PrincipalInvalid as exc:
        raise _principal_unresolved(exc) from None
    scope = app_state.store.keys.scope(tenant, name, key)
    attempt = _start(
        Attempt(app_state, scope, options, endpoint=endpoint, claimed_around_view=around_view)
    )
    attempt.start_trace()
    if body is None:
        body = read_body(req, settings.max_request_body)
    digest = _fingerprint(req, options, body)
    if scope_name == "account":
        digest = account_fingerprint(endpoint, digest)
    limit = app_state.key_limiter.applying(settings, options, scope)
    try:
        with attempt.reporting_claim_failure():
            if limit is not None:
                _refuse_over_limit(attempt, limit)
            acquired = attempt.acquire(digest, until=time.monotonic() + settings.wait)
            if acquired.replay is not None:
                stored = acquired.replay
                assert stored.response is not None
                return replay(stored.response, options, settings.stored_headers, stored.kept_for)
    except StoreUnavailable as exc:
        raise _claim_failed(exc) from None
    if acquired.refusal is not None:
        raise acquired.refusal.http()
    if acquired.new and limit is not None:
        limit.count()  # a new record: the only claim the limit counts
    return None  # the key is ours


def _refuse_over_limit(attempt: Attempt, limit: KeyLimit) -> None:
    """Refuse a new key over the tenant's limit (429) before any claim; a key the store
    already holds goes on to the claim, which answers from its record (a replay, 409 or 422
    is never refused by the limit). See :mod:`.key_limit` for the order."""
    if limit.allows():
        return
    if not attempt.holds_record():
        refusal = limit.refusal()
        attempt.emit(signals.rate_limited)
        raise refusal


def _claim_failed(error: StoreUnavailable) -> StoreUnavailableProblem:
    """The 503 of a claim the store failed: fail closed, saying how to migrate when the schema
    is missing (:class:`~flask_idem.core.errors.SchemaMissing`)."""
    return StoreUnavailableProblem(
        error.detail or "The idempotency store cannot be reached; the request was not executed."
    )


def replay(
    stored: StoredResponse,
    options: ViewOptions,
    headers: frozenset[str],
    kept_for: float,
) -> Response:
    """The answer to a retry: the stored response byte for byte, or the view's ``replay=``.

    ``kept_for`` (the record's :attr:`~flask_idem.core.record.Record.kept_for`) is sent as
    ``Idempotency-Retention``: how much longer the key replays this answer.

    Only the stored headers named in ``headers`` (``IDEMPOTENCY_STORED_HEADERS``) are sent:
    a completion stores no other, so another one in the row was written by something else
    (a tampered row could carry ``Set-Cookie`` or ``Connection: upgrade``), or under an older
    setting. A 204 or 304 goes out without a body, as the first answer did (werkzeug sends
    none with these statuses), whatever body was stored with it.
    """
    kept = tuple((name, value) for name, value in stored.headers if name.lower() in headers)
    stored = dataclasses.replace(stored, headers=kept)
    if options.replay is not None:
        response = current_app.make_response(options.replay(stored))
    else:
        response = current_app.response_class(stored.body, status=stored.status)
        del response.headers["Content-Type"]
        for name, value in stored.headers:
            response.headers.add(name, value)
    response.headers[REPLAYED_HEADER] = "true"
    response.headers[RETENTION_HEADER] = _seconds(kept_for)
    return response


def _start(attempt: Attempt) -> Attempt:
    """Attach the request's attempt, keeping a business transaction opened before the claim."""
    earlier = Attempt.current()
    if earlier is not None:
        attempt.connection, attempt.session = earlier.connection, earlier.session
    attempt.attach()
    return attempt


def _read_key(req: Request, settings: Settings, options: ViewOptions) -> str | None:
    """The request's key: from the headers, or from the view's ``key=`` function when the
    request carries its own (a webhook's event id; a header is then ignored).

    :raises KeyMissing: the function found no key (it returned None or raised; a
        :class:`Problem` it raises is answered as it is).
    :raises InvalidKey: the key is not 1 to 255 characters of the key alphabet.
    """
    if options.key is None:
        return read_key(req.headers, settings.headers)
    try:
        value = options.key(req)
    except Problem:
        raise  # the function's own answer
    except Exception:
        # A body without the field, no JSON at all (werkzeug's 400 or 415 included): no key.
        value = None
    if value is None or isinstance(value, bool):
        raise KeyMissing(
            "This endpoint takes its idempotency key from the request, and this request "
            "carries none."
        )
    return check_key(str(value))


def _tenant(app_state: AppState) -> str:
    try:
        tenant = app_state.extension.current_tenant()
    except HTTPException:
        raise  # the callable's own answer (abort(401) for a request without credentials)
    except Exception as exc:
        # ``tenant=lambda: g.tenant`` on a request no authentication hook ran for: a refusal
        # that says what is wrong, never a bare 500. (A tenant looked up by API key in the
        # database: the failed statement's parameters are the credential.)
        log.error(
            "the tenant callable raised; the request is refused (tenant-unresolved)",
            exc_info=redacted(exc),
        )
        tenant = None
    if tenant is None:
        log.error(
            "protected request without a tenant: Idempotency(tenant=...) found none; did the "
            "authentication that sets it run before the claim (a before_request hook, or a "
            "decorator above @idem.idempotent)?"
        )
        raise TenantUnresolved(
            "The server could not tell whose request this is, so it refuses to run it."
        )
    return tenant


def _principal_unresolved(error: PrincipalInvalid) -> PrincipalUnresolved:
    """The refusal of a request whose principal callable raised or returned nothing usable
    (never a 500 page). What it raised may carry the credential it looked up by: redacted."""
    if error.__cause__ is not None:
        log.error(
            "the principal callable raised; the request is refused (principal-unresolved)",
            exc_info=redacted(error.__cause__),
        )
    log.error(
        "protected request without a usable principal (%s): does IDEMPOTENCY_PRINCIPAL (or "
        "principal=) return a user or API key id, and did the authentication that sets it "
        "run before the claim?",
        error,
    )
    return PrincipalUnresolved(
        "The server could not tell who within the account sent this request, so it refuses "
        "to run it."
    )


def _fingerprint(req: Request, options: ViewOptions, body: bytes) -> bytes:
    if options.fingerprint is not None:
        value = options.fingerprint(req)
        data = value.encode() if isinstance(value, str) else bytes(value)
        return hashlib.sha256(b"custom\x00" + data).digest()
    assert req.url_rule is not None
    return canonical_fingerprint(
        req.method,
        req.url_rule.rule,
        req.view_args or {},
        req.args.items(multi=True) if req.query_string else (),
        body,
        req.content_type,
        exclude=options.exclude,
        include=options.include,
    )


# -- run: the view, with its exceptions seen ------------------------------------------------


def run(call: t.Callable[..., t.Any], args: t.Any, kwargs: t.Any) -> ResponseReturnValue:
    """The view, and how it ended told to its attempt (:meth:`~flask_idem.attempt.Attempt.
    run_ended`)."""
    try:
        answer = t.cast(ResponseReturnValue, call(*args, **kwargs))
        attempt = Attempt.current()  # also one the view opened (idem.connection())
        if attempt is not None:
            attempt.flush()  # db.session's ORM writes: a failure here is the view's
    except Refusal as exc:
        _told(exc, refused=True)
        raise
    except HTTPException as exc:
        _told(exc, answered=True, status=exc.code)
        raise  # abort(404), raise Problem(...): an answer like a returned one
    except StoreUnavailable as exc:
        # idem.connection() failed in the view: a crash answered 503 here, not by whatever
        # error handler the application (or a blueprint) registered for Exception.
        _told(exc)
        return store_unavailable(exc)
    except BaseException as exc:
        # A crash, also when an application error handler turns it into a response.
        _told(exc)
        raise
    if attempt is not None:
        attempt.run_ended()
    return answer


def _told(error: BaseException, **how: t.Any) -> None:
    attempt = Attempt.current()
    if attempt is not None:
        attempt.run_ended(error, **how)


class Refusal(HTTPException):
    """What ``idem.refuse()`` raises in a request: its answer, sent as it is. Only a refusal
    that ends the view gives the key back; one the view caught and went on from does not."""

    def __init__(self, response: Response) -> None:
        super().__init__(response=response)


# -- finish: store the answer, or give the key up -------------------------------------------


def finish(attempt: Attempt, response: Response) -> Response:
    """``after_request`` (through :func:`.guard.finish`): what the attempt decided at the end
    of the view (:meth:`~flask_idem.attempt.Attempt.end_run`, :meth:`~flask_idem.attempt.
    Attempt.record_result`), answered over HTTP."""
    app_state = attempt.app_state
    echo_key(app_state.settings, response, attempt.echoed_key)
    if attempt.phase is Phase.FINISHED:
        return response
    if not attempt.holding:
        return _settle_unclaimed(attempt, response)
    ending = attempt.end_run("view", status=response.status_code)
    if ending is Ending.WORK_LOST:
        # The view's answer does not stand for what committed: a 500 says what happened.
        problem = InternalError(OUTCOMES[Failure.WORK_LOST].detail + attempt.crash_advice)
        return unreplayed(problem_response(app_state, attempt, problem))
    if ending is Ending.GIVEN_UP:
        return unreplayed(response)
    if app_state.unmanaged_db is not None and has_unmanaged_writes(app_state.unmanaged_db):
        log.warning(
            "a protected view left writes in db.session that flask_idem does not commit: its "
            "store runs on another database. Pass db= to Idempotency (one transaction with the "
            "stored answer), or commit them in the view",
            extra={"key_hash": key_hash(t.cast(Scope, attempt.scope))},
        )
    return _record(attempt, response)


def _record(attempt: Attempt, response: Response) -> Response:
    assert attempt.scope is not None
    snapshot = response_snapshot(attempt.app_state.settings, response)
    recording = attempt.record_result(snapshot, ran="view", status=response.status_code)
    if recording.failure is not None:
        outcome = OUTCOMES[recording.failure]
        answer = problem_response(attempt.app_state, attempt, outcome.http())
        return answer if outcome.may_be_recorded else unreplayed(answer)
    if not recording.recorded:
        # The client still learns what happened: a 4xx too large to store was given back
        # (a retry gets it again); effects outside a business transaction keep the key.
        return unreplayed(response)
    if snapshot is None:
        log.warning(
            "response not stored (streamed or larger than IDEMPOTENCY_MAX_BODY); "
            "retries get 409 response-not-stored",
            extra={"key_hash": key_hash(attempt.scope)},
        )
        return unreplayed(response)
    # Set after the snapshot, so never stored: a replay says how long is left then.
    response.headers[RETENTION_HEADER] = _seconds(attempt.ttl)
    return response


# -- teardown: a request that never answered -------------------------------------------------


def teardown(exc: BaseException | None) -> None:
    """``teardown_request``: a claim the request never finished (``SystemExit`` from gunicorn's
    worker timeout or SIGQUIT, ``KeyboardInterrupt``, a propagated exception) is the attempt's
    to give up (:meth:`~flask_idem.attempt.Attempt.abandon`)."""
    attempt = Attempt.current()
    if attempt is None:
        return
    try:
        attempt.abandon()
    finally:
        attempt.close()
        Attempt.detach()


# -- answers rendered by the extension's error handlers -------------------------------------


def internal_error(error: InternalServerError) -> ResponseReturnValue:
    """Unhandled exceptions in protected views answer a problem document, not HTML.

    A view's own ``abort(500)`` (no original exception: Flask wraps every unhandled one) is
    the view's answer, stored and replayed like any: it says what the view said, never a
    crash's advice to retry, which its replay would repeat for the key's whole TTL."""
    attempt = Attempt.current()
    if attempt is None or attempt.scope is None:
        return error
    if error.original_exception is None:
        return InternalError(error.description).get_response()
    return InternalError(
        "The server failed while processing the request. " + attempt.crash_advice
    ).get_response()


def store_unavailable(error: StoreUnavailable) -> ResponseReturnValue:
    log.error("idempotency store unavailable during the request: %s", error)
    return StoreUnavailableProblem(
        error.detail
        or "The database cannot be reached; the request was not completed. Retry later."
    ).get_response()


# -- helpers ----------------------------------------------------------------------------------


def unreplayed(response: Response) -> Response:
    """Tell the caller of a request that held the key that no retry will get this answer
    back (``Idempotent-Stored: false``): retries run the request again (the key was given
    back), or are answered 409 (``response-not-stored``, ``outcome-pending``)."""
    response.headers[STORED_HEADER] = "false"
    return response


def _seconds(seconds: float) -> str:
    """Whole seconds, rounded down: a promise the key keeps."""
    return str(max(0, math.floor(seconds)))


def echo_key(settings: Settings, response: Response, key: str | None) -> Response:
    """Echo the request's idempotency key on ``response`` (every answer of a protected request
    that sent one says which key it answers)."""
    if key is not None:
        response.headers[settings.header] = key
    return response


def problem_response(app_state: AppState, attempt: Attempt | None, problem: Problem) -> Response:
    """``problem`` as the request's answer, echoing the attempt's key."""
    key = None if attempt is None else attempt.echoed_key
    return echo_key(app_state.settings, problem.get_response(), key)


def _settle_unclaimed(attempt: Attempt, response: Response) -> Response:
    """Settle the business transaction of a request that claimed nothing
    (:meth:`~flask_idem.attempt.Attempt.settle_unclaimed`). If the commit fails (the view's
    own query met a dead connection and an error handler rendered it, leaving the transaction
    invalid), nothing was committed: answer 503, as a store failure anywhere in a request."""
    try:
        attempt.settle_unclaimed(response.status_code)
    except StoreUnavailable as exc:
        answer = t.cast(Response, store_unavailable(exc))
        return echo_key(attempt.app_state.settings, answer, attempt.echoed_key)
    return response
