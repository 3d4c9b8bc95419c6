"""The Flask extension: hooks that claim a key, replay, store the result and clean up.

Request flow on a protected endpoint (the state machine; the store only offers primitives):

``before_request``
    read and validate the key (400), resolve the tenant, fingerprint the request, claim.
    A fresh claim lets the view run; an existing record answers instead of the view:
    different fingerprint -> 422, completed -> replay, in progress -> 409 (or a short wait),
    lease expired -> 409 ``outcome-pending`` or, with ``recovery="reexecute"``, a takeover,
    unknown -> 409 ``outcome-pending``. A store failure answers 503: the view never runs.
``after_request``
    store the response snapshot (inside the view's business transaction if it opened one),
    or give the key back for statuses that must never be stored.
``teardown_request``
    after an unhandled exception, give the key back, or mark it ``unknown`` if the view
    declared a side effect.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import functools
import hashlib
import logging
import time
import types
import typing as t

import sqlalchemy as sa
from flask import Blueprint, Flask, current_app, g, got_request_exception, request
from flask.typing import ResponseReturnValue
from werkzeug.exceptions import InternalServerError
from werkzeug.wrappers import Response

from . import signals
from .body import read_body
from .config import Settings
from .errors import ConfigurationError, StoreUnavailable
from .fingerprint import fingerprint as canonical_fingerprint
from .keys import InvalidKey, derive_key, echo_of_invalid, key_hash, read_key
from .lease import LeaseKeeper, Watch
from .problem import (
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
)
from .record import ClaimResult, Record, Scope, State, StoredResponse
from .store import Store, create_store
from .store.sql import translate_errors

if t.TYPE_CHECKING:
    from .reconcile import Reconciler, ReconcilerTarget

P = t.ParamSpec("P")
R = t.TypeVar("R")
Recovery = t.Literal["fail", "reexecute"]
FingerprintFunction = t.Callable[[t.Any], "bytes | str"]

EXTENSION_NAME = "idempotency"
_REQUEST_STATE = "_flask_idem"
_OPTIONS_ATTRIBUTE = "__idempotency__"
_WAIT_STEP = 0.05
IN_FLIGHT_RETRY_AFTER = 1

log = logging.getLogger("flask_idem")


@dataclasses.dataclass(frozen=True)
class ViewOptions:
    """How one view (or blueprint, or the whole app) is protected."""

    ttl: float | None = None
    required: bool | None = None
    exclude: tuple[str, ...] = ()
    include: tuple[str, ...] | None = None
    fingerprint: FingerprintFunction | None = None
    recovery: Recovery = "fail"

    def __post_init__(self) -> None:
        if self.recovery not in ("fail", "reexecute"):
            raise ConfigurationError("recovery must be 'fail' or 'reexecute'")
        if self.ttl is not None and self.ttl <= 0:
            raise ConfigurationError("ttl must be a positive number of seconds")
        if self.fingerprint is not None and (self.exclude or self.include is not None):
            raise ConfigurationError("give either fingerprint= or exclude=/include=, not both")

    @classmethod
    def build(
        cls,
        ttl: float | None,
        required: bool | None,
        exclude: t.Iterable[str],
        include: t.Iterable[str] | None,
        fingerprint: FingerprintFunction | None,
        recovery: Recovery,
    ) -> ViewOptions:
        return cls(
            ttl=ttl,
            required=required,
            exclude=tuple(exclude),
            include=None if include is None else tuple(include),
            fingerprint=fingerprint,
            recovery=recovery,
        )


_EXEMPT = ViewOptions()


@dataclasses.dataclass
class AppState:
    """What ``init_app`` keeps per application in ``app.extensions["idempotency"]``."""

    extension: Idempotency
    settings: Settings
    store: Store
    keeper: LeaseKeeper

    @classmethod
    def current(cls) -> AppState:
        """The state of ``current_app`` (for hooks, the CLI, the blueprint and reconcilers)."""
        return t.cast(AppState, current_app.extensions[EXTENSION_NAME])


@dataclasses.dataclass
class RequestState:
    """One protected request's progress through the state machine (kept on ``flask.g``)."""

    scope: Scope | None
    options: ViewOptions | None
    token: str | None = None
    #: The record this request owns (claimed or taken over).
    record: Record | None = None
    watch: Watch | None = None
    connection: sa.Connection | None = None
    side_effect: bool = False
    crashed: bool = False
    finished: bool = False
    #: What to echo in the key header when there is no valid key (see ``echo_of_invalid``).
    echo: str | None = None


