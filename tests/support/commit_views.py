"""A releasable view that commits its own business row and then fails, for the commit guard's
tests: whatever commits the row, its retries must answer 409 and commit nothing again."""

from __future__ import annotations

import typing as t

import sqlalchemy as sa
from flask import Flask
from werkzeug.test import TestResponse

from flask_idem import Idempotency
from flask_idem.store import SQLStore


def self_committing_app(
    name: str, store: SQLStore, ledger: sa.Table, commit: t.Callable[[sa.Connection], t.Any]
) -> Flask:
    """An app whose ``release_before_contact`` view ``POST /pay`` inserts a ``paid`` row into
    ``ledger`` through ``idem.connection()``, calls ``commit`` on that connection, then fails
    with a 503 (so the attempt would be released if the guard missed the commit).

    :param commit: how the view commits (and anything it does after), given the connection.
    """
    app = Flask(name)
    app.config.update(PROPAGATE_EXCEPTIONS=False)
    idem = Idempotency(app, store=store, tenant=lambda: "alpha")

    @app.post("/pay")
    @idem.idempotent(release_before_contact=True)
    def pay() -> t.Any:
        conn = idem.connection()
        conn.execute(ledger.insert().values(note="paid"))
        commit(conn)
        return {"error": "provider unavailable"}, 503

    return app


def three_tries(app: Flask, key: str) -> list[TestResponse]:
    """``POST /pay`` three times with the same key: the first try and two retries."""
    client = app.test_client()
    return [client.post("/pay", headers={"Idempotency-Key": key}) for _ in range(3)]
