"""How a view becomes protected: the guard, and the outer guard around a whole view function.

A protected view is *guarded*: the claim runs when Flask dispatches to the view, so after every
``before_request`` hook (authentication, rate limits) and after every decorator above
``@idem.idempotent`` (authorization): nothing is replayed, and no 409 or 422 is answered, to a
caller the view would refuse. A view is protected three ways, and :func:`protection` says which
options apply to the current request (:func:`options_for`: those it claims with):

``@idem.idempotent``       the decorator wraps the view in a :func:`guard` with its options;
``protect_blueprint``      every view of the blueprint, wherever it is mounted;
``IDEMPOTENCY_PROTECT_ALL`` every view of the application;

and ``@idem.exempt`` takes a view out of the last two. Then :mod:`.flow` runs the attempt (the
claim, the view, its answer recorded or its key given up).

The outer guard. Blueprint-wide and app-wide protection have no decorator on the view, and Flask
has no hook between the ``before_request`` hooks and the view's call, so the claim cannot run
at dispatch unless something wraps the view function. :func:`outer_guard` (a ``before_request``
hook) therefore replaces the endpoint's entry in ``app.view_functions`` with a :func:`guard`
around it, on the endpoint's first request that may claim. It must stay, because:

- the view functions are not all known at ``init_app``: blueprints are registered and
  ``add_url_rule`` is called after it, and Flask offers no signal when a rule is added (only
  overriding the application's ``add_url_rule`` or ``dispatch_request``, which is the
  application's own and which another extension may override too);
- a view that holds its own ``@idem.idempotent`` deep under decorators needs the outer guard
  too: it does not claim there (:func:`find_guard` finds the inner guard, which claims after
  the decorators above it), but it sees exceptions those decorators raise, which are crashes.

The rewrite happens once per endpoint (a guard is marked with :data:`GUARD_ATTRIBUTE`, so a
wrapped view is never wrapped again), and it is harmless under concurrent requests: two threads
that both read the unwrapped view both store an equivalent guard around it, and a thread that
reads the guard returns. A view that was never protected is never touched. A guard that finds
the attempt claimed already by the outer guard around it refuses to run
(:class:`~flask_idem.core.errors.GuardNotFound`): the decorators between them would come too
late to refuse a replay.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import logging
import types
import typing as t

from flask import Blueprint, current_app, request
from flask.typing import ResponseReturnValue
from werkzeug.wrappers import Response

from ..attempt import Attempt
from ..core.errors import GuardNotFound
from ..core.idempotency_keys import InvalidKey, echo_of_invalid, read_key
from ..core.options import OPTIONS_ATTRIBUTE, ViewOptions, is_exempt
from ..core.problem import Problem
from ..state import AppState
from . import flow

P = t.ParamSpec("P")
R = t.TypeVar("R")

#: A guard's reference to itself, also found on wrappers that copied its ``__dict__``.
GUARD_ATTRIBUTE = "__idempotency_guard__"
#: How deep to look through decorators and view classes for a guard (see ``find_guard``).
_SEARCH_LIMIT = 64
#: Methods that must have no effect (RFC 9110): an unclaimed one is left as Flask leaves it.
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS", "TRACE"})

log = logging.getLogger("flask_idem")


def guard(view: t.Callable[P, R], options: ViewOptions | None = None) -> t.Callable[P, R]:
    """Wrap a view so that protected requests claim when it is called.

    With ``options`` (``@idem.idempotent``) the guard claims with them. Without, it is the
    outer guard :func:`outer_guard` (a ``before_request`` hook ``init_app`` registers) puts
    around a protected endpoint's whole view function on its first request: it claims
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