class Idempotency:
    """Make a Flask application's write endpoints safe to retry.

    :param app: the application, or None to call :meth:`init_app` later.
    :param store: a ready store; by default one is built from ``IDEMPOTENCY_ENGINE`` or
        ``IDEMPOTENCY_DATABASE_URL``.
    :param tenant: a callable returning the authenticated tenant of the current request
        (for example from ``flask.g``); see also :meth:`tenant_resolver`.
    """

    def __init__(
        self,
        app: Flask | None = None,
        *,
        store: Store | None = None,
        tenant: t.Callable[[], str | None] | None = None,
    ) -> None:
        self._store = store
        self._tenant = tenant
        self._blueprints: dict[str, ViewOptions] = {}
        self._reconcilers: dict[ReconcilerTarget, Reconciler] = {}
        if app is not None:
            self.init_app(app)

    # -- registration -------------------------------------------------------------------

    def init_app(self, app: Flask) -> None:
        """Register the hooks, the ``flask idem`` commands and the inspection blueprint.

        Register authentication and rate limiting before this call: Flask runs
        ``before_request`` hooks in registration order, and the claim must come after both (a
        key is no credential, and a 429 must never be stored).
        """
        # The CLI and the blueprint build on this module: importing them at the top would be
        # an import cycle.
        from .blueprint import create_blueprint
        from .cli import idem_group

        if EXTENSION_NAME in app.extensions:
            raise RuntimeError("flask_idem is already registered on this application")
        settings = Settings.from_mapping(app.config)
        store = self._store or self._build_store(settings)
        if settings.ensure_partitions:
            _ensure_partitions(store, settings.partitions_ahead)
        app.extensions[EXTENSION_NAME] = AppState(self, settings, store, LeaseKeeper(store))
        app.cli.add_command(idem_group)
        if settings.blueprint_prefix is not None:
            app.register_blueprint(create_blueprint(self), url_prefix=settings.blueprint_prefix)
        app.before_request(self._before_request)
        app.after_request(self._after_request)
        app.teardown_request(self._teardown_request)
        got_request_exception.connect(_mark_crashed, app, weak=False)
        # Unhandled exceptions in protected views answer problem+json; an application's own
        # 500 handler, registered before this call, wins.
        if not app.error_handler_spec[None].get(500):
            app.register_error_handler(InternalServerError, _internal_error)
        # A store failure anywhere in a request (``idem.connection()`` in any view) fails
        # closed with 503, never with a 500 and a traceback.
        app.register_error_handler(StoreUnavailable, _store_unavailable)

    @staticmethod
    def _build_store(settings: Settings) -> Store:
        target = settings.engine or settings.database_url
        if target is None:
            raise ConfigurationError(
                "flask_idem needs a database: set IDEMPOTENCY_DATABASE_URL (e.g. "
                "postgresql://user@host/db) or IDEMPOTENCY_ENGINE, or pass store= to Idempotency"
            )
        return create_store(target)

    def tenant_resolver(self, function: t.Callable[[], str | None]) -> t.Callable[[], str | None]:
        """Decorator registering the callable that returns the current request's tenant."""
        self._tenant = function
        return function

    def current_tenant(self) -> str | None:
        """The current request's tenant as the resolver sees it, or None (anonymous)."""
        tenant = self._tenant() if self._tenant is not None else None
        return str(tenant) if tenant else None

    def reconciler(self, endpoint: ReconcilerTarget) -> t.Callable[[Reconciler], Reconciler]:
        """Decorator registering the function that settles stuck records of an endpoint.

        ``flask idem reconcile`` calls it with each record left in progress past its lease or
        marked unknown; it looks the business outcome up by key and returns a
        :class:`~flask_idem.reconcile.Verdict`::

            @idem.reconciler(create_payment)
            def payment_outcome(record):
                charge = provider.find(idempotency_key=derive_key(record, "charge"))
                if charge is None:
                    return Verdict.not_happened()
                return Verdict.happened(({"id": charge.id}, 201))

        :param endpoint: the view function, its Flask endpoint name (``"payments.create"``,
            as for ``url_for``; both cover each protected method of its URL rules), or the
            endpoint as records spell it (``"POST /v1/payments"``).
        """

        def register(function: Reconciler) -> Reconciler:
            if endpoint in self._reconcilers:
                raise ConfigurationError(f"a reconciler for {endpoint!r} is already registered")
            self._reconcilers[endpoint] = function
            return function

        return register

    @property
    def reconcilers(self) -> t.Mapping[ReconcilerTarget, Reconciler]:
        """The registered reconcilers, by the target they were registered for."""
        return types.MappingProxyType(self._reconcilers)

    @t.overload
    def idempotent(self, view: t.Callable[P, R]) -> t.Callable[P, R]: ...

    @t.overload
    def idempotent(
        self,
        view: None = None,
        *,
        ttl: float | None = None,
        required: bool | None = None,
        exclude: t.Iterable[str] = (),
        include: t.Iterable[str] | None = None,
        fingerprint: FingerprintFunction | None = None,
        recovery: Recovery = "fail",
    ) -> t.Callable[[t.Callable[P, R]], t.Callable[P, R]]: ...

    def idempotent(
        self,
        view: t.Callable[P, R] | None = None,
        *,
        ttl: float | None = None,
        required: bool | None = None,
        exclude: t.Iterable[str] = (),
        include: t.Iterable[str] | None = None,
        fingerprint: FingerprintFunction | None = None,
        recovery: Recovery = "fail",
    ) -> t.Any:
        """Protect a view. The hooks do the work; the decorator only records the options.

        :param ttl: seconds a key stays live for this view (default ``IDEMPOTENCY_TTL``).
        :param required: whether a request without a key is refused with 400 (default
            ``IDEMPOTENCY_KEY_REQUIRED``); an optional key that is absent means no protection.
        :param exclude: top-level body fields left out of the fingerprint (volatile ones).
        :param include: if given, the only top-level body fields in the fingerprint.
        :param fingerprint: a callable ``(request) -> bytes | str`` replacing the canonical
            body and query comparison.
        :param recovery: what a retry does after the first request's lease expired: ``fail``
            (409 ``outcome-pending``) or ``reexecute`` (take the lease over and run again, for
            views whose side effects are downstream-idempotent).
        """
        options = ViewOptions.build(ttl, required, exclude, include, fingerprint, recovery)

        def decorate(function: t.Callable[P, R]) -> t.Callable[P, R]:
            @functools.wraps(function)
            def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
                return current_app.ensure_sync(function)(*args, **kwargs)  # type: ignore[no-any-return]

            setattr(wrapper, _OPTIONS_ATTRIBUTE, options)
            return wrapper

        return decorate(view) if view is not None else decorate

    def exempt(self, view: t.Callable[P, R]) -> t.Callable[P, R]:
        """Leave a view unprotected even under app-wide or blueprint-wide protection."""
        setattr(view, _OPTIONS_ATTRIBUTE, _EXEMPT)
        return view

    def protect_blueprint(
        self,
        blueprint: Blueprint,
        *,
        ttl: float | None = None,
        required: bool | None = None,
        exclude: t.Iterable[str] = (),
        include: t.Iterable[str] | None = None,
        fingerprint: FingerprintFunction | None = None,
        recovery: Recovery = "fail",
    ) -> None:
        """Protect every view of ``blueprint`` (same options as :meth:`idempotent`)."""
        self._blueprints[blueprint.name] = ViewOptions.build(
            ttl, required, exclude, include, fingerprint, recovery
        )

    # -- helpers for views ----------------------------------------------------------------

    def side_effect(self) -> None:
        """Declare that the running view may have caused an external side effect.

        From now on an unhandled exception marks the key ``unknown`` (retries get 409
        ``outcome-pending``) instead of releasing it for a second execution.
        """
        state = _request_state()
        if state is not None:
            state.side_effect = True

    def connection(self) -> sa.Connection:
        """The request's business transaction on the store's database.

        Writes made here commit in the same transaction as the stored response (no crash
        window between them), or roll back with it when the key is given back.
        """
        state = _request_state()
        if state is None:
            state = RequestState(scope=None, options=None)
            setattr(g, _REQUEST_STATE, state)
        if state.connection is None:
            state.connection = _app_state().store.begin()
        return state.connection

    def downstream_key(self, step: str) -> str:
        """A deterministic key for a downstream call (payment provider) of this operation."""
        state = _request_state()
        if state is None or state.record is None:
            raise RuntimeError("downstream_key() needs a request that holds an idempotency key")
        return derive_key(state.record, step)

    # -- hooks ------------------------------------------------------------------------------

    def _options_for(self, settings: Settings) -> ViewOptions | None:
        if request.method not in settings.methods or request.url_rule is None:
            return None
        view = current_app.view_functions.get(request.endpoint or "")
        options: ViewOptions | None = getattr(view, _OPTIONS_ATTRIBUTE, None)
        if options is _EXEMPT:
            return None
        if options is not None:
            return options
        for name in request.blueprints:
            if name in self._blueprints:
                return self._blueprints[name]
        return ViewOptions() if settings.protect_all else None

    def _resolve_tenant(self) -> str:
        tenant = self.current_tenant()
        if tenant is None:
            log.error("protected request without a tenant: configure Idempotency(tenant=...)")
            raise TenantUnresolved(
                "The server could not tell whose request this is, so it refuses to run it."
            )
        return tenant

    def _before_request(self) -> ResponseReturnValue | None:
        app_state = _app_state()
        settings = app_state.settings
        options = self._options_for(settings)
        if options is None:
            return None
        try:
            key = read_key(request.headers, settings.headers)
        except InvalidKey as exc:
            echo = echo_of_invalid(request.headers, settings.headers)
            setattr(g, _REQUEST_STATE, RequestState(None, options, echo=echo))
            raise KeyInvalid(str(exc)) from None
        if key is None:
            required = settings.key_required if options.required is None else options.required
            if required:
                raise KeyMissing(f"This endpoint requires an {settings.header} header.")
            return None
        assert request.url_rule is not None
        scope = Scope(self._resolve_tenant(), f"{request.method} {request.url_rule.rule}", key)
        state = RequestState(scope, options)
        setattr(g, _REQUEST_STATE, state)
        digest = _fingerprint(options)
        ttl = options.ttl or settings.ttl
        deadline = time.monotonic() + settings.wait
        while True:
            try:
                result: ClaimResult | None = app_state.store.claim(
                    scope, digest, ttl=ttl, lease=settings.lease
                )
                assert result is not None
                if not result.claimed:
                    result = self._existing(result.record, digest, options, deadline)
            except StoreUnavailable:
                log.error("idempotency store unavailable", extra={"key_hash": key_hash(scope)})
                raise StoreUnavailableProblem(
                    "The idempotency store cannot be reached; the request was not executed."
                ) from None
            except _Replay as replay:
                return replay.response
            if result is not None:
                _own(state, result)
                return None

    def _existing(
        self, record: Record, digest: bytes, options: ViewOptions, deadline: float
    ) -> ClaimResult | None:
        """Answer a claim that found a record: raise a problem, replay, or keep waiting.

        :returns: a takeover claim to run the view with, or None to claim again.
        """
        if record.fingerprint != digest:
            _emit(signals.mismatch, record.scope)
            raise KeyReused(
                "This idempotency key was already used with a different request; "
                "use a new key for a new operation."
            )
        if record.state is State.COMPLETED:
            assert record.response is not None
            _emit(signals.replayed, record.scope, status=record.response.status)
            raise _Replay(_replay(record.response))
        if record.state is State.UNSTORED:
            raise ResponseNotStored(
                "The original request completed but its response was too large or streamed "
                "to be stored; it cannot be replayed."
            )
        if record.state is State.UNKNOWN:
            raise OutcomePending(
                "The outcome of the original request is not known yet; it is being reconciled."
            )
        if record.lease_expired:
            if options.recovery != "reexecute":
                raise OutcomePending(
                    "The original request stopped before it finished; its outcome is not "
                    "known and it will not be executed again automatically."
                )
            assert record.claim_token is not None
            settings = _app_state().settings
            return _app_state().store.take_over(
                record.scope, record.claim_token, lease=settings.lease
            )
        if time.monotonic() < deadline:
            time.sleep(min(_WAIT_STEP, max(0.0, deadline - time.monotonic())))
            return None
        _emit(signals.conflict, record.scope)
        raise RequestInProgress(
            "A request with this idempotency key is still being processed; retry later.",
            # The lease says when the owner counts as gone, not when it will finish: most
            # requests finish within a second, so that is the useful hint.
            retry_after=IN_FLIGHT_RETRY_AFTER,
        )

    def _after_request(self, response: Response) -> Response:
        state = _request_state()
        if state is None:
            self._echo_unclaimed(response)
            return response
        echo = state.scope.key if state.scope is not None else state.echo
        if echo is not None:
            response.headers[_app_state().settings.header] = echo
        if state.crashed or state.finished:
            return response
        if state.token is None:
            _commit(state)
            return response
        return _finish(state, response)

    def _echo_unclaimed(self, response: Response) -> None:
        """Echo the key on a protected endpoint's answers that came before the claim (an
        authentication or rate-limit hook registered earlier)."""
        settings = _app_state().settings
        if self._options_for(settings) is None:
            return
        try:
            key = read_key(request.headers, settings.headers)
        except InvalidKey:
            key = echo_of_invalid(request.headers, settings.headers)
        if key is not None:
            response.headers[settings.header] = key

    def _teardown_request(self, exc: BaseException | None) -> None:
        state = _request_state()
        if state is None:
            return
        try:
            if state.token is not None and not state.finished:
                _stop_watching(state)
                _rollback(state)
                _give_back(state, "unhandled exception" if exc or state.crashed else "aborted")
        finally:
            if state.connection is not None:
                state.connection.close()
            g.pop(_REQUEST_STATE, None)


