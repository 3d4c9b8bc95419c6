"""The per-tenant limit on new keys (``IDEMPOTENCY_KEY_RATE_LIMIT``, ``key_rate_limit=``): only
claims that create a record count; over the limit a new key is refused with 429 before any
claim (the view does not run, nothing is recorded), while a retry of a known key is still
replayed, answered 409 or 422; every tenant has its own counter."""

from __future__ import annotations

import concurrent.futures
import json
import sys
import typing as t

import flask
import pytest
from flask_limiter import Limiter
from flask_limiter.util import get_remote_address
from prometheus_client import CollectorRegistry

from flask_idem import ConfigurationError, Idempotency, Scope, State, signals
from flask_idem.core.fingerprint import fingerprint
from flask_idem.ops.metrics import Metrics
from flask_idem.store import SQLStore
from tests.support.answers import PAYMENT, assert_problem, post
from tests.support.helpers import Counter

Factory = t.Callable[..., tuple[flask.Flask, Idempotency, Counter]]


def _scope(key: str, tenant: str = "alpha", path: str = "/payments") -> Scope:
    return Scope(tenant, f"POST {path}", key)


def _hold(store: SQLStore, key: str) -> str:
    """Claim ``key`` for the payments view's usual request, as another process's request in
    flight would: the claim token."""
    digest = fingerprint(
        "POST",
        "/payments",
        {},
        (),
        json.dumps(PAYMENT).encode(),
        "application/json",
        exclude=("client_ts",),
    )
    claim = store.claim(_scope(key), digest, ttl=60, lease=60)
    assert claim.claimed and claim.token is not None
    return claim.token


def _refused(response: t.Any, window: int = 60) -> None:
    """A 429 ``idempotency-key-rate-limited`` with a ``Retry-After`` within the window."""
    assert_problem(response, 429, "idempotency-key-rate-limited")
    assert 1 <= int(response.headers["Retry-After"]) <= window
    assert "Idempotent-Replayed" not in response.headers


def test_new_keys_over_the_limit_are_refused_per_tenant(
    app_factory: Factory, store: SQLStore
) -> None:
    app, _, counter = app_factory(IDEMPOTENCY_KEY_RATE_LIMIT="2/minute")
    client = app.test_client()
    for key in ("a-1", "a-2"):
        assert post(client, key, tenant="alpha").status_code == 201
    refused = post(client, "a-3", tenant="alpha")
    _refused(refused)
    assert refused.headers["Idempotency-Key"] == "a-3", "the key is echoed"
    assert counter.calls == 2, "the view did not run"
    assert store.get(_scope("a-3")) is None, "nothing was recorded for the refused key"
    # Another tenant's counter is its own: alpha's traffic does not limit beta.
    for key in ("b-1", "b-2"):
        assert post(client, key, tenant="beta").status_code == 201
    _refused(post(client, "b-3", tenant="beta"))
    assert counter.calls == 4


def test_replays_and_refusals_of_known_keys_are_neither_counted_nor_refused(
    app_factory: Factory, store: SQLStore
) -> None:
    app, _, counter = app_factory(IDEMPOTENCY_KEY_RATE_LIMIT="2/minute")
    client = app.test_client()
    assert post(client, "k-1").status_code == 201
    for _ in range(5):
        assert post(client, "k-1").headers["Idempotent-Replayed"] == "true"
    assert_problem(post(client, "k-1", body={"amount": 1}), 422, "idempotency-key-reused")
    # A request of another process still holds this key: 409, not counted.
    _hold(store, "held")
    assert_problem(post(client, "held"), 409, "request-in-progress")
    # Only k-1 counted so far: one more new key fits.
    assert post(client, "k-2").status_code == 201
    _refused(post(client, "k-3"))
    # Over the limit, known keys still answer from their records.
    assert post(client, "k-1").headers["Idempotent-Replayed"] == "true"
    assert post(client, "k-2").headers["Idempotent-Replayed"] == "true"
    assert_problem(post(client, "k-2", body={"amount": 1}), 422, "idempotency-key-reused")
    assert_problem(post(client, "held"), 409, "request-in-progress")
    assert counter.calls == 2


