"""A protected view's unclaimed request rolls back a never-stored answer's writes also when
a before_request hook opened the business transaction first (``idem.connection()``).
"""

from __future__ import annotations

import typing as t

import flask
import pytest
import sqlalchemy as sa

from flask_idem import Idempotency
from flask_idem.store import SQLStore
from tests.support.helpers import with_tables

ledger = sa.Table(
    "early_connection_ledger",
    sa.MetaData(),
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("note", sa.String(64)),
)
UNCLAIMED = {
    "switched off": ({"IDEMPOTENCY_ENABLED": False}, "POST"),
    "optional key left out": ({"IDEMPOTENCY_KEY_REQUIRED": False}, "POST"),
    "method outside IDEMPOTENCY_METHODS": ({}, "PUT"),
}


@pytest.fixture
def tables(store: SQLStore) -> t.Iterator[SQLStore]:
    with with_tables(store, ledger):
        yield store


@pytest.mark.parametrize("how", UNCLAIMED)
def test_a_never_stored_answer_rolls_back_after_an_early_connection(
    tables: SQLStore, how: str
) -> None:
    store = tables
    config, method = UNCLAIMED[how]
    app = flask.Flask("early")
    app.config.update(PROPAGATE_EXCEPTIONS=False, **config)
    idem = Idempotency(app, store=store, tenant=lambda: "alpha")

    @app.before_request
    def authenticate() -> None:
        # e.g. look the API key up in the application's database
        idem.connection().execute(sa.text("SELECT 1"))

    @app.route("/pay", methods=["POST", "PUT"])
    @idem.idempotent
    def pay() -> t.Any:
        idem.connection().execute(ledger.insert().values(note="half a payment"))
        return {"error": "provider unavailable"}, 503

    assert app.test_client().open("/pay", method=method).status_code == 503
    with store.engine.connect() as conn:
        notes = list(conn.scalars(sa.select(ledger.c.note)))
    assert notes == [], "a never-stored answer's writes were committed"
