"""Authorization decorators above ``@idem.idempotent`` on a protected blueprint, in every form
a decorator takes: the blueprint's outer guard must find the view's own guard beneath the
decorator and leave the claim to it, so the authorization runs first. Missed, the outer guard
claims before the decorator: a read-only caller gets the writer's stored 201 replayed, or a
422 for another body. On both databases."""

from __future__ import annotations

import functools
import typing as t

import flask
import pytest
import sqlalchemy as sa
from flask.views import MethodView

from flask_idem import Idempotency
from flask_idem.store import SQLStore
from tests.support.answers import post
from tests.support.helpers import Counter

View = t.Callable[..., t.Any]


def _check() -> None:
    if flask.request.headers.get("X-Permissions") == "read":
        flask.abort(403)


def with_wraps(view: View) -> View:
    @functools.wraps(view)
    def checked(*args: t.Any, **kwargs: t.Any) -> t.Any:
        _check()
        return view(*args, **kwargs)

    return checked


def closure(view: View) -> View:
    def checked(*args: t.Any, **kwargs: t.Any) -> t.Any:  # no functools.wraps
        _check()
        return view(*args, **kwargs)

    return checked


class CallableObject:
    """A decorator whose wrapper is an object holding the view in an attribute."""

    def __init__(self, view: View) -> None:
        self.view = view
        self.__name__ = view.__name__

    def __call__(self, *args: t.Any, **kwargs: t.Any) -> t.Any:
        _check()
        return self.view(*args, **kwargs)


def _checked_call(view: View, *args: t.Any, **kwargs: t.Any) -> t.Any:
    _check()
    return view(*args, **kwargs)


def partial(view: View) -> View:
    return functools.partial(_checked_call, view)


def partial_keyword(view: View) -> View:
    def call(*args: t.Any, target: View, **kwargs: t.Any) -> t.Any:
        _check()
        return target(*args, **kwargs)

    return functools.partial(call, target=view)


class Checker:
    """A decorator whose wrapper is a bound method of an object holding the view."""

    def __init__(self, view: View) -> None:
        self.view = view

    def run(self, *args: t.Any, **kwargs: t.Any) -> t.Any:
        _check()
        return self.view(*args, **kwargs)


def bound_method(view: View) -> View:
    return Checker(view).run


DECORATORS = {
    "wraps": with_wraps,
    "closure": closure,
    "callable-object": CallableObject,
    "partial": partial,
    "partial-keyword": partial_keyword,
    "bound-method": bound_method,
}


def _app(store: SQLStore, decorator: View, path: str) -> tuple[flask.Flask, Counter]:
    """A protected blueprint whose view at ``path`` (a function, or a MethodView's ``post``)
    has its own guard under ``decorator``."""
    app = flask.Flask("authorized")
    idem = Idempotency(store=store, tenant=lambda: "alpha")
    blueprint = flask.Blueprint("orders", __name__)
    calls = Counter()

    @idem.idempotent
    def create_order() -> t.Any:
        calls.bump()
        return {"order": calls.calls}, 201

    class Orders(MethodView):
        decorators = [decorator]

        @idem.idempotent
        def post(self) -> t.Any:
            calls.bump()
            return {"order": calls.calls}, 201

    if path == "/orders":
        view = decorator(create_order)
        blueprint.add_url_rule(path, endpoint="create_order", view_func=view, methods=["POST"])
    else:
        blueprint.add_url_rule(path, view_func=Orders.as_view("method_view"))
    idem.protect_blueprint(blueprint)
    idem.init_app(app)
    app.register_blueprint(blueprint)
    return app, calls


@pytest.mark.parametrize(
    ("form", "path"),
    [
        (form, path)
        for form in DECORATORS
        for path in ("/orders", "/method-view")
        # MethodView sets view_class on what its decorators return: a bound method cannot.
        if (form, path) != ("bound-method", "/method-view")
    ],
)
def test_a_read_only_caller_never_sees_the_writers_answer(
    store: SQLStore, form: str, path: str
) -> None:
    _readers_are_refused(store, DECORATORS[form], path)


def _readers_are_refused(store: SQLStore, decorator: View, path: str) -> None:
    app, calls = _app(store, decorator, path)
    client = app.test_client()

    def send(amount: int, permissions: str = "write") -> t.Any:
        return post(client, "k", {"amount": amount}, path=path, **{"X-Permissions": permissions})

    written = send(100)
    assert written.status_code == 201
    for amount in (100, 1):  # the writer's body (a replay), another body (a 422)
        refused = send(amount, permissions="read")
        assert refused.status_code == 403, refused.get_data(as_text=True)
        assert "Idempotent-Replayed" not in refused.headers
    replayed = send(100)
    assert replayed.headers["Idempotent-Replayed"] == "true", "the view's own guard claimed"
    assert replayed.get_data() == written.get_data()
    assert calls.calls == 1


