"""A refusal counts only when it ends the view: a view that catches what ``idem.refuse()``
raised (a fail-open quota helper under ``except Exception``) and goes on to charge and answer
201 keeps its rows and its stored answer, and its key is never given back.
"""

from __future__ import annotations

import typing as t

import pytest
import sqlalchemy as sa
from flask import Flask

from flask_idem import Idempotency
from flask_idem.testing import empty_store
from tests.support.fsa_app import Order, application, db, discard


@pytest.fixture
def app(db_url: str) -> t.Iterator[tuple[Flask, list[int]]]:
    app = application(db_url, "refuse-swallowed")
    idem = Idempotency(app, db=db, tenant=lambda: "alpha")
    empty_store(app.extensions["idempotency"].store)
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