class _Replay(Exception):
    """Carries a replayed response out of the claim loop."""

    def __init__(self, response: Response) -> None:
        self.response = response


def _app_state() -> AppState:
    return AppState.current()


def _request_state() -> RequestState | None:
    return t.cast("RequestState | None", g.get(_REQUEST_STATE))


def _emit(signal: t.Any, scope: Scope, **extra: t.Any) -> None:
    """Send a signal with the app as sender and the scope as tenant, endpoint and key hash."""
    if not signal.receivers:
        return  # the common case: nobody listens, so skip hashing the key
    signal.send(
        current_app._get_current_object(),  # type: ignore[attr-defined]
        tenant=scope.tenant,
        endpoint=scope.endpoint,
        key_hash=key_hash(scope),
        **extra,
    )


def _fingerprint(options: ViewOptions) -> bytes:
    if options.fingerprint is not None:
        value = options.fingerprint(request)
        data = value.encode() if isinstance(value, str) else bytes(value)
        return hashlib.sha256(b"custom\x00" + data).digest()
    assert request.url_rule is not None
    return canonical_fingerprint(
        request.method,
        request.url_rule.rule,
        request.view_args or {},
        request.args.items(multi=True),
        read_body(request, _app_state().settings.max_request_body),
        request.content_type,
        exclude=options.exclude,
        include=options.include,
    )