class Slotted:
    """A decorator whose wrapper is an object with ``__slots__`` (it has no ``__dict__``)."""

    __slots__ = ("view", "__name__")

    def __init__(self, view: View) -> None:
        self.view = view
        self.__name__ = view.__name__

    def __call__(self, *args: t.Any, **kwargs: t.Any) -> t.Any:
        _check()
        return self.view(*args, **kwargs)


def closure_holding_a_list(view: View) -> View:
    box = [view]

    def checked(*args: t.Any, **kwargs: t.Any) -> t.Any:
        _check()
        return box[0](*args, **kwargs)

    return checked


class HoldsADict:
    """A decorator whose wrapper object holds the view in a dict attribute."""

    def __init__(self, view: View) -> None:
        self.views = {"view": view}
        self.__name__ = view.__name__

    def __call__(self, *args: t.Any, **kwargs: t.Any) -> t.Any:
        _check()
        return self.views["view"](*args, **kwargs)


class HoldsAList:
    """A decorator whose wrapper object holds the view in a list attribute."""

    def __init__(self, view: View) -> None:
        self.views = [view]
        self.__name__ = view.__name__

    def __call__(self, *args: t.Any, **kwargs: t.Any) -> t.Any:
        _check()
        return self.views[0](*args, **kwargs)


def default_argument(view: View) -> View:
    def checked(*args: t.Any, _view: View = view, **kwargs: t.Any) -> t.Any:
        _check()
        return _view(*args, **kwargs)

    return checked


def keyword_default(view: View) -> View:
    def checked(*args: t.Any, _view: View = view, **kwargs: t.Any) -> t.Any:
        _check()
        return _view(*args, **kwargs)

    checked.__defaults__ = None
    checked.__kwdefaults__ = {"_view": view}
    return checked


REGISTRY: dict[str, View] = {}


def registry(view: View) -> View:
    """A decorator that finds the view again by name in a module-level registry: nothing the
    wrapper holds leads to it, so no search can find the guard."""
    REGISTRY[view.__name__] = view

    def checked(*args: t.Any, **kwargs: t.Any) -> t.Any:
        _check()
        return REGISTRY[checked.__name__](*args, **kwargs)

    checked.__name__ = view.__name__
    return checked


HOLDERS = {
    "slots": Slotted,
    "closure-list": closure_holding_a_list,
    "object-dict": HoldsADict,
    "object-list": HoldsAList,
    "default-argument": default_argument,
    "keyword-default": keyword_default,
}


@pytest.mark.parametrize("form", HOLDERS)
def test_a_guard_held_in_slots_containers_or_defaults_is_found(store: SQLStore, form: str) -> None:
    _readers_are_refused(store, HOLDERS[form], "/orders")


def test_a_guard_the_search_cannot_find_refuses_to_run_under_the_outer_claim(
    store: SQLStore, caplog: pytest.LogCaptureFixture
) -> None:
    """The outer guard claimed before the authorization decorator ran: the view's own guard
    refuses (500), so no record completes and no reader ever gets a replay."""
    app, calls = _app(store, registry, "/orders")
    client = app.test_client()

    def send(amount: int, key: str, permissions: str = "write") -> t.Any:
        return post(
            client, key, {"amount": amount}, path="/orders", **{"X-Permissions": permissions}
        )

    with caplog.at_level("ERROR", logger="flask_idem"):
        refused = [send(100, "k1"), send(100, "k2")]
        retries = [send(100, "k1"), send(100, "k1", "read"), send(1, "k1", "read")]
    for answer in refused:
        assert answer.status_code == 500, answer.get_data(as_text=True)
        assert answer.mimetype == "application/problem+json"
        assert answer.json["type"].endswith("/internal-error")
    for answer in retries:  # the failed attempt's key, given up by the usual rules
        assert answer.status_code in (409, 422, 500), answer.get_data(as_text=True)
        assert "Idempotent-Replayed" not in answer.headers
    assert calls.calls == 0
    with store.engine.connect() as conn:
        states = conn.execute(sa.text("SELECT state FROM idempotency_keys")).scalars().all()
    assert "completed" not in states
    errors = [r for r in caplog.records if "functools.wraps" in r.getMessage()]
    assert len(errors) == 1, "logged once per endpoint"
    assert "before_request" in errors[0].getMessage()
