"""flask_idem's replacement answers (409 after a lost lease, 503 when the store fails) pass
through the application's after_request hooks registered before it (CORS headers, request
ids), as the view's own answer would.
"""

from __future__ import annotations

import typing as t

import flask
import sqlalchemy as sa

from flask_idem import Idempotency
from flask_idem.core.key_digest import unkeyed
from flask_idem.store import SQLStore
from flask_idem.store.table import idempotency_keys


def test_a_lost_lease_answer_carries_the_cors_header(store: SQLStore) -> None:
    app = flask.Flask("cors")
    app.config.update(PROPAGATE_EXCEPTIONS=False)
    seen: list[int] = []

    @app.after_request
    def cors(response: flask.Response) -> flask.Response:
        seen.append(response.status_code)
        response.headers["Access-Control-Allow-Origin"] = "https://shop.example"
        return response

    idem = Idempotency(app, store=store, tenant=lambda: "alpha")

    @app.post("/pay")
    @idem.idempotent
    def pay() -> t.Any:
        # A retry took the record over meanwhile (its lease ran out): the claim token changes.
        with store.engine.begin() as conn:
            conn.execute(
                sa.update(idempotency_keys)
                .where(idempotency_keys.c.key == unkeyed("alpha", "lost-1"))
                .values(claim_token="taken-by-a-retry")
            )
        return {"paid": True}, 201

    response = app.test_client().post(
        "/pay", headers={"Idempotency-Key": "lost-1", "Origin": "https://shop.example"}
    )
    assert response.status_code == 409
    assert seen == [409], f"the application's hook saw {seen}, the client got 409"
    assert response.headers.get("Access-Control-Allow-Origin") == "https://shop.example"
