"""A refusal counts only when it ends the view: a view that catches what ``idem.refuse()``
raised (a fail-open quota helper under ``except Exception``) and goes on to charge and answer
201 keeps its rows and its stored answer, and its key is never given back.
"""

from __future__ import annotations

import functools
import typing as t

import flask
import pytest
import sqlalchemy as sa
from flask import Flask

from flask_idem import Idempotency
from flask_idem.store import create_store
from flask_idem.testing import empty_store
from tests.support.fsa_app import Order, db, discard, protected


@pytest.fixture
def app(db_url: str) -> t.Iterator[tuple[Flask, list[int]]]:
    app, idem = protected(db_url, "refuse-swallowed")
    provider: list[int] = []

    def check_quota() -> None:
        idem.refuse(({"error": "daily limit"}, 429))

    @app.post("/charges")
    @idem.idempotent
    def charge() -> t.Any:
        try:
            check_quota()
        except Exception:
            pass  # the quota service is best effort: fail open
        provider.append(1)  # the provider charges the card
        db.session.add(Order())
        return {"charged": True}, 201

    with app.app_context():
        db.create_all()
    yield app, provider
    discard(app)


def test_a_caught_refusal_does_not_give_up_the_answer_that_followed(
    app: tuple[Flask, list[int]],
) -> None:
    flask_app, provider = app
    client = flask_app.test_client()
    first = client.post("/charges", headers={"Idempotency-Key": "swallowed-1"})
    assert first.status_code == 201
    retry = client.post("/charges", headers={"Idempotency-Key": "swallowed-1"})
    with flask_app.app_context():
        rows = db.session.scalar(sa.select(sa.func.count()).select_from(Order))
        db.session.remove()
    assert len(provider) == 1, f"charged {len(provider)} times under one key"
    assert retry.headers.get("Idempotent-Replayed") == "true"
    assert rows == 1, "the 201's row was rolled back"


def _raise_its_own(provider: list[int]) -> t.Any:
    provider.append(1)
    raise RuntimeError("the notifier failed")


def _abort(provider: list[int]) -> t.Any:
    provider.append(1)
    flask.abort(403)


def _answer_anyway(provider: list[int]) -> t.Any:
    provider.append(1)
    return {"queued": True}, 202


@pytest.mark.parametrize("went_on", [_raise_its_own, _abort, _answer_anyway])
def test_a_refusal_caught_above_the_guard_keeps_the_key(
    sqlite_url: str, went_on: t.Callable[[list[int]], t.Any]
) -> None:
    """A decorator above ``@idem.idempotent`` that catches the refusal, calls the outside
    world and then raises, aborts or answers on its own: the refusal did not end the request,
    so the key of a view without ``release_before_contact`` is never given back (a retry gets
    409 or the stored answer, and the outside call is never made twice)."""
    store = create_store(sqlite_url)
    empty_store(store)
    app = Flask("refusal-caught-above")
    idem = Idempotency(app, store=store, tenant=lambda: "alpha")
    provider: list[int] = []

    def notify_on_refusal(view: t.Callable[..., t.Any]) -> t.Callable[..., t.Any]:
        @functools.wraps(view)
        def wrapper(*args: t.Any, **kwargs: t.Any) -> t.Any:
            try:
                return view(*args, **kwargs)
            except Exception:
                return went_on(provider)

        return wrapper

    @app.post("/charges")
    @notify_on_refusal
    @idem.idempotent
    def charge() -> t.Any:
        idem.refuse(({"error": "daily limit"}, 429))

    client = app.test_client()
    client.post("/charges", headers={"Idempotency-Key": "caught-above"})
    retry = client.post("/charges", headers={"Idempotency-Key": "caught-above"})
    store.engine.dispose()
    assert len(provider) == 1, f"outside call made {len(provider)} times under one key"
    assert retry.status_code in (409, 202), retry.status_code