def _own(state: RequestState, claim: ClaimResult) -> None:
    assert state.scope is not None
    app_state = _app_state()
    state.token = claim.token
    state.record = claim.record
    state.watch = app_state.keeper.watch(claim.record, app_state.settings.lease)
    _emit(signals.claimed, state.scope)


def _replay(stored: StoredResponse) -> Response:
    response = current_app.response_class(stored.body, status=stored.status)
    del response.headers["Content-Type"]
    for name, value in stored.headers:
        response.headers.add(name, value)
    response.headers["Idempotent-Replayed"] = "true"
    return response


def response_snapshot(settings: Settings, response: Response) -> StoredResponse | None:
    """The replayable part of a response, or None when it cannot be stored.

    A streamed body is buffered when it declares a length within the limit: an
    ``HTTPException`` raised in a view (``abort(404)``, a :class:`Problem`) reaches us as such
    a response. A stream of unknown length, or a file passed through, is never buffered.
    """
    if response.direct_passthrough:
        return None
    length = response.content_length
    if response.is_streamed and (length is None or length > settings.max_body):
        return None
    body = response.get_data()
    if len(body) > settings.max_body:
        return None
    headers = tuple(
        (name, value)
        for name, value in response.headers.items()
        if name.lower() in settings.stored_headers
    )
    return StoredResponse(response.status_code, headers, body)


