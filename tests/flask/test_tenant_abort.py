"""A tenant callable that refuses the Flask way (``abort(401)``) answers 401 before any claim;
only other exceptions are ``tenant-unresolved``.
"""

from __future__ import annotations

import typing as t

import flask
from flask import abort

from flask_idem import Idempotency
from flask_idem.store import SQLStore
from tests.support.helpers import Counter


def _tenant() -> str:
    tenant = flask.request.headers.get("X-Tenant")
    if tenant is None:
        abort(401, description="authenticate first")
    return tenant


def test_a_tenant_callable_that_aborts_401_answers_401(store: SQLStore) -> None:
    app = flask.Flask("tenant-401")
    app.config.update(PROPAGATE_EXCEPTIONS=False)
    idem = Idempotency(app, store=store, tenant=_tenant)
    counter = Counter()

    @app.post("/pay")
    @idem.idempotent
    def pay() -> t.Any:
        counter.bump()
        return {"paid": True}, 201

    client = app.test_client()
    response = client.post("/pay", headers={"Idempotency-Key": "t-401"})
    assert response.status_code == 401, response.get_data(as_text=True)
    assert counter.calls == 0
    ok = client.post("/pay", headers={"Idempotency-Key": "t-401", "X-Tenant": "alpha"})
    assert ok.status_code == 201, "nothing was claimed by the refused request"
