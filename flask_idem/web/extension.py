"""The Flask extension: registration, the per-view decorator and the helpers views call.

How a view becomes protected (the guards, which options apply) is :mod:`flask_idem.web.guard`;
the request flow itself (claim, replay, finish, give up) is :mod:`flask_idem.web.flow`, around
the attempt (:mod:`flask_idem.attempt`); jobs are :mod:`flask_idem.jobs`, the next-day check
:mod:`flask_idem.ops.downstream`.
"""

from __future__ import annotations

import logging
import secrets
import types
import typing as t

import sqlalchemy as sa
from flask import (
    Blueprint,
    Flask,
    current_app,
    g,
    got_request_exception,
    has_request_context,
    request,
)
from flask.typing import ResponseReturnValue
from typing_extensions import Unpack
from werkzeug.exceptions import InternalServerError

from .. import jobs
from ..attempt import Attempt
from ..commits import guard_commits
from ..core.config import EXTENSION_NAME, Settings
from ..core.errors import ConfigurationError, JobRefused, StoreUnavailable
from ..core.idempotency_keys import derive_key
from ..core.key_digest import KeyDigest
from ..core.options import (
    OPTIONS_ATTRIBUTE,
    BlueprintOptionArgs,
    JobArgument,
    JobOptionArgs,
    JobOptions,
    ViewOptionArgs,
    ViewOptions,
    mark_exempt,
)
from ..core.sealing import Sealer
from ..lease import LeaseKeeper
from ..ops.cli import idem_group
from ..sessions import EXTENSION_KEY as SQLALCHEMY_EXTENSION
from ..sessions import FlaskSQLAlchemySessions, resolve, watch_unmanaged
from ..state import AppState
from ..store import OperatorStore, RequestStore, Store, create_store, operator_store
from . import flow, guard
from .body import read_body
from .inspection import create_blueprint
from .key_limit import KeyLimiter

if t.TYPE_CHECKING:
    from ..ops.downstream import Lookup, LookupTarget
    from ..ops.metrics import Metrics
    from ..ops.otel import Telemetry
    from ..ops.reconcile import Reconciler, ReconcilerTarget
    from .operator_page import OperatorAccess

P = t.ParamSpec("P")
R = t.TypeVar("R")

#: The package's logger, as every module of the face logs (tests and deployments filter on it).
log = logging.getLogger("flask_idem")