def _finish(state: RequestState, response: Response) -> Response:
    """Store the view's response (or give the key back) once the view has answered."""
    assert state.scope is not None and state.token is not None
    app_state = _app_state()
    settings = app_state.settings
    _stop_watching(state)
    if response.status_code in settings.never_store:
        _rollback(state)
        _give_back(state, f"status {response.status_code} is never stored")
        return response
    snapshot = response_snapshot(settings, response)
    try:
        stored = app_state.store.complete(
            state.scope,
            state.token,
            snapshot,
            connection=state.connection,
            created_at=_created_at(state),
        )
        if state.connection is not None:
            with translate_errors():
                if stored:
                    state.connection.commit()
                else:
                    state.connection.rollback()
    except StoreUnavailable:
        return _store_failed_after_view(state, response)
    state.finished = True
    if not stored:
        # The lease expired and another request took the key over: this request's writes in
        # the business transaction are rolled back and the key belongs to the new owner.
        log.warning("lease lost before completion", extra={"key_hash": key_hash(state.scope)})
        return _problem_response(
            state,
            RequestInProgress(
                "This request lost its claim on the idempotency key to a retry; retry to get "
                "the result.",
                retry_after=1,
            ),
        )
    _emit(signals.completed, state.scope, status=response.status_code, stored=snapshot is not None)
    if snapshot is None:
        log.warning(
            "response not stored (streamed or larger than IDEMPOTENCY_MAX_BODY); "
            "retries get 409 response-not-stored",
            extra={"key_hash": key_hash(state.scope)},
        )
    return response


