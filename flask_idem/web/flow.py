"""The request state machine of a protected endpoint, top to bottom.

A protected view is *guarded*: the claim runs when Flask dispatches to the view, so after every
``before_request`` hook (authentication, rate limits) and after every decorator above
``@idem.idempotent`` (authorization): nothing is replayed, and no 409 or 422 is answered, to a
caller the view would refuse. Then:

``enter``   read the key (400), resolve the tenant, fingerprint the request, claim; a record
            already holding the key answers instead of the view (``answer_existing``);
``run``     the view runs; an exception it raises marks the request *crashed*, whatever error
            handler renders it afterwards (a raised ``HTTPException`` is an answer, not a crash);
``finish``  (``after_request``) store the snapshot, committed with the business transaction,
            or give the key up;
``teardown`` a request that never reached ``finish`` (``SystemExit`` from gunicorn's worker
            timeout or SIGQUIT/SIGINT, ``KeyboardInterrupt``, propagated exceptions) gives up.

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

The decisions that do not depend on HTTP (what an existing record leads to, giving up,
recording the result) live in :mod:`flask_idem.attempt`, shared with background jobs
(:mod:`flask_idem.jobs`), so that a view and a job follow one outcome model.

The outcome table (the behaviour contract; README mirrors it):

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
=============================================  =========================  ======================

An ``unknown`` record (or one in progress past its lease) is re-run by a retry only on a
``recovery="reexecute"`` view, as a fenced takeover of the same record: one winner, and the
same downstream keys, so a deduplicating provider sees one operation. On ``recovery="fail"``
views it answers 409 ``outcome-pending`` until a reconciler or an operator settles it; an
operator's release (``reopened``) lets the next retry re-run it, with the same downstream keys.

A record stays live for its TTL from its claim and for its TTL from the end of its request, so
an answer that took longer than the TTL still replays for a whole TTL.

An *atomic* view (``@idem.idempotent(atomic=True)``) claims inside its business transaction
(``_claim_atomic``): the claim, the business rows and the answer commit once, and every failure
of the table above rolls all of it back, so the key is simply free again (there is no lease,
nothing is ever ``unknown``). A duplicate that finds the scope locked answers 409 at once.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import inspect
import itertools
import logging
import time
import types
import typing as t

from flask import Request, current_app, request
from flask.typing import ResponseReturnValue
from werkzeug.exceptions import HTTPException, InternalServerError
from werkzeug.wrappers import Response

from ..attempt import (
    CommitUncertain,
    Found,
    classify,
    emit,
    give_up,
    note_ended_below,
    note_replaced_session,
    own,
    rollback,
    stop_watching,
    store_result,
    take_over,
)
from ..commits import count_commits_from_now
from ..core import signals
from ..core.body import read_body
from ..core.config import Settings
from ..core.errors import GuardNotFound, StoreUnavailable
from ..core.fingerprint import fingerprint as canonical_fingerprint
from ..core.idempotency_keys import InvalidKey, check_key, echo_of_invalid, key_hash, read_key
from ..core.options import ViewOptions
from ..core.problem import (
    InternalError,
    KeyInvalid,
    KeyMissing,
    KeyReused,
    OutcomePending,
    Problem,
    RequestInProgress,
    ResponseNotStored,
    StoreUnavailableProblem,
    TenantUnresolved,
    unreadable_problem,
)
from ..core.record import STORABLE_STATUSES, ClaimResult, Record, Scope, StoredResponse
from ..core.snapshot import response_snapshot
from ..sessions import has_unmanaged_writes
from ..state import AppState, RequestState
from ..store.engines import OneDeadline
from ..store.messages import redacted
from ..store.sql import translate_errors

P = t.ParamSpec("P")
R = t.TypeVar("R")

_WAIT_STEP = 0.05
#: 409 ``request-in-progress`` hints this many seconds: the lease says when an owner counts
#: as gone, not when it finishes, and most requests finish within a second.
IN_FLIGHT_RETRY_AFTER = 1
#: A guard's reference to itself, also found on wrappers that copied its ``__dict__``.
GUARD_ATTRIBUTE = "__idempotency_guard__"
#: How deep to look through decorators and view classes for a guard (see ``find_guard``).
_SEARCH_LIMIT = 64

log = logging.getLogger("flask_idem")


def guard(view: t.Callable[P, R], options: ViewOptions | None = None) -> t.Callable[P, R]:
    """Wrap a view so that protected requests claim when it is called.

    With ``options`` (``@idem.idempotent``) the guard claims with them. Without, it is the
    outer guard ``init_app`` puts around a protected endpoint's whole view function: it claims
    with the blueprint's or the app's options, or, when the view holds a guard of its own
    deeper down, leaves the claim to that one (after the decorators above it) and only watches
    for exceptions raised around it.
    """

    # Flask's own ensure_sync returns a plain function as it is: asked once, not per request.
    asynchronous = inspect.iscoroutinefunction(view)

    @functools.wraps(view)
    def guarded(*args: P.args, **kwargs: P.kwargs) -> R:
        return t.cast(R, enter(view, args, kwargs, options, asynchronous=asynchronous))

    setattr(guarded, GUARD_ATTRIBUTE, guarded)
    return guarded


def find_guard(view: t.Any, method: str) -> t.Any:
    """The ``@idem.idempotent`` guard inside a view function, or None.

    Looks through decorators (``__wrapped__``, closures, default arguments), what a
    decorator's wrapper holds when it is no function (a ``functools.partial``'s function and
    arguments, a bound method's function and object, a callable object's attributes, in
    ``__dict__`` or ``__slots__``), the lists, tuples, sets and dicts any of these hold, and
    class-based views (``MethodView``: the method's function). The search is bounded and
    cannot see everything (a module-level registry, say): a guard it misses refuses to run
    under the outer guard's claim (:class:`~flask_idem.core.errors.GuardNotFound`), because the
    decorators above it would come too late to refuse a replay.
    """
    pending: list[t.Any] = [view]
    seen: set[int] = set()
    while pending and len(seen) < _SEARCH_LIMIT:
        held = pending.pop()
        if id(held) in seen:
            continue
        if isinstance(held, list | tuple | set | frozenset | dict):
            seen.add(id(held))
            items = held.values() if isinstance(held, dict) else held
            pending.extend(itertools.islice(items, _SEARCH_LIMIT))  # a large one costs no more
            continue
        if not callable(held):
            continue
        seen.add(id(held))
        found = getattr(held, GUARD_ATTRIBUTE, None)
        if found is not None:
            return found
        view_class = getattr(held, "view_class", None)
        if view_class is not None:
            pending.append(getattr(view_class, method.lower(), None))
        pending.append(getattr(held, "__wrapped__", None))
        pending.extend(_held_callables(held))
    return None


def _held_callables(wrapper: t.Any) -> list[t.Any]:
    """What a wrapper may call: a function's closure cells and default arguments, a partial's
    function and arguments, a bound method's function and object, an object's attributes
    (never a class's: those are every method of the class, not the one this request calls)."""
    if isinstance(wrapper, functools.partial):
        return [wrapper.func, *wrapper.args, *wrapper.keywords.values()]
    if inspect.ismethod(wrapper):
        return [wrapper.__func__, *_attributes(wrapper.__self__)]
    if inspect.isfunction(wrapper):
        return [
            *_cells(wrapper),
            *(wrapper.__defaults__ or ()),
            *(wrapper.__kwdefaults__ or {}).values(),
        ]
    if isinstance(wrapper, type):
        return []
    return _attributes(wrapper)


def _cells(function: types.FunctionType) -> list[t.Any]:
    contents = []
    for cell in function.__closure__ or ():
        try:
            contents.append(cell.cell_contents)
        except ValueError:  # an empty cell
            continue
    return contents


def _attributes(holder: t.Any) -> list[t.Any]:
    """An object's attribute values, in its ``__dict__`` and in the ``__slots__`` of its
    class and the classes it inherits from."""
    attributes = getattr(holder, "__dict__", None)
    values = list(attributes.values()) if isinstance(attributes, dict) else []
    for cls in type(holder).__mro__:
        slots = cls.__dict__.get("__slots__", ())
        for name in (slots,) if isinstance(slots, str) else slots:
            try:
                values.append(getattr(holder, name))
            except AttributeError:  # declared, never set
                continue
    return values


def _guard_not_found(app_state: AppState) -> GuardNotFound:
    """The refusal of a view guard entered under the outer guard's claim, logged once per
    endpoint (it is a mistake in the application's code, the same on every request)."""
    endpoint = request.endpoint or request.path
    if endpoint not in app_state.guards_not_found:
        app_state.guards_not_found.add(endpoint)
        log.error(
            "endpoint %r: its @idem.idempotent guard sits under a decorator flask_idem could "
            "not see through, so protect_blueprint/IDEMPOTENCY_PROTECT_ALL claimed before that "
            "decorator ran; every request to it is refused with 500. Write decorators above "
            "@idem.idempotent with functools.wraps, or put authorization in a before_request "
            "hook",
            endpoint,
        )
    return GuardNotFound(
        f"the @idem.idempotent guard of endpoint {endpoint!r} was not found under the "
        "decorators above it; the outer guard claimed first"
    )


# -- enter: claim, or answer from the existing record ---------------------------------------


def enter(
    view: t.Callable[..., t.Any],
    args: t.Any,
    kwargs: t.Any,
    declared: ViewOptions | None,
    *,
    asynchronous: bool,
) -> ResponseReturnValue:
    app_state = AppState.current()
    plain = not asynchronous and app_state.plain_ensure_sync
    call = view if plain else current_app.ensure_sync(view)
    state = RequestState.current()
    if state is not None and state.scope is not None:
        if declared is not None and state.claimed_around_view:
            # The outer guard claimed before the decorators above this guard: they would run
            # after a replay was decided. Fail like a view exception, never run the view.
            raise _guard_not_found(app_state)
        return run(call, args, kwargs)  # claimed already, by an outer guard
    if declared is None and find_guard(view, request.method) is not None:
        return run(call, args, kwargs)  # the view's own guard claims, after its decorators
    settings = app_state.settings
    options = app_state.extension.protection(settings, declared)
    claims = settings.enabled and request.method in settings.methods
    if options is None or (not claims and request.method in SAFE_METHODS):
        return t.cast(ResponseReturnValue, call(*args, **kwargs))
    if claims:
        try:
            answer = claim(app_state, options)
        except Problem as problem:
            # Returned, not raised: an application's errorhandler(Exception) or
            # errorhandler(HTTPException) must not turn a 409 or a 422 into its own 500.
            return _problem_response(app_state, RequestState.current(), problem)
        if answer is not None:
            return answer
    state = RequestState.current()
    if state is not None and declared is None:
        state.claimed_around_view = True
    if state is None or state.token is None:
        unclaimed(app_state, options)
    return run(call, args, kwargs)


#: Methods that must have no effect (RFC 9110): an unclaimed one is left as Flask leaves it.
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS", "TRACE"})


def unclaimed(app_state: AppState, options: ViewOptions) -> None:
    """Give a protected view's unclaimed request (``IDEMPOTENCY_ENABLED`` off, an unsafe
    method outside ``IDEMPOTENCY_METHODS``, an optional key left out) the business
    transaction of a claimed one: the view is written for flask_idem to commit it, so
    ``finish`` commits it with a storable answer and rolls it back otherwise, as it would a
    claimed request's. A transaction a hook opened earlier (``idem.connection()``) is kept."""
    state = _start(RequestState(None, options))
    if app_state.sessions is not None:
        app_state.attach_session(state)


def claim(app_state: AppState, options: ViewOptions) -> Response | None:
    """Take the key for this request, or answer from the record that holds it.

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
        _start(RequestState(None, options, echo=echo))
        raise KeyInvalid(str(exc)) from None
    if key is None:
        required = settings.key_required if options.required is None else options.required
        if required:
            raise KeyMissing(f"This endpoint requires an {settings.header} header.")
        return None
    assert req.url_rule is not None
    scope = Scope(_tenant(app_state), f"{req.method} {req.url_rule.rule}", key)
    state = _start(RequestState(scope, options))
    app_state.start_trace(state)
    if body is None:
        body = read_body(req, settings.max_request_body)
    digest = _fingerprint(req, options, body)
    state.fingerprint = digest
    ttl = options.ttl or settings.ttl
    deadline = time.monotonic() + settings.wait
    if options.atomic:
        return _claim_atomic(app_state, state, options, digest, ttl, deadline)
    while True:
        try:
            result: ClaimResult | Response | None = app_state.store.claim(
                scope, digest, ttl=ttl, lease=settings.lease
            )
            assert isinstance(result, ClaimResult)
            if not result.claimed:
                result = answer_existing(app_state, result.record, digest, options, deadline)
        except StoreUnavailable as exc:
            raise _claim_failed(scope, exc) from None
        if isinstance(result, Response):
            return result
        if result is not None:
            own(app_state, state, result, settings.lease)
            return None


def _claim_atomic(
    app_state: AppState,
    state: RequestState,
    options: ViewOptions,
    digest: bytes,
    ttl: float,
    deadline: float,
) -> Response | None:
    """The claim of an atomic view, inside the business transaction it opens.

    A duplicate holding the scope (PostgreSQL's try-lock) answers 409 at once, or after a
    bounded wait (``IDEMPOTENCY_WAIT``); an existing record answers as for any view, after
    the empty transaction is rolled back.
    """
    assert state.scope is not None
    store = app_state.store
    while True:
        try:
            with OneDeadline():  # the checkout and the claim: one wait for the server
                connection = app_state.begin(state)
                result = store.claim_atomic(connection, state.scope, digest, ttl=ttl)
            if result is not None and result.claimed:
                state.token, state.record = result.token, result.record
                state.reservation = result.reservation
                count_commits_from_now(state)  # a connection opened before the claim
                emit(signals.claimed, state.scope)
                return None
            rollback(state)
            if result is not None:
                answer = answer_existing(app_state, result.record, digest, options, deadline)
                if isinstance(answer, Response):
                    return answer
                if answer is not None:  # a reopened record: run it again, durably owned
                    own(app_state, state, answer, app_state.settings.lease)
                    return None
        except StoreUnavailable as exc:
            raise _claim_failed(state.scope, exc) from None
        if time.monotonic() >= deadline:
            emit(signals.conflict, state.scope)
            raise RequestInProgress(
                "A request with this idempotency key is still being processed; retry later.",
                retry_after=IN_FLIGHT_RETRY_AFTER,
            )
        time.sleep(min(_WAIT_STEP, max(0.0, deadline - time.monotonic())))


def _claim_failed(scope: Scope, error: StoreUnavailable) -> StoreUnavailableProblem:
    """The 503 of a claim the store failed: fail closed, saying how to migrate when the schema
    is missing (:class:`~flask_idem.core.errors.SchemaMissing`)."""
    emit(signals.store_unavailable, scope, stage="claim")
    return StoreUnavailableProblem(
        error.detail or "The idempotency store cannot be reached; the request was not executed."
    )


def answer_existing(
    app_state: AppState, record: Record, digest: bytes, options: ViewOptions, deadline: float
) -> ClaimResult | Response | None:
    """What a claim that found a record leads to: a problem (raised), a replay, a takeover to
    run the view with, or None to claim again after a short wait."""
    if record.damaged is not None:
        raise unreadable_problem(record)  # neither replayed, compared nor taken over
    found = classify(record, digest, options.recovery)
    if found is Found.MISMATCH:
        emit(signals.mismatch, record.scope, state=record.state.value)
        raise KeyReused(
            "This idempotency key was already used with a different request; "
            "use a new key for a new operation."
        )
    if found is Found.COMPLETED:
        if record.unreadable is not None:
            raise unreadable_problem(record)  # never a replay of garbage, never a re-run
        assert record.response is not None
        emit(signals.replayed, record.scope, status=record.response.status)
        return replay(record.response, options, app_state.settings.stored_headers)
    if found is Found.UNSTORED:
        emit(signals.not_stored, record.scope)
        raise ResponseNotStored(
            "The original request ran and completed, but its response was streamed or larger "
            "than this endpoint stores (IDEMPOTENCY_MAX_BODY), so it cannot be replayed; it "
            "was not executed again. Look its result up instead of retrying: a new key would "
            "run the operation a second time."
        )
    if found is Found.RUNNING:
        if time.monotonic() < deadline:
            time.sleep(min(_WAIT_STEP, max(0.0, deadline - time.monotonic())))
            return None
        emit(signals.conflict, record.scope)
        raise RequestInProgress(
            "A request with this idempotency key is still being processed; retry later.",
            retry_after=IN_FLIGHT_RETRY_AFTER,
        )
    if found is Found.PENDING:
        emit(signals.pending, record.scope, state=record.state.value)
        raise OutcomePending(
            "The original request may have taken effect but its outcome is not known; it "
            "will not be executed again automatically and is being reconciled."
        )
    # One winner: a loser claims again and finds the winner's record in progress.
    return take_over(app_state, record, app_state.settings.lease)


def replay(stored: StoredResponse, options: ViewOptions, headers: frozenset[str]) -> Response:
    """The answer to a retry: the stored response byte for byte, or the view's ``replay=``.

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
    response.headers["Idempotent-Replayed"] = "true"
    return response


def _start(state: RequestState) -> RequestState:
    """Attach the request's state, keeping a business transaction opened before the claim."""
    earlier = RequestState.current()
    if earlier is not None:
        state.connection, state.session = earlier.connection, earlier.session
    state.attach()
    return state


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
    try:
        answer = t.cast(ResponseReturnValue, call(*args, **kwargs))
        state = RequestState.current()
        if state is not None:
            state.flush()  # db.session's ORM writes: a failure here is the view's
            state.answered = True
        return answer
    except Refusal:
        _answered(crashed=False, refused=True)
        raise
    except HTTPException:
        _answered(crashed=False)
        raise  # abort(404), raise Problem(...): an answer like a returned one
    except StoreUnavailable as exc:
        # idem.connection() failed in the view: a crash answered 503 here, not by whatever
        # error handler the application (or a blueprint) registered for Exception.
        _answered(crashed=True, error=exc)
        return store_unavailable(exc)
    except BaseException as exc:
        # A crash, also when an application error handler turns it into a response.
        _answered(crashed=True, error=exc)
        raise


def _answered(*, crashed: bool, refused: bool = False, error: BaseException | None = None) -> None:
    state = RequestState.current()
    if state is not None:
        state.answered = True
        state.crashed = state.crashed or crashed
        state.refused = refused
        if error is not None:
            state.failed(error)


class Refusal(HTTPException):
    """What ``idem.refuse()`` raises in a request: its answer, sent as it is. Only a refusal
    that ends the view gives the key back; one the view caught and went on from does not."""

    def __init__(self, response: Response) -> None:
        super().__init__(response=response)


# -- finish: store the answer, or give the key up -------------------------------------------


def finish(response: Response) -> Response:
    """``after_request``: complete the record with the response, or give up."""
    state = RequestState.current()
    app_state = AppState.current()
    if state is None:
        _echo_unclaimed(app_state, response)
        return response
    echo = state.scope.key if state.scope is not None else state.echo
    if echo is not None:
        response.headers[app_state.settings.header] = echo
    if state.finished:
        return response
    if state.token is None:
        return _settle_unclaimed(app_state, state, response)
    state.completing()
    stop_watching(app_state, state)
    note_replaced_session(app_state, state)
    if state.work_lost:
        # The view ended its own business transaction before answering: its rows are gone,
        # so its answer (a 201, say) would be a lie, stored or not.
        return _unrecorded(app_state, state, "the view ended its business transaction itself")
    if state.crashed:
        give_up(app_state, state, "the view raised an exception")
        return response
    if state.refused:
        give_up(app_state, state, "the view refused the request")
        return response
    if (
        response.status_code in app_state.settings.never_store
        or response.status_code not in STORABLE_STATUSES
    ):
        give_up(app_state, state, f"status {response.status_code} is never stored")
        return response
    if app_state.unmanaged_db is not None and has_unmanaged_writes(app_state.unmanaged_db):
        log.warning(
            "a protected view left writes in db.session that flask_idem does not commit: its "
            "store runs on another database. Pass db= to Idempotency (one transaction with the "
            "stored answer), or commit them in the view",
            extra={"key_hash": key_hash(t.cast(Scope, state.scope))},
        )
    if state.atomic and state.session is not None and not state.session.in_transaction():
        # An error handler rolled db.session back after the view raised an HTTPException:
        # the atomic claim went with it, and nothing of the attempt is left. Its answer goes
        # out unstored; the key is free, so a retry runs the view again.
        give_up(app_state, state, "the business transaction was rolled back before the answer")
        return response
    if note_ended_below(state):
        # The driver committed or rolled back under the view: its rows did not commit with
        # this answer, so it must never be stored (nor the key given back).
        return _unrecorded(
            app_state, state, "the view ended its business transaction below SQLAlchemy"
        )
    return _complete(app_state, state, response)


def _unrecorded(app_state: AppState, state: RequestState, reason: str) -> Response:
    """Give the key up and answer 500: the view's answer does not stand for what committed."""
    give_up(app_state, state, reason)
    problem = InternalError(
        "The request's database transaction ended before the server answered, so its "
        "work was not recorded. " + _crash_outcome(state)
    )
    return _problem_response(app_state, state, problem)


def _complete(app_state: AppState, state: RequestState, response: Response) -> Response:
    assert state.scope is not None and state.token is not None
    snapshot = response_snapshot(app_state.settings, response)
    if snapshot is None and 400 <= response.status_code < 500 and state.releasable:
        # A client error too large to keep, from an attempt that provably committed nothing
        # (a validation answer before any contact): kept as unstored, it would answer 409 to
        # every retry of a request that only needs fixing. Given back, a retry gets it again.
        give_up(app_state, state, "its 4xx answer is too large to store")
        return response
    try:
        stored = store_result(app_state, state, snapshot)
    except StoreUnavailable as exc:
        return _store_failed(
            app_state, state, response, committing=isinstance(exc, CommitUncertain)
        )
    if not stored:
        # The lease expired and a retry took the record over: this request's writes in the
        # business transaction are rolled back and the operation belongs to the new owner.
        emit(signals.lease_lost, state.scope)
        return _problem_response(
            app_state,
            state,
            RequestInProgress(
                "This request lost its claim on the idempotency key to a retry; retry to get "
                "the result.",
                retry_after=IN_FLIGHT_RETRY_AFTER,
            ),
        )
    emit(signals.completed, state.scope, status=response.status_code, stored=snapshot is not None)
    if snapshot is None:
        log.warning(
            "response not stored (streamed or larger than IDEMPOTENCY_MAX_BODY); "
            "retries get 409 response-not-stored",
            extra={"key_hash": key_hash(state.scope)},
        )
        # The only caller that gets this answer learns that no retry will.
        response.headers["Idempotent-Stored"] = "false"
    return response


def _store_failed(
    app_state: AppState, state: RequestState, response: Response, *, committing: bool
) -> Response:
    """The view answered but its result could not be recorded: tell the truth."""
    assert state.scope is not None
    emit(signals.store_unavailable, state.scope, stage="complete")
    state.store_failed = True
    if state.connection is None:
        # The view's effects happened outside our transaction: the key must stay taken, and
        # the client still learns what happened.
        state.contacted = True
        give_up(app_state, state, "the store failed after the view ran")
        return response
    released = state.releasable
    reason = (
        "the store failed while committing: the result may or may not be recorded"
        if committing
        else "the store failed before the commit"
    )
    give_up(app_state, state, reason)
    if committing:
        # The commit itself failed: it may have gone through before the answer was lost.
        detail = (
            "The database failed while committing the result, which may or may not have been "
            "recorded. Retry with the same key: the retry replays it or finishes the operation, "
            "never runs it twice."
        )
    elif released:
        detail = (
            "The idempotency store failed before the result was committed; nothing was "
            "changed. Retry with the same key."
        )
    else:
        detail = (
            "The idempotency store failed before the result was recorded. The operation may "
            "have taken effect outside this service; retry with the same key, never a new one."
        )
    return _problem_response(app_state, state, StoreUnavailableProblem(detail))


# -- teardown: a request that never answered -------------------------------------------------


def teardown(exc: BaseException | None) -> None:
    """``teardown_request``: give up a claim the request never finished (``SystemExit`` from
    gunicorn's worker timeout or SIGQUIT, ``KeyboardInterrupt``, a propagated exception)."""
    state = RequestState.current()
    if state is None:
        return
    try:
        if state.token is not None and not state.finished:
            state.completing()
            give_up(AppState.current(), state, "the request ended without an answer")
    finally:
        state.close()
        RequestState.detach()


# -- answers rendered by the extension's error handlers -------------------------------------


def internal_error(error: InternalServerError) -> ResponseReturnValue:
    """Unhandled exceptions in protected views answer a problem document, not HTML."""
    state = RequestState.current()
    if state is None or state.scope is None:
        return error
    return InternalError(
        "The server failed while processing the request. " + _crash_outcome(state)
    ).get_response()


def _crash_outcome(state: RequestState) -> str:
    """What a failed request's client should do next, from what its attempt may have done."""
    if state.token is None:
        return "Retry with the same key."  # it failed answering from the record
    if state.releasable:
        return "Nothing was recorded for this key; retry with the same key."
    return "It may have had an effect; retry with the same key, never a new one."


def store_unavailable(error: StoreUnavailable) -> ResponseReturnValue:
    log.error("idempotency store unavailable during the request: %s", error)
    return StoreUnavailableProblem(
        error.detail
        or "The database cannot be reached; the request was not completed. Retry later."
    ).get_response()


# -- helpers ----------------------------------------------------------------------------------


def _echo_unclaimed(app_state: AppState, response: Response) -> None:
    """Echo the key on a protected endpoint's answers that came before the claim (an
    authentication hook, a rate limit, an authorization decorator)."""
    settings = app_state.settings
    if app_state.extension.options_for(settings) is None:
        return
    try:
        key = read_key(request.headers, settings.headers)
    except InvalidKey:
        key = echo_of_invalid(request.headers, settings.headers)
    if key is not None:
        response.headers[settings.header] = key


def _problem_response(
    app_state: AppState, state: RequestState | None, problem: Problem
) -> Response:
    response = problem.get_response()
    if state is not None and state.scope is not None:
        response.headers[app_state.settings.header] = state.scope.key
    return response


def _settle_unclaimed(app_state: AppState, state: RequestState, response: Response) -> Response:
    """Settle the business transaction of a request that claimed nothing as a claimed one's
    would be: rolled back after an exception, and on a protected view after a status that is
    never stored or an :meth:`~flask_idem.Idempotency.refuse`; committed otherwise.

    If the commit fails (the view's own query met a dead connection and an error handler
    rendered it, leaving the transaction invalid), nothing was committed: answer 503, as a
    store failure anywhere in a request.
    """
    if state.connection is None and state.session is None:
        return response
    protected = state.options is not None
    if (
        state.crashed
        or state.refused
        or (protected and response.status_code in app_state.settings.never_store)
    ):
        rollback(state)
        return response
    try:
        with translate_errors():
            state.commit()
    except StoreUnavailable as exc:
        answer = t.cast(Response, store_unavailable(exc))
        echo = response.headers.get(app_state.settings.header)
        if echo is not None:
            answer.headers[app_state.settings.header] = echo
        return answer
    return response
