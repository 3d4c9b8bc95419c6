"""What the adapters tell the attempt at the edges of their two steps: a refusal is the run's
own only (a nested job's ``JobRefused`` escaping a view or an outer job is that run's crash,
never a refusal that gives its key back); a store failure while a replay is built is the claim
step's (reported once, answered 503); an ``HTTPException`` that is also a store failure is the
view's answer, rendered by the application's handler.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import typing as t

import flask
import pytest
from werkzeug.exceptions import ServiceUnavailable

from flask_idem import Idempotency
from flask_idem.core import signals
from flask_idem.core.errors import JobRefused, StoreUnavailable
from flask_idem.core.record import State
from flask_idem.store import SQLStore


def test_a_nested_jobs_refusal_escaping_the_view_leaves_the_views_key_unknown(
    store: SQLStore,
) -> None:
    app = flask.Flask("nested-refusal")
    idem = Idempotency(app, store=store, tenant=lambda: "alpha")
    events: list[tuple[str, str | None]] = []

    def note(name: str) -> t.Callable[..., None]:
        return lambda sender, **extra: events.append((name, extra.get("endpoint")))

    listeners = {name: note(name) for name in ("released", "unknown")}
    for name, listener in listeners.items():
        getattr(signals, name).connect(listener, app)

    @idem.job("notify", key="order", tenant="merchant")
    def notify(merchant: str, order: str) -> None:
        idem.refuse({"later": True})

    @app.post("/orders")
    @idem.idempotent  # no release_before_contact: it may have had undeclared effects
    def create_order() -> t.Any:
        notify("alpha", "o-1")
        return {"ok": True}, 201

    response = app.test_client().post("/orders", headers={"Idempotency-Key": "nested-1"})
    assert response.status_code == 500
    assert "never a new one" in response.get_json()["detail"], response.get_json()
    record = store.get(store.keys.scope("alpha", "POST /orders", "nested-1"))
    assert record is not None and record.state is State.UNKNOWN, record
    assert ("released", "JOB notify") in events
    assert ("unknown", "POST /orders") in events and ("released", "POST /orders") not in events


def test_a_nested_jobs_refusal_escaping_a_job_leaves_the_outer_jobs_key_unknown(
    store: SQLStore,
) -> None:
    app = flask.Flask("nested-job-refusal")
    idem = Idempotency(app, store=store, tenant=lambda: "alpha")

    @idem.job("inner", key="order", tenant="merchant")
    def inner(merchant: str, order: str) -> None:
        idem.refuse({"later": True})

    @idem.job("outer", key="order", tenant="merchant")  # no release_before_contact
    def outer(merchant: str, order: str) -> None:
        inner(merchant, order)

    with app.app_context(), pytest.raises(JobRefused):
        outer("alpha", "o-2")
    assert store.get(store.keys.scope("alpha", "JOB inner", "o-2")) is None  # its own refusal
    record = store.get(store.keys.scope("alpha", "JOB outer", "o-2"))
    assert record is not None and record.state is State.UNKNOWN, record


def test_a_refusal_raised_where_no_attempt_is_current_is_the_runs_own(store: SQLStore) -> None:
    """A quota check run in a helper thread (its own app context: no attempt there) and
    re-raised by ``future.result()``, and a ``JobRefused`` a job raises itself: the run
    refused, so the key is given back (a retry runs it again)."""
    app = flask.Flask("own-refusals")
    idem = Idempotency(app, store=store, tenant=lambda: "alpha")
    pool = concurrent.futures.ThreadPoolExecutor(1)

    def check_quota() -> None:
        idem.refuse(({"error": "daily limit"}, 429))

    @app.post("/orders")
    @idem.idempotent
    def create_order() -> t.Any:
        pool.submit(flask.copy_current_request_context(check_quota)).result()
        return {"ok": True}, 201

    @idem.job("direct", key="order", tenant="merchant")
    def direct(merchant: str, order: str) -> None:
        raise JobRefused("over the quota", value={"later": True})

    try:
        response = app.test_client().post("/orders", headers={"Idempotency-Key": "thread-1"})
    finally:
        pool.shutdown()
    assert response.status_code == 429, response.get_data(as_text=True)
    assert store.get(store.keys.scope("alpha", "POST /orders", "thread-1")) is None
    with app.app_context(), pytest.raises(JobRefused):
        direct("alpha", "o-3")
    assert store.get(store.keys.scope("alpha", "JOB direct", "o-3")) is None


def test_an_earlier_refusal_raised_again_after_a_later_one_is_the_runs_own(
    store: SQLStore,
) -> None:
    app = flask.Flask("first-refusal")
    idem = Idempotency(app, store=store, tenant=lambda: "alpha")

    @idem.job("twice", key="order", tenant="merchant")
    def twice(merchant: str, order: str) -> None:
        try:
            idem.refuse({"first": True})
        except JobRefused as first:
            saved = first
        with contextlib.suppress(JobRefused):
            idem.refuse({"second": True})
        raise saved

    with app.app_context(), pytest.raises(JobRefused):
        twice("alpha", "o-4")
    assert store.get(store.keys.scope("alpha", "JOB twice", "o-4")) is None


def test_a_replay_that_meets_a_store_failure_answers_503_reported_once(store: SQLStore) -> None:
    app = flask.Flask("replay-store-failure")
    idem = Idempotency(app, store=store, tenant=lambda: "alpha")
    stages: list[str] = []

    def listener(sender: t.Any, **extra: t.Any) -> None:
        stages.append(extra["stage"])

    signals.store_unavailable.connect(listener, app)
    fail = [False]

    def replay(stored: t.Any) -> t.Any:
        if fail[0]:
            raise StoreUnavailable("the lookup behind the replay failed")
        return {"replayed": True}, stored.status

    @app.errorhandler(StoreUnavailable)
    def own_handler(error: StoreUnavailable) -> t.Any:
        return {"handled by": "the application"}, 599

    @app.post("/orders")
    @idem.idempotent(replay=replay)
    def create_order() -> t.Any:
        return {"ok": True}, 201

    client = app.test_client()
    assert client.post("/orders", headers={"Idempotency-Key": "replay-1"}).status_code == 201
    fail[0] = True
    response = client.post("/orders", headers={"Idempotency-Key": "replay-1"})
    assert response.status_code == 503, response.get_data(as_text=True)
    assert response.content_type == "application/problem+json"
    assert stages == ["claim"]


class _Down(StoreUnavailable, ServiceUnavailable):
    """An application's error that is both a store failure and an HTTP answer."""


def test_an_http_exception_that_is_a_store_failure_is_the_views_answer(store: SQLStore) -> None:
    app = flask.Flask("hybrid")
    idem = Idempotency(app, store=store, tenant=lambda: "alpha")

    @app.errorhandler(_Down)
    def own_page(error: _Down) -> t.Any:
        return {"page": "the application's own"}, 503

    @app.post("/orders")
    @idem.idempotent
    def create_order() -> t.Any:
        raise _Down()

    response = app.test_client().post("/orders", headers={"Idempotency-Key": "hybrid-1"})
    assert response.status_code == 503
    assert response.get_json() == {"page": "the application's own"}
