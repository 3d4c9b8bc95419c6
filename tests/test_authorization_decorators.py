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
from flask.views import MethodView

from flask_idem import Idempotency
from flask_idem.store import SQLStore

from .conftest import Counter

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
    app, calls = _app(store, DECORATORS[form], path)
    client = app.test_client()

    def post(amount: int, permissions: str = "write") -> t.Any:
        headers = {"Idempotency-Key": "k", "X-Permissions": permissions}
        return client.post(path, json={"amount": amount}, headers=headers)

    written = post(100)
    assert written.status_code == 201
    for amount in (100, 1):  # the writer's body (a replay), another body (a 422)
        refused = post(amount, permissions="read")
        assert refused.status_code == 403, refused.get_data(as_text=True)
        assert "Idempotent-Replayed" not in refused.headers
    replayed = post(100)
    assert replayed.headers["Idempotent-Replayed"] == "true", "the view's own guard claimed"
    assert replayed.get_data() == written.get_data()
    assert calls.calls == 1