def test_a_refused_key_runs_once_the_window_frees_a_slot(app_factory: Factory) -> None:
    """The refused request left nothing behind: its retry is a first request. Flask-Limiter's
    storage holds the counters when the app has a Flask-Limiter (reset here, as a new window
    would)."""
    app, _, counter = app_factory(IDEMPOTENCY_KEY_RATE_LIMIT="1/hour")
    limiter = Limiter(get_remote_address, app=app, storage_uri="memory://")
    client = app.test_client()
    assert post(client, "k-1").status_code == 201
    _refused(post(client, "k-2"), window=3600)
    limiter.reset()
    again = post(client, "k-2")
    assert again.status_code == 201 and "Idempotent-Replayed" not in again.headers
    assert counter.calls == 2
    _refused(post(client, "k-3"), window=3600)


def test_a_views_own_limit_is_counted_for_it_alone(app_factory: Factory) -> None:
    app, idem, counter = app_factory(IDEMPOTENCY_KEY_RATE_LIMIT="1/minute")

    @app.post("/refunds")
    @idem.idempotent(key_rate_limit="3/minute")
    def refund() -> t.Any:
        counter.bump()
        return {"refunded": True}, 201

    @app.post("/notes")
    @idem.idempotent(key_rate_limit=False)
    def note() -> t.Any:
        counter.bump()
        return {"noted": True}, 201

    client = app.test_client()
    assert post(client, "p-1").status_code == 201
    _refused(post(client, "p-2"))
    for key in ("r-1", "r-2", "r-3"):
        assert post(client, key, path="/refunds").status_code == 201
    _refused(post(client, "r-4", path="/refunds"))
    for n in range(5):
        assert post(client, f"n-{n}", path="/notes").status_code == 201
    assert counter.calls == 1 + 3 + 5


def test_a_protected_blueprints_limit_counts_each_of_its_views(app_factory: Factory) -> None:
    """No application-wide limit: only the blueprint's views are limited, each for itself."""
    app, idem, counter = app_factory()
    blueprint = flask.Blueprint("refunds", __name__)

    @blueprint.post("/refunds")
    def refund() -> t.Any:
        counter.bump()
        return {"refunded": True}, 201

    @blueprint.post("/disputes")
    def dispute() -> t.Any:
        counter.bump()
        return {"disputed": True}, 201

    idem.protect_blueprint(blueprint, key_rate_limit="1/minute")
    app.register_blueprint(blueprint)
    client = app.test_client()
    for path in ("/refunds", "/disputes"):
        assert post(client, f"{path}-1", path=path).status_code == 201
        _refused(post(client, f"{path}-2", path=path))
    for n in range(3):
        assert post(client, f"p-{n}").status_code == 201, "the app's views are not limited"
    assert counter.calls == 2 + 3


def test_atomic_views_count_their_new_keys(app_factory: Factory, store: SQLStore) -> None:
    app, idem, counter = app_factory(IDEMPOTENCY_KEY_RATE_LIMIT="1/minute")

    @app.post("/transfers")
    @idem.idempotent(atomic=True)
    def transfer() -> t.Any:
        counter.bump()
        return {"moved": True}, 201

    client = app.test_client()
    assert post(client, "t-1", path="/transfers").status_code == 201
    assert post(client, "t-1", path="/transfers").headers["Idempotent-Replayed"] == "true"
    _refused(post(client, "t-2", path="/transfers"))
    assert counter.calls == 1
    assert store.get(_scope("t-2", path="/transfers")) is None


def test_concurrent_new_keys_answer_201_or_429_never_500(app_factory: Factory) -> None:
    """The test before the claim and the count after it are not one step: concurrent claims
    may pass the limit by the requests in flight, never fail."""
    app, _, counter = app_factory(IDEMPOTENCY_KEY_RATE_LIMIT="10/minute")

    def send(n: int) -> int:
        return int(post(app, f"c-{n}").status_code)

    with concurrent.futures.ThreadPoolExecutor(max_workers=6) as pool:
        statuses = list(pool.map(send, range(30)))
    assert set(statuses) <= {201, 429}, statuses
    created = statuses.count(201)
    assert 10 <= created <= 10 + 6, statuses
    assert counter.calls == created