def _store_failed_after_view(state: RequestState, response: Response) -> Response:
    """The view ran but its result could not be recorded."""
    assert state.scope is not None
    state.finished = True
    log.error("could not store the response", extra={"key_hash": key_hash(state.scope)})
    if state.connection is not None:
        # Nothing committed: the business writes rolled back with the snapshot. Give the key
        # back (best effort) so a retry executes once the store is back.
        _rollback(state)
        _give_back(state, "store failed before commit")
        return _problem_response(
            state,
            StoreUnavailableProblem(
                "The idempotency store failed before the result was committed; nothing was "
                "changed. Retry with the same key."
            ),
        )
    # The view's effects happened outside our transaction: the key must stay taken (its lease
    # will expire into outcome-pending), and the client still learns what happened.
    state.side_effect = True
    _give_back(state, "store failed after the view ran")
    return response


def _problem_response(state: RequestState, problem: Problem) -> Response:
    response = problem.get_response()
    if state.scope is not None:
        response.headers[_app_state().settings.header] = state.scope.key
    return response


def _give_back(state: RequestState, reason: str) -> None:
    """Release the key for a fresh execution, or mark it unknown after a side effect."""
    assert state.scope is not None and state.token is not None
    state.finished = True
    store = _app_state().store
    digest = key_hash(state.scope)
    try:
        if state.side_effect:
            store.mark_unknown(state.scope, state.token, created_at=_created_at(state))
            _emit(signals.unknown, state.scope, reason=reason)
            log.warning("outcome unknown: %s", reason, extra={"key_hash": digest})
        else:
            store.release(state.scope, state.token, created_at=_created_at(state))
            _emit(signals.released, state.scope, reason=reason)
    except StoreUnavailable:
        # The lease expires on its own; the record then answers outcome-pending, never a
        # second execution.
        log.error("could not give the key back: %s", reason, extra={"key_hash": digest})