# -- the guard's decision: claim, leave the claim to an inner guard, or pass through ---------


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
    attempt = Attempt.current()
    if attempt is not None and attempt.holding:
        if declared is not None and attempt.claimed_around_view:
            # The outer guard claimed before the decorators above this guard: they would run
            # after a replay was decided. Fail like a view exception, never run the view.
            raise _guard_not_found(app_state)
        return flow.run(call, args, kwargs)  # claimed already, by an outer guard
    if declared is None and find_guard(view, request.method) is not None:
        return flow.run(call, args, kwargs)  # the view's own guard claims, after its decorators
    settings = app_state.settings
    options = protection(app_state, declared)
    claims = settings.enabled and request.method in settings.methods
    if options is None or (not claims and request.method in SAFE_METHODS):
        return t.cast(ResponseReturnValue, call(*args, **kwargs))
    if claims:
        try:
            answer = flow.claim(app_state, options, around_view=declared is None)
        except Problem as problem:
            # Returned, not raised: an application's errorhandler(Exception) or
            # errorhandler(HTTPException) must not turn a 409 or a 422 into its own 500.
            return flow.problem_response(app_state, Attempt.current(), problem)
        if answer is not None:
            return answer
    attempt = Attempt.current()
    if attempt is None or not attempt.holding:
        flow.unclaimed(app_state, options)
    return flow.run(call, args, kwargs)


# -- which options protect the current request ------------------------------------------------


def options_for(app_state: AppState, declared: ViewOptions | None = None) -> ViewOptions | None:
    """The protection the current request claims with, or None when it claims nothing
    (an unprotected view, ``IDEMPOTENCY_ENABLED`` off, a method outside
    ``IDEMPOTENCY_METHODS``).

    :param declared: the options of the ``@idem.idempotent`` guard asking, if any.
    """
    settings = app_state.settings
    if not settings.enabled or request.method not in settings.methods:
        return None
    return protection(app_state, declared)


def protection(app_state: AppState, declared: ViewOptions | None = None) -> ViewOptions | None:
    """How the current request's view is protected, or None when it is not, whether or
    not this request claims: a protected view's unclaimed requests still have their
    business transaction settled as a claimed request's would be.

    :param declared: the options of the ``@idem.idempotent`` guard asking, if any.
    """
    if request.url_rule is None:
        return None
    if declared is None:
        view = current_app.view_functions.get(request.endpoint or "")
        found = find_guard(view, request.method)
        declared = t.cast(
            "ViewOptions | None",
            getattr(found if found is not None else view, OPTIONS_ATTRIBUTE, None),
        )
    if is_exempt(declared):
        return None
    if declared is not None:
        return declared
    # By blueprint object: a blueprint registered twice (name=...) or nested
    # ("api.child") is protected wherever it is mounted.
    protected = app_state.extension.protected_blueprints
    for name in request.blueprints:
        options = protected.get(t.cast("Blueprint", current_app.blueprints.get(name)))
        if options is not None:
            return options
    return ViewOptions() if app_state.settings.protect_all else None


# -- the hooks ----------------------------------------------------------------------------------


def outer_guard() -> None:
    """``before_request``: put the outer guard around a protected endpoint's whole view
    function, once (see the module docstring for why it rewrites ``view_functions``).

    It claims for blueprint-wide and app-wide protection; around a view that holds its
    own ``@idem.idempotent`` guard under other decorators, it only watches: exceptions
    raised by those decorators are crashes too.
    """
    endpoint = request.endpoint
    view = current_app.view_functions.get(endpoint or "")
    if view is None or getattr(view, GUARD_ATTRIBUTE, None) is view:
        return
    app_state = AppState.current()
    if options_for(app_state) is not None or (
        request.method not in SAFE_METHODS and protection(app_state) is not None
    ):
        assert endpoint is not None
        current_app.view_functions[endpoint] = guard(view)  # type: ignore[assignment]


def finish(response: Response) -> Response:
    """``after_request``: the attempt's answer recorded or its key given up
    (:func:`.flow.finish`); a protected endpoint's answer that came before any attempt (an
    authentication hook, a rate limit, an authorization decorator) echoes the key."""
    attempt = Attempt.current()
    if attempt is not None:
        return flow.finish(attempt, response)
    app_state = AppState.current()
    settings = app_state.settings
    if options_for(app_state) is None:
        return response
    try:
        key = read_key(request.headers, settings.headers)
    except InvalidKey:
        key = echo_of_invalid(request.headers, settings.headers)
    return flow.echo_key(settings, response, key)