def test_a_failing_limiter_storage_fails_closed_with_503(app_factory: Factory) -> None:
    """Flask-Limiter on a Redis nobody listens on: 503 before any claim, never a 500, and
    the view does not run."""
    app, _, counter = app_factory(IDEMPOTENCY_KEY_RATE_LIMIT="5/minute")
    Limiter(get_remote_address, app=app, storage_uri="redis://127.0.0.1:9/0")
    response = post(app, "k-1")
    assert_problem(response, 503, "store-unavailable")
    assert "Retry-After" in response.headers
    assert counter.calls == 0


@pytest.mark.parametrize("value", ["lots", "100 per fortnight", 100])
def test_a_malformed_limit_fails_at_init_app(store: SQLStore, value: t.Any) -> None:
    app = flask.Flask("bad-limit")
    app.config["IDEMPOTENCY_KEY_RATE_LIMIT"] = value
    with pytest.raises(ConfigurationError, match="IDEMPOTENCY_KEY_RATE_LIMIT"):
        Idempotency(app, store=store)


def test_a_malformed_view_limit_fails_when_the_view_is_declared(store: SQLStore) -> None:
    idem = Idempotency(store=store)
    with pytest.raises(ConfigurationError, match="key_rate_limit"):
        idem.idempotent(key_rate_limit="often")


def test_without_the_limits_package_a_configured_limit_fails_at_init_app(
    store: SQLStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Neither Flask-Limiter nor limits installed (``import limits`` fails): init_app says
    which extra to install; without the key set nothing needs the package."""
    monkeypatch.setitem(sys.modules, "limits", None)
    app = flask.Flask("no-limits")
    app.config["IDEMPOTENCY_KEY_RATE_LIMIT"] = "100/minute"
    with pytest.raises(ConfigurationError, match=r"flask-idem\[ratelimit\]"):
        Idempotency(app, store=store)
    Idempotency(flask.Flask("no-limit-set"), store=store)


def test_unknown_records_of_a_tenant_over_the_limit_still_answer_outcome_pending(
    app_factory: Factory, store: SQLStore
) -> None:
    """A key whose first attempt may have charged is never refused as a new key: the retry
    learns the outcome is pending, never that it may start over."""
    app, _, _ = app_factory(IDEMPOTENCY_KEY_RATE_LIMIT="1/minute")
    client = app.test_client()
    assert post(client, "k-1").status_code == 201
    store.mark_unknown(_scope("lost"), _hold(store, "lost"))
    assert t.cast(t.Any, store.get(_scope("lost"))).state is State.UNKNOWN
    assert_problem(post(client, "lost"), 409, "outcome-pending")


def test_a_refusal_is_one_rate_limited_event_and_metric_without_the_key(
    store: SQLStore,
) -> None:
    registry = CollectorRegistry()
    app = flask.Flask("limit-metrics")
    app.config.update(IDEMPOTENCY_KEY_RATE_LIMIT="1/minute", PROPAGATE_EXCEPTIONS=False)
    idem = Idempotency(app, store=store, tenant=lambda: "alpha", metrics=Metrics(registry))

    @app.post("/payments")
    @idem.idempotent
    def pay() -> t.Any:
        return {"ok": True}, 201

    seen: list[dict[str, t.Any]] = []

    def receive(sender: flask.Flask, **event: t.Any) -> None:
        seen.append(event)

    signals.rate_limited.connect(receive)
    try:
        client = app.test_client()
        assert post(client, "first-key").status_code == 201
        _refused(post(client, "second-secret-key"))
        assert post(client, "first-key").headers["Idempotent-Replayed"] == "true"
    finally:
        signals.rate_limited.disconnect(receive)
    assert len(seen) == 1
    assert (seen[0]["event"], seen[0]["status"], seen[0]["tenant"]) == (
        "rate_limited",
        429,
        "alpha",
    )
    assert "second-secret-key" not in repr(seen), "never the raw key"
    counted = registry.get_sample_value(
        "idempotency_requests_total",
        {"endpoint": "POST /payments", "outcome": "rate_limited", "status": "429"},
    )
    assert counted == 1
