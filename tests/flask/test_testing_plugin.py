"""The pytest plugin's fixtures as an application uses them, not overridden (test_testing.py
overrides ``idem_database_url``): on its own SQLite file and on IDEMPOTENCY_TEST_DATABASE_URL."""

from __future__ import annotations

import typing as t

import pytest
from flask import Flask

from flask_idem import Idempotency
from flask_idem.testing import assert_ran_once
from flask_idem.testing.plugin import DATABASE_URL_VARIABLE


@pytest.fixture(autouse=True, params=["sqlite", "postgresql"])
def plugin_database(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """The plugin's default SQLite file, or the suite's PostgreSQL named by
    IDEMPOTENCY_TEST_DATABASE_URL (autouse: set before the plugin's fixture reads it)."""
    if request.param == "postgresql":
        url = request.getfixturevalue("fresh_pg_database")()
        monkeypatch.setenv(DATABASE_URL_VARIABLE, url)
    else:
        monkeypatch.delenv(DATABASE_URL_VARIABLE, raising=False)


def test_an_application_on_idem_database_url_alone_is_protected(idem_database_url: str) -> None:
    """``idem_database_url`` is a migrated database: an application configured with it alone,
    without ``idem_store``, claims and replays (it answered 503, flask_idem's table missing)."""
    app = Flask("plugin-user")
    app.config.update(TESTING=True, IDEMPOTENCY_DATABASE_URL=idem_database_url)
    idem = Idempotency(app, tenant=lambda: "alpha")

    @app.post("/orders")
    @idem.idempotent()
    def create_order() -> t.Any:
        return {"status": "created"}, 201

    try:
        responses = assert_ran_once(app.test_client(), "/orders", json={"total": 4200})
        assert responses[0].status_code == 201
    finally:
        app.extensions["idempotency"].store.engine.dispose()
