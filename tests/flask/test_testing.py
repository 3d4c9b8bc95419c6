"""The testing kit: IDEMPOTENCY_ENABLED, the idem_store fixture, run counting, the contract."""

from __future__ import annotations

import typing as t

import pytest
import sqlalchemy as sa
from flask import Flask

from flask_idem import Idempotency, Scope
from flask_idem.store import SQLiteStore, SQLStore
from flask_idem.testing import assert_ran_once, count_runs
from flask_idem.testing.contract import StoreContract
from tests.support.helpers import Counter

AppFactory = t.Callable[..., tuple[Flask, Idempotency, Counter]]


def _unprotected_app() -> tuple[Flask, Idempotency, Counter, list[str]]:
    app = Flask("unit-tests")
    app.config.update(TESTING=True, IDEMPOTENCY_ENABLED=False)  # and no database at all
    idem = Idempotency(app, tenant=lambda: "alpha")
    counter = Counter()
    keys: list[str] = []

    @app.post("/charges")
    @idem.idempotent(release_before_contact=True)
    def charge() -> t.Any:
        keys.append(idem.downstream_key("charge"))
        assert idem.downstream_key("charge") == keys[-1], "one key per step and request"
        idem.connection().execute(sa.text("SELECT 1"))
        return {"n": counter.bump()}, 201

    @idem.job("renew", key="order", tenant="merchant")
    def renew(merchant: str, order: str) -> int:
        idem.downstream_key("charge")
        return counter.bump()

    app.view_functions["renew"] = renew  # reachable from the test
    return app, idem, counter, keys


def test_disabled_extension_runs_views_and_jobs_unprotected() -> None:
    app, _, counter, keys = _unprotected_app()
    client = app.test_client()
    headers = {"Idempotency-Key": "same"}
    first = client.post("/charges", headers=headers)
    second = client.post("/charges", headers=headers)
    assert (first.status_code, second.status_code) == (201, 201)
    assert counter.calls == 2, "no claim: every request runs"
    assert "Idempotent-Replayed" not in second.headers
    assert len(set(keys)) == 2, "a fresh downstream key per request"
    assert client.post("/charges").status_code == 201, "no key needed either"
    renew = app.view_functions["renew"]
    with app.app_context():
        assert renew("m", "o-1") == 4
        assert renew("m", "o-1") == 5
    app.extensions["idempotency"].store.engine.dispose()


def test_disabled_flag_is_validated() -> None:
    from flask_idem import ConfigurationError

    app = Flask("bad")
    app.config.update(IDEMPOTENCY_ENABLED="perhaps", IDEMPOTENCY_DATABASE_URL="sqlite://")
    with pytest.raises(ConfigurationError, match="IDEMPOTENCY_ENABLED"):
        Idempotency(app)


@pytest.fixture(params=["sqlite", "postgresql"])
def idem_database_url(request: pytest.FixtureRequest, tmp_path: t.Any) -> str:
    """The plugin's fixture, overridden as an application would: its own PostgreSQL too."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/kit.sqlite3"
    return str(request.getfixturevalue("fresh_pg_database")())


def _orders_app(store: SQLStore, **config: t.Any) -> tuple[Flask, Counter]:
    """An app protecting ``POST /orders`` on ``store``, and the counter of its view's runs."""
    app = Flask("kit")
    app.config.update(config)
    idem = Idempotency(app, store=store, tenant=lambda: "alpha")
    counter = Counter()

    @app.post("/orders")
    @idem.idempotent
    def create_order() -> t.Any:
        return {"order": counter.bump()}, 201

    return app, counter


def test_idem_store_fixture_is_migrated_and_empty(idem_store: SQLStore) -> None:
    scope = Scope("t", "POST /x", "k")
    assert idem_store.get(scope) is None
    assert idem_store.claim(scope, b"\0" * 32, ttl=60, lease=30).claimed

    app, counter = _orders_app(idem_store)
    responses = assert_ran_once(app.test_client(), "/orders", json={"total": 5}, times=4)
    assert [r.status_code for r in responses] == [201] * 4
    assert counter.calls == 1


def test_assert_ran_once_sends_the_apps_header(idem_store: SQLStore) -> None:
    """Without ``header=``, the key goes in the app's ``IDEMPOTENCY_HEADER``: in the default
    header an app configured otherwise would answer 400 key-missing."""
    app, counter = _orders_app(
        idem_store, IDEMPOTENCY_HEADER="X-Request-Key", IDEMPOTENCY_HEADER_ALIASES=()
    )
    responses = assert_ran_once(app.test_client(), "/orders", json={"total": 5})
    assert [r.status_code for r in responses] == [201] * 3
    assert counter.calls == 1


def test_assert_ran_once_fails_when_the_view_runs_again(app_factory: AppFactory) -> None:
    app, _, counter = app_factory()
    client = app.test_client()
    assert_ran_once(client, "/payments", json={"amount": 1})
    # GET is not protected: no request claims, and the helper says so.
    with pytest.raises(AssertionError, match="ran protected 0 times"):
        assert_ran_once(client, "/payments", method="GET", times=2)
    assert counter.calls == 3


def test_count_runs_sees_takeovers_not_replays(app_factory: AppFactory) -> None:
    app, _, _ = app_factory()
    client = app.test_client()
    with count_runs(app) as runs:
        for _ in range(3):
            client.post("/payments", json={"amount": 1}, headers={"Idempotency-Key": "k"})
        client.post("/payments", json={"amount": 2}, headers={"Idempotency-Key": "k"})  # 422
    assert runs.endpoints == ["POST /payments"]


class _ForgetfulStore(SQLiteStore):
    """A broken store: releasing with a wrong token frees the key anyway."""

    def release(self, scope: Scope, token: str, **kwargs: t.Any) -> bool:
        record = self.get(scope)
        return super().release(scope, record.claim_token if record else token, **kwargs)


def test_the_contract_catches_a_broken_store(sqlite_url: str, scope: Scope) -> None:
    broken = _ForgetfulStore(sa.create_engine(sqlite_url))
    try:
        with pytest.raises(AssertionError, match="a wrong token releases nothing"):
            StoreContract().test_release_frees_the_key(broken, scope)
    finally:
        broken.engine.dispose()
