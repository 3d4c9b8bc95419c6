"""The application's own after_request hooks, registered before flask_idem (as extensions
usually are), run after the answer is recorded: they see it settled and cannot undo it.

A hook that raises after the view answered (a metrics push timing out) does not throw away a
charge that happened: the row and the stored answer are committed, the client's retry replays.
A hook that commits ``db.session`` finds nothing left to commit; a hook that compresses the body
compresses the replay as it did the first answer, from the uncompressed snapshot.
"""

from __future__ import annotations

import gzip
import typing as t

import flask
import pytest
import sqlalchemy as sa

from flask_idem import Idempotency
from flask_idem.store import SQLStore
from tests.support.fsa_app import Order, application, db, discard

ledger = sa.Table(
    "hook_ledger",
    sa.MetaData(),
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("charge", sa.String(64)),
)


def test_a_hook_raising_after_the_charge_keeps_the_payment_and_its_replay(
    store: SQLStore,
) -> None:
    ledger.metadata.create_all(store.engine)
    try:
        app = flask.Flask("flaky-hook")
        app.config.update(PROPAGATE_EXCEPTIONS=False)
        charges: list[str] = []
        flaky = {"fail": True}

        @app.after_request
        def push_metrics(response: flask.Response) -> flask.Response:
            if flaky["fail"]:
                flaky["fail"] = False
                raise ConnectionError("metrics gateway timed out")
            return response

        idem = Idempotency(app, store=store, tenant=lambda: "alpha")

        @app.post("/payments")
        @idem.idempotent
        def pay() -> t.Any:
            key = idem.downstream_key("charge")
            charges.append(key)  # the provider charged
            idem.connection().execute(ledger.insert().values(charge=key))
            return {"charge": key}, 201

        client = app.test_client()
        assert client.post("/payments", headers={"Idempotency-Key": "flaky-1"}).status_code == 500
        with store.engine.connect() as conn:
            rows = list(conn.scalars(sa.select(ledger.c.charge)))
        assert rows == charges, f"provider charged {charges}, local payment rows {rows}"
        retry = client.post("/payments", headers={"Idempotency-Key": "flaky-1"})
        assert retry.status_code == 201 and retry.headers["Idempotent-Replayed"] == "true"
        assert len(charges) == 1
    finally:
        ledger.metadata.drop_all(store.engine)


@pytest.fixture
def committing_app(db_url: str) -> t.Iterator[flask.Flask]:
    app = application(db_url, "commit-hook")

    @app.after_request
    def commit_session(response: flask.Response) -> flask.Response:
        if response.status_code < 400:
            db.session.commit()
        return response

    idem = Idempotency(app, db=db, tenant=lambda: "alpha")

    @app.post("/payments")
    @idem.idempotent
    def pay() -> t.Any:
        db.session.add(Order(note="100"))
        return {"paid": True}, 201

    with app.app_context():
        db.create_all()
    yield app
    discard(app)


def test_a_commit_hook_finds_the_session_settled(committing_app: flask.Flask) -> None:
    client = committing_app.test_client()
    first = client.post("/payments", headers={"Idempotency-Key": "hook-1"})
    assert first.status_code == 201, first.get_data(as_text=True)
    retry = client.post("/payments", headers={"Idempotency-Key": "hook-1"})
    assert retry.status_code == 201 and retry.headers.get("Idempotent-Replayed") == "true"
    with committing_app.app_context():
        assert db.session.scalar(sa.select(sa.func.count()).select_from(Order)) == 1


DOCUMENT = {"id": "pay_1", "status": "succeeded", "description": "x" * 1000}


def test_a_compressing_hook_compresses_the_replay_from_the_plain_snapshot(
    store: SQLStore,
) -> None:
    app = flask.Flask("compress")

    @app.after_request
    def compress(response: flask.Response) -> flask.Response:  # what Flask-Compress does
        accepts = "gzip" in flask.request.headers.get("Accept-Encoding", "")
        if (
            not accepts
            or "Content-Encoding" in response.headers
            or response.mimetype != "application/json"
            or not 200 <= response.status_code < 300
        ):
            return response
        response.set_data(gzip.compress(response.get_data()))
        response.headers["Content-Encoding"] = "gzip"
        response.headers["Vary"] = "Accept-Encoding"
        return response

    idem = Idempotency(app, store=store, tenant=lambda: "alpha")

    @app.post("/payments")
    @idem.idempotent
    def pay() -> t.Any:
        return DOCUMENT, 201

    client = app.test_client()
    headers = {"Idempotency-Key": "gz-1", "Accept-Encoding": "gzip"}
    first = client.post("/payments", headers=headers)
    assert first.status_code == 201 and first.headers.get("Content-Encoding") == "gzip"
    assert flask.json.loads(gzip.decompress(first.data)) == DOCUMENT
    retry = client.post("/payments", headers=headers)
    assert retry.status_code == 201 and retry.headers.get("Idempotent-Replayed") == "true"
    assert flask.json.loads(gzip.decompress(retry.data)) == DOCUMENT, "compressed once"
    plain = client.post("/payments", headers={"Idempotency-Key": "gz-1"})
    assert plain.headers.get("Content-Encoding") is None
    assert flask.json.loads(plain.data) == DOCUMENT