class Idempotency:
    """Make a Flask application's write endpoints safe to retry.

    :param app: the application, or None to call :meth:`init_app` later.
    :param store: a ready store; by default one is built from ``IDEMPOTENCY_ENGINE`` or
        ``IDEMPOTENCY_DATABASE_URL``. A store with the request primitives only
        (:class:`~flask_idem.store.RequestStore`) needs ``IDEMPOTENCY_BLUEPRINT_PREFIX = None``:
        the inspection endpoint, ``flask idem`` and the other operator tools read records
        through :class:`~flask_idem.store.OperatorStore`.
    :param tenant: a callable returning the authenticated tenant of the current request
        (for example from ``flask.g``); see also :meth:`tenant_resolver`.
    :param db: the application's Flask-SQLAlchemy ``SQLAlchemy``: the store runs on its
        engine and ``db.session`` is the business transaction of protected requests (see
        :mod:`flask_idem.sessions`). Without ``db``, ``store`` or a configured database, a
        Flask-SQLAlchemy registered on the app is used the same way.
    :param bind_key: the Flask-SQLAlchemy bind holding flask_idem's table (default: the
        ``SQLALCHEMY_DATABASE_URI`` one).
    :param operator: who may see the operator page, and which tenants' records (see
        :meth:`operator_access`); without it the page is off.
    :param metrics: the Prometheus metrics to feed (:class:`flask_idem.ops.metrics.Metrics`,
        e.g. on a registry of your own); ``IDEMPOTENCY_METRICS = True`` uses the default one.
    :param telemetry: the OpenTelemetry spans and counters to feed
        (:class:`flask_idem.ops.otel.Telemetry`, e.g. on providers of your own);
        ``IDEMPOTENCY_OPENTELEMETRY = True`` uses the global providers.
    """

    def __init__(
        self,
        app: Flask | None = None,
        *,
        store: RequestStore | None = None,
        tenant: t.Callable[[], str | None] | None = None,
        db: t.Any = None,
        bind_key: str | None = None,
        operator: OperatorAccess | None = None,
        metrics: Metrics | None = None,
        telemetry: Telemetry | None = None,
    ) -> None:
        if db is not None and store is not None:
            raise ConfigurationError("pass either db= or store= to Idempotency, not both")
        self._store = store
        self._db = db
        self._bind_key = bind_key
        self._tenant = tenant
        self._operator = operator
        self._metrics = metrics
        self._telemetry = telemetry
        self._blueprints: dict[Blueprint, ViewOptions] = {}
        self._reconcilers: dict[ReconcilerTarget, Reconciler] = {}
        self._lookups: dict[ReconcilerTarget, LookupTarget] = {}
        if app is not None:
            self.init_app(app)

    # -- registration -------------------------------------------------------------------

    def init_app(self, app: Flask) -> None:
        """Register the hooks, the ``flask idem`` commands and the inspection blueprint.

        The claim runs when the view is dispatched: after every ``before_request`` hook and
        after the decorators above ``@idem.idempotent``, so authentication, authorization and
        rate limits placed there run first (a key is no credential, and a 429 must never be
        stored).
        """
        if EXTENSION_NAME in app.extensions:
            raise RuntimeError("flask_idem is already registered on this application")
        settings = Settings.from_mapping(app.config)
        sessions = self._sessions(app, settings)
        store = self._store or (
            create_store(sessions.engine(app)) if sessions else self._build_store(settings)
        )
        if settings.blueprint_prefix is not None:
            # Refused before anything is registered: the endpoint and its page read records.
            operator_store(
                store,
                "the inspection endpoint (IDEMPOTENCY_BLUEPRINT_PREFIX = None switches it off)",
            )
        store.use_sealer(Sealer.from_settings(settings))
        store.use_keys(KeyDigest.from_secrets(settings.key_secrets))
        store.use_audit(settings.audit, settings.audit_retention)
        if isinstance(store, OperatorStore):
            store.use_archive(settings.archive)  # only maintenance reads it
        store.use_fast_path(settings.sqlalchemy_fast_path)
        guard_commits(store.engine, fast=store.fast_path)
        if settings.ensure_partitions and settings.enabled:
            _ensure_partitions(
                operator_store(store, "IDEMPOTENCY_ENSURE_PARTITIONS"), settings.partitions_ahead
            )
        app.extensions[EXTENSION_NAME] = AppState(
            self,
            settings,
            store,
            LeaseKeeper(store),
            KeyLimiter(),
            sessions=sessions,
            plain_ensure_sync=type(app).ensure_sync is Flask.ensure_sync
            and "ensure_sync" not in vars(app),
            unmanaged_db=None if sessions is not None else _unmanaged(app),
        )
        app.cli.add_command(idem_group)
        if settings.blueprint_prefix is not None:
            app.register_blueprint(create_blueprint(self), url_prefix=settings.blueprint_prefix)
        app.before_request(guard.outer_guard)
        # Flask runs after_request hooks in reverse: this one before the hooks registered
        # earlier. The operation is recorded once the view answered; a hook failing after that
        # (a metrics or audit exporter) does not undo it: the client's retry replays it, and
        # a hook that commits the session, compresses or signs the body sees it settled.
        app.after_request(guard.finish)
        app.teardown_request(flow.teardown)
        got_request_exception.connect(_on_request_exception, app, weak=False)
        # Unhandled exceptions in protected views answer problem+json; an application's own
        # 500 handler, registered before this call, wins.
        if not app.error_handler_spec[None].get(500):
            app.register_error_handler(InternalServerError, flow.internal_error)
        # A store failure anywhere in a request (``idem.connection()`` in any view) fails
        # closed with 503, never with a 500 and a traceback.
        app.register_error_handler(StoreUnavailable, flow.store_unavailable)
        if settings.metrics or self._metrics is not None:
            from ..ops import metrics

            metrics.install(app, self._metrics, settings)
        if settings.opentelemetry or self._telemetry is not None:
            from ..ops import otel

            otel.install(app, self._telemetry, settings)

    def _sessions(self, app: Flask, settings: Settings) -> FlaskSQLAlchemySessions | None:
        """Flask-SQLAlchemy's sessions: given with ``db=``, or detected when nothing names
        another database (``IDEMPOTENCY_DATABASE_URL`` or ``IDEMPOTENCY_ENGINE`` naming the
        same one as Flask-SQLAlchemy's bind counts as nothing: ``db.session`` must then commit
        with the stored response, or the view's rows would be lost)."""
        if self._store is not None:
            return None
        sessions = resolve(app, self._db, self._bind_key)
        if sessions is None:
            return None
        if self._db is None and settings.engine is not None:
            # An engine given as it is keeps its settings: it is the session's only if it is
            # the very engine Flask-SQLAlchemy built.
            if settings.engine is not sessions.engine(app):
                return None
        elif self._db is None and settings.database_url is not None:
            if not sessions.same_database(app, settings.database_url):
                return None
        sessions.install()
        return sessions

    @staticmethod
    def _build_store(settings: Settings) -> Store:
        target = settings.engine or settings.database_url
        if target is None and not settings.enabled:
            # IDEMPOTENCY_ENABLED = False (unit tests): nothing is claimed, so no table is
            # ever read; idem.connection() still works, on an empty in-memory database.
            return create_store("sqlite://")
        if target is None:
            raise ConfigurationError(
                "flask_idem needs a database: set IDEMPOTENCY_DATABASE_URL (e.g. "
                "postgresql://user@host/db) or IDEMPOTENCY_ENGINE, or pass store= to Idempotency; "
                "with Flask-SQLAlchemy, pass db= or call db.init_app(app) before init_app"
            )
        return create_store(target)

    def tenant_resolver(self, function: t.Callable[[], str | None]) -> t.Callable[[], str | None]:
        """Decorator registering the callable that returns the current request's tenant."""
        self._tenant = function
        return function

    def operator_access(self, function: OperatorAccess) -> OperatorAccess:
        """Decorator registering who may see the operator page (``<prefix>/operator``).

        The function is called in the page's request, after the application's own
        ``before_request`` hooks, and returns None or False (403), a tenant or a collection of
        tenants whose records the user may see, or True for every tenant. Without it the page
        is off (404). The page only reads: changes stay in ``flask idem``.
        """
        self._operator = function
        return function

    @property
    def operator(self) -> OperatorAccess | None:
        """The registered operator authorization, or None (the operator page is off)."""
        return self._operator

    def current_tenant(self) -> str | None:
        """The current request's tenant as the resolver sees it, or None (anonymous)."""
        tenant = self._tenant() if self._tenant is not None else None
        return str(tenant) if tenant else None

    def reconciler(self, endpoint: ReconcilerTarget) -> t.Callable[[Reconciler], Reconciler]:
        """Decorator registering the function that settles stuck records of an endpoint.

        ``flask idem reconcile`` calls it with each record left in progress past its lease or
        marked unknown; it looks the business outcome up by key and returns a
        :class:`~flask_idem.ops.reconcile.Verdict`::

            @idem.reconciler(create_payment)
            def payment_outcome(record):
                charge = provider.find(idempotency_key=derive_key(record, "charge"))
                if charge is None:
                    return Verdict.not_happened()  # reopened: same downstream keys
                return Verdict.happened(({"id": charge.id}, 201))

        :param endpoint: the view function, its Flask endpoint name (``"payments.create"``,
            as for ``url_for``; both cover each protected method of its URL rules), the
            endpoint as records spell it (``"POST /v1/payments"``), or a job function (its
            records spell ``"JOB <name>"``).
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

    def downstream_lookup(
        self, endpoint: ReconcilerTarget, *, step: str
    ) -> t.Callable[[Lookup], Lookup]:
        """Decorator registering what a downstream service recorded, for the next-day check
        (``flask idem audit-downstream``, see :mod:`flask_idem.ops.downstream`).

        The function gets a time window ``(start, end)`` and returns the service's operations
        created in it (the provider's charges), each with the downstream key it was sent::

            @idem.downstream_lookup(create_payment, step="charge")
            def provider_charges(start, end):
                return [DownstreamRecord(c.id, c.tenant, c.downstream_key, c.created)
                        for c in provider.list_charges(created_from=start, created_to=end)]

        :param endpoint: as for :meth:`reconciler`; one function may be registered for several
            endpoints that call the same service (it is asked once per run).
        :param step: the step the endpoint passes to :meth:`downstream_key` for this call.
        """
        from ..ops.downstream import LookupTarget

        def register(function: Lookup) -> Lookup:
            if endpoint in self._lookups:
                raise ConfigurationError(f"a downstream lookup for {endpoint!r} is registered")
            self._lookups[endpoint] = LookupTarget(function, step)
            return function

        return register

    @property
    def downstream_lookups(self) -> t.Mapping[ReconcilerTarget, LookupTarget]:
        """The registered downstream lookups, by the target they were registered for."""
        return types.MappingProxyType(self._lookups)

    def job(
        self,
        name: str,
        *,
        key: JobArgument,
        tenant: JobArgument,
        **options: Unpack[JobOptionArgs],
    ) -> t.Callable[[t.Callable[P, R]], t.Callable[P, R]]:
        """Give a worker function the outcome model of a view (see :mod:`flask_idem.jobs`).

        A call claims ``(tenant, "JOB <name>", key)``, runs the function and stores its return
        value as JSON with the business transaction of :meth:`connection`; a redelivered
        message gets that value back (decoded from JSON) instead of a second run. A call
        needs an app context, not a request. A redelivery while another worker still runs
        the message raises :class:`~flask_idem.core.errors.JobInProgress` (retry it later)::

            @idem.job("charge-order", key="order_id", tenant="merchant",
                      recovery="reexecute", release_before_contact=True)
            def charge_order(merchant: str, order_id: str, amount: int) -> dict:
                charge = provider.charge(amount, idempotency_key=idem.downstream_key("charge"))
                idem.connection().execute(orders.update()...)
                return {"charge": charge.id}

        :param name: the job's name (1 to 200 characters from ``A-Z a-z 0-9 . _ : / -``).
        :param key: what identifies one operation: the name of a parameter (a business key
            such as an order id, or the message id), or a callable taking the job's arguments.
            Validated like a header key.
        :param tenant: whose operation it is, spelled like ``key``; never a global namespace.
        :param options: the job options, each declared and documented once, in
            :class:`~flask_idem.core.options.JobOptionArgs`.
        """
        return jobs.job(JobOptions.build(name, key, tenant, options))

    @t.overload
    def idempotent(self, view: t.Callable[P, R]) -> t.Callable[P, R]: ...

    @t.overload
    def idempotent(
        self, view: None = None, **options: Unpack[ViewOptionArgs]
    ) -> t.Callable[[t.Callable[P, R]], t.Callable[P, R]]: ...

    def idempotent(
        self, view: t.Callable[P, R] | None = None, **options: Unpack[ViewOptionArgs]
    ) -> t.Any:
        """Protect a view. The claim runs when the view is called, after every decorator
        placed above this one (put authorization there, or in a ``before_request`` hook).

        :param options: the view options, each declared and documented once, in
            :class:`~flask_idem.core.options.ViewOptionArgs`.
        """
        declared = ViewOptions.build("Idempotency.idempotent", ViewOptionArgs, options)

        def decorate(function: t.Callable[P, R]) -> t.Callable[P, R]:
            guarded = guard.guard(function, declared)
            setattr(guarded, OPTIONS_ATTRIBUTE, declared)
            return guarded

        return decorate(view) if view is not None else decorate

    def exempt(self, view: t.Callable[P, R]) -> t.Callable[P, R]:
        """Leave a view unprotected even under app-wide or blueprint-wide protection."""
        return mark_exempt(view)

    def protect_blueprint(
        self, blueprint: Blueprint, **options: Unpack[BlueprintOptionArgs]
    ) -> None:
        """Protect every view of ``blueprint``, with the options declared in
        :class:`~flask_idem.core.options.BlueprintOptionArgs`.

        The claim runs when a view is dispatched, after the app's and the blueprint's
        ``before_request`` hooks but before any decorator on the view itself: authorization
        for such views belongs in a ``before_request`` hook, or use :meth:`idempotent` under
        the authorization decorator.
        """
        self._blueprints[blueprint] = ViewOptions.build(
            "Idempotency.protect_blueprint", BlueprintOptionArgs, options
        )

    @property
    def protected_blueprints(self) -> t.Mapping[Blueprint, ViewOptions]:
        """The blueprints :meth:`protect_blueprint` protects, with their options (see
        :func:`flask_idem.web.guard.protection`)."""
        return types.MappingProxyType(self._blueprints)

    # -- helpers for views ----------------------------------------------------------------

    def side_effect(self) -> None:
        """Declare that the running view is about to contact the outside world.

        From now on a failure leaves the key ``unknown`` (a retry re-runs the operation only
        on a ``recovery="reexecute"`` view, as the same operation), never released.
        """
        attempt = Attempt.current()
        if attempt is not None:
            _refuse_in_atomic(attempt, "side_effect()")
            attempt.contact()

    def refuse(self, rv: ResponseReturnValue) -> t.NoReturn:
        """Answer ``rv`` as a refusal, now: the view did nothing, so the key is given back.

        It raises, as ``abort()`` does, so nothing after it runs. For what a view decides
        before any contact with the outside world (a limit of its own, a 401 or 503 it
        answers itself)::

            if not quota.allows(g.tenant):
                idem.refuse(({"error": "daily limit reached"}, 429))

        The answer is never stored and goes to the client as it is (the application's error
        handlers do not see it), the business transaction rolls back, and the next request
        with the key runs the view again. After :meth:`downstream_key` or :meth:`side_effect`,
        or in a re-run of an ``unknown`` record, the attempt may have had an effect: it ends
        ``unknown`` as any other failure, never released. In a job it raises
        :class:`~flask_idem.core.errors.JobRefused` carrying ``rv`` (retryable: the redelivery runs
        the job again). Without ``refuse`` a plain view's failure leaves the key ``unknown``.
        The refusal is the run's that called it: one of a job run inline inside a view or
        another job, let through by it, is that run's failure, never its refusal.
        """
        attempt = Attempt.current()
        refusal: Exception
        if not has_request_context() or isinstance(getattr(attempt, "options", None), JobOptions):
            refusal = JobRefused("the job refused to run; redeliver it later", value=rv)
        else:
            refusal = flow.Refusal(current_app.make_response(rv))
        if attempt is not None:
            attempt.note_refusal(refusal)
        try:
            raise refusal
        finally:
            del refusal  # raised from a local of its own frame, it would be a reference cycle

    def request_body(self) -> bytes:
        """The current request's body, read as the claim reads it: whole, and refused past
        ``IDEMPOTENCY_MAX_REQUEST_BODY`` before more is read.

        For what must read the body before the claim, a webhook's signature check above all:
        ``request.get_data()`` there reads whatever a caller sends, however large, before it
        can tell a forgery apart. The claim then reuses these bytes.

        :raises Problem: 413 ``request-body-too-large`` (declared or received over the
            limit), 400 ``request-body-incomplete`` (a body cut short).
        """
        req = request._get_current_object()  # type: ignore[attr-defined]
        return read_body(req, AppState.current().settings.max_request_body)

    def connection(self) -> sa.Connection:
        """The request's (or job's) business transaction on the store's database.

        Writes made here commit in the same transaction as the stored response (no crash
        window between them), or roll back with it when the attempt fails.
        """
        return Attempt.ensure().begin()

    def downstream_key(self, step: str) -> str:
        """A deterministic key for a downstream call (payment provider) of this operation.

        Every execution of the operation derives the same key for ``step`` (a takeover, a
        re-run of an unknown outcome). Asking for it declares contact with the outside world
        (see :meth:`side_effect`): the caller is about to use it.
        """
        attempt = Attempt.current()
        if (attempt is None or attempt.record is None) and not AppState.current().settings.enabled:
            return _unprotected_key(step)
        if attempt is None or attempt.record is None:
            raise RuntimeError(
                "downstream_key() needs a request or a job that holds an idempotency key"
            )
        _refuse_in_atomic(attempt, "downstream_key()")
        attempt.contact()
        return derive_key(attempt.record, step)


def _unmanaged(app: Flask) -> t.Any:
    """The app's Flask-SQLAlchemy when flask_idem does not settle its session, watched."""
    db = app.extensions.get(SQLALCHEMY_EXTENSION)
    if db is not None:
        watch_unmanaged(db)
    return db


def _unprotected_key(step: str) -> str:
    """A downstream key while ``IDEMPOTENCY_ENABLED`` is off: random, the same for a step
    within one request or job (there is no record to derive it from)."""
    keys: dict[str, str] = g.setdefault("_flask_idem_unprotected_keys", {})
    return keys.setdefault(step, f"unprotected-{step}-{secrets.token_hex(12)}")


def _refuse_in_atomic(attempt: Attempt, call: str) -> None:
    if attempt.atomic:
        # A crash rolls an atomic view back and frees its key: an external call made
        # meanwhile would then run again on the retry. Such a view needs the durable claim.
        raise RuntimeError(
            f"{call} in an atomic view: its effects must all be in idem.connection(); "
            "use @idem.idempotent() without atomic=True for views that call other services"
        )


def _on_request_exception(sender: Flask, exception: BaseException, **_: t.Any) -> None:
    # Any unhandled exception in a claimed request (an after_request hook of another
    # extension, ...) also counts as a crash: never store the 500 it becomes.
    attempt = Attempt.current()
    if attempt is not None:
        attempt.mark_crashed()


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