def _created_at(state: RequestState) -> dt.datetime | None:
    # Tells PostgreSQL which partition holds the record (see ``Store.complete``).
    return None if state.record is None else state.record.created_at


def _stop_watching(state: RequestState) -> None:
    if state.watch is not None:
        _app_state().keeper.unwatch(state.watch)
        state.watch = None


def _commit(state: RequestState) -> None:
    if state.connection is not None:
        with translate_errors():
            state.connection.commit()


def _rollback(state: RequestState) -> None:
    if state.connection is not None:
        try:
            state.connection.rollback()
        except sa.exc.SQLAlchemyError:
            log.warning("rollback of the business transaction failed", exc_info=True)


def _mark_crashed(sender: Flask, exception: BaseException, **_: t.Any) -> None:
    state = _request_state()
    if state is not None:
        state.crashed = True


def _store_unavailable(error: StoreUnavailable) -> ResponseReturnValue:
    log.error("idempotency store unavailable during the request: %s", error)
    return StoreUnavailableProblem(
        "The database cannot be reached; the request was not completed. Retry later."
    ).get_response()


def _internal_error(error: InternalServerError) -> ResponseReturnValue:
    """Unhandled exceptions in protected views answer a problem document, not HTML."""
    state = _request_state()
    if state is None or state.scope is None:
        return error
    return InternalError(
        "The server failed while processing the request. "
        + (
            "It may have had an effect; retries get 409 outcome-pending until it is reconciled."
            if state.side_effect
            else "Nothing was recorded for this key; retry with the same key."
        )
    ).get_response()


def _ensure_partitions(store: Store, ahead: int) -> None:
    """Create missing partitions at start-up (``IDEMPOTENCY_ENSURE_PARTITIONS``).

    The dry run only reads, so workers starting together take DDL locks only when a partition
    is really missing; then one full :meth:`Store.maintain` runs. A failure is logged, never
    raised: claims land in the DEFAULT partition meanwhile, and ``flask idem maintain`` (cron)
    moves them out later. SQLite has no partitions, so this is a read-only check there.
    """
    try:
        if store.maintain(ahead=ahead, dry_run=True).created:
            report = store.maintain(ahead=ahead)
            log.info("created partitions at start-up: %s", ", ".join(report.created))
    except StoreUnavailable:
        log.error("could not check partitions at start-up; run `flask idem maintain`")
