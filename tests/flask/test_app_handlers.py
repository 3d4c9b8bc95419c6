"""flask_idem's answers survive what the application registers around them.

An application's ``errorhandler(Exception)`` (it catches HTTPExceptions too), its
``errorhandler(HTTPException)`` or a blueprint's must not turn a 400, 409, 413, 422 or 503 of
flask_idem's into its own answer; a tenant callable that raises is ``tenant-unresolved``;
``idem.refuse()`` gives a plain view's key back.
"""

from __future__ import annotations

import logging
import threading
import typing as t

import flask
import pytest
import sqlalchemy as sa
from werkzeug.exceptions import HTTPException

from flask_idem import Idempotency
from flask_idem.core.record import Scope, State
from flask_idem.ops.migrate import upgrade
from flask_idem.store import SQLStore, create_store, normalize_url
from tests.support.answers import problem_name
from tests.support.helpers import Counter

HANDLERS = ("Exception", "HTTPException", "blueprint Exception")
ledger = sa.Table(
    "handler_ledger",
    sa.MetaData(),
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("note", sa.String(50)),
)


def _own_handlers(app: flask.Flask, api: flask.Blueprint, kind: str) -> None:
    def swallow(error: Exception) -> t.Any:
        return {"error": type(error).__name__}, 500

    if kind == "Exception":
        app.register_error_handler(Exception, swallow)
    elif kind == "HTTPException":
        app.register_error_handler(HTTPException, swallow)
    else:
        api.register_error_handler(Exception, swallow)


def _app(store: SQLStore, kind: str, **config: t.Any) -> tuple[flask.Flask, Idempotency, Counter]:
    app = flask.Flask("handlers")
    app.config.update(PROPAGATE_EXCEPTIONS=False, IDEMPOTENCY_MAX_REQUEST_BODY=1024, **config)
    idem = Idempotency(app, store=store, tenant=lambda: "alpha")
    api = flask.Blueprint("api", __name__)
    counter = Counter()
    held = Hold()

    @api.post("/pay")
    @idem.idempotent
    def pay() -> t.Any:
        n = counter.bump()
        body = flask.request.get_json(silent=True) or {}
        if body.get("hold"):
            held.entered.set()  # a retry now finds the key in progress
            assert held.release.wait(10)
        if body.get("crash"):
            raise RuntimeError("after contact")
        return {"n": n}, 201

    @api.post("/write")
    @idem.idempotent
    def write() -> t.Any:
        idem.connection().execute(ledger.insert().values(note="x"))
        return {"ok": True}, 201

    _own_handlers(app, api, kind)
    app.register_blueprint(api)
    app.config["HOLD"] = held
    return app, idem, counter


class Hold:
    """Keeps a request inside its view until released."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()


@pytest.mark.parametrize("kind", HANDLERS)
def test_flask_idem_answers_bypass_the_applications_error_handlers(
    store: SQLStore, kind: str
) -> None:
    app, _, counter = _app(store, kind)
    client = app.test_client()
    missing = client.post("/pay", json={})
    assert (missing.status_code, problem_name(missing)) == (400, "idempotency-key-missing")
    invalid = client.post("/pay", json={}, headers={"Idempotency-Key": "bad key"})
    assert (invalid.status_code, problem_name(invalid)) == (400, "idempotency-key-invalid")
    large = client.post("/pay", data="x" * 2048, headers={"Idempotency-Key": "big"})
    assert (large.status_code, problem_name(large)) == (413, "request-body-too-large")

    assert client.post("/pay", json={"a": 1}, headers={"Idempotency-Key": "k1"}).status_code == 201
    reused = client.post("/pay", json={"a": 2}, headers={"Idempotency-Key": "k1"})
    assert (reused.status_code, problem_name(reused)) == (422, "idempotency-key-reused")

    held: Hold = app.config["HOLD"]
    first = threading.Thread(
        target=lambda: client.post("/pay", json={"hold": 1}, headers={"Idempotency-Key": "k2"})
    )
    first.start()
    try:
        assert held.entered.wait(10)
        busy = app.test_client().post("/pay", json={"hold": 1}, headers={"Idempotency-Key": "k2"})
        assert (busy.status_code, problem_name(busy)) == (409, "request-in-progress")
    finally:
        held.release.set()
        first.join(10)

    # A crash after contact leaves the key unknown: the retry is told to wait, and when.
    assert client.post("/pay", json={"crash": 1}, headers={"Idempotency-Key": "k3"}).status_code
    pending = client.post("/pay", json={"crash": 1}, headers={"Idempotency-Key": "k3"})
    assert (pending.status_code, problem_name(pending)) == (409, "outcome-pending")
    assert int(pending.headers["Retry-After"]) > 0
    assert counter.calls == 3, "k1 once, k2 once (the inner retry never ran), k3 once"


@pytest.mark.parametrize("kind", HANDLERS)
def test_a_store_that_cannot_be_reached_answers_503_through_any_handler(
    fresh_pg_database: t.Callable[[], str], kind: str
) -> None:
    url = fresh_pg_database()  # never migrated: every store statement fails
    down = create_store(url)
    try:
        app, _, counter = _app(down, kind)
        response = app.test_client().post("/pay", json={}, headers={"Idempotency-Key": "k"})
        assert (response.status_code, problem_name(response)) == (503, "store-unavailable")
        assert counter.calls == 0, "fail closed: the view never ran"
    finally:
        down.engine.dispose()


@pytest.mark.parametrize("kind", HANDLERS)
def test_the_database_refusing_connections_in_the_view_answers_503_through_any_handler(
    fresh_pg_database: t.Callable[[], str], kind: str
) -> None:
    url = normalize_url(fresh_pg_database())
    upgrade(url)
    admin = sa.create_engine(url.set(database="postgres"), isolation_level="AUTOCOMMIT")
    store = create_store(url)
    try:
        app, idem, _ = _app(store, kind)

        @app.post("/gone")
        @idem.idempotent
        def gone() -> t.Any:
            # The claim committed; now the database takes no connections, and no pooled one
            # hides it: idem.connection() cannot open the business transaction.
            with admin.connect() as conn:
                conn.exec_driver_sql(f'ALTER DATABASE "{url.database}" ALLOW_CONNECTIONS false')
            store.engine.dispose()
            idem.connection().execute(sa.text("SELECT 1"))
            return {"ok": True}, 201

        response = app.test_client().post("/gone", headers={"Idempotency-Key": "gone"})
        assert (response.status_code, problem_name(response)) == (503, "store-unavailable")
    finally:
        store.engine.dispose()
        admin.dispose()


def test_a_raising_tenant_callable_is_tenant_unresolved(
    store: SQLStore, caplog: pytest.LogCaptureFixture
) -> None:
    app = flask.Flask("tenant")
    app.config.update(PROPAGATE_EXCEPTIONS=False)
    idem = Idempotency(app, store=store, tenant=lambda: flask.g.tenant)  # no hook sets it
    counter = Counter()

    @app.post("/pay")
    @idem.idempotent
    def pay() -> t.Any:
        counter.bump()
        return {}, 201

    with caplog.at_level(logging.ERROR, logger="flask_idem"):
        response = app.test_client().post("/pay", headers={"Idempotency-Key": "secret-key-1"})
    assert problem_name(response) == "tenant-unresolved" and counter.calls == 0
    logged = [r for r in caplog.records if r.exc_info and r.exc_info[0] is AttributeError]
    assert logged, "the tenant callable's exception is logged"
    assert "secret-key-1" not in caplog.text


def test_refuse_gives_a_plain_views_key_back(store: SQLStore) -> None:
    app = flask.Flask("refuse")
    idem = Idempotency(app, store=store, tenant=lambda: "alpha")
    counter = Counter()
    quota = {"left": 0}

    @app.post("/pay")
    @idem.idempotent
    def pay() -> t.Any:
        counter.bump()
        if quota["left"] == 0:
            return idem.refuse(({"error": "daily limit"}, 429, {"Retry-After": "1"}))
        if quota["left"] < 0:
            idem.side_effect()  # contact: a refusal can no longer give the key back
            return idem.refuse(({"error": "upstream said no"}, 503))
        return {"paid": True}, 201

    client = app.test_client()
    assert client.post("/pay", headers={"Idempotency-Key": "r"}).status_code == 429
    quota["left"] = 1
    paid = client.post("/pay", headers={"Idempotency-Key": "r"})
    assert paid.status_code == 201 and "Idempotent-Replayed" not in paid.headers
    assert counter.calls == 2

    quota["left"] = -1
    assert client.post("/pay", headers={"Idempotency-Key": "s"}).status_code == 503
    quota["left"] = 1
    pending = client.post("/pay", headers={"Idempotency-Key": "s"})
    assert (pending.status_code, problem_name(pending)) == (409, "outcome-pending")
    assert counter.calls == 3


def test_a_plain_views_never_stored_status_leaves_the_key_unknown(store: SQLStore) -> None:
    app = flask.Flask("plain-503")
    idem = Idempotency(app, store=store, tenant=lambda: "alpha")

    @app.post("/pay")
    @idem.idempotent
    def pay() -> t.Any:
        return {"error": "provider timed out"}, 503  # it may have charged

    client = app.test_client()
    assert client.post("/pay", headers={"Idempotency-Key": "u"}).status_code == 503
    pending = client.post("/pay", headers={"Idempotency-Key": "u"})
    assert (pending.status_code, problem_name(pending)) == (409, "outcome-pending")


def test_declares_effects_still_works_and_warns(store: SQLStore) -> None:
    app = flask.Flask("deprecated")
    idem = Idempotency(app, store=store, tenant=lambda: "alpha")
    with pytest.warns(DeprecationWarning, match="release_before_contact"):
        decorate = idem.idempotent(declares_effects=True)

    @app.post("/busy")
    @decorate
    def busy() -> t.Any:
        return "busy", 503

    client = app.test_client()
    assert client.post("/busy", headers={"Idempotency-Key": "d"}).status_code == 503
    assert client.post("/busy", headers={"Idempotency-Key": "d"}).status_code == 503, "released"


@pytest.mark.parametrize("kind", HANDLERS)
def test_a_view_400_a_handler_turns_into_500_is_never_replayed(store: SQLStore, kind: str) -> None:
    """``request.get_json()`` raises BadRequest on a malformed body; a handler for every
    exception answers it with 500. That 500 is the handler's failure, not the view's answer:
    never stored and replayed for the key's whole TTL (the key is left as after a crash)."""
    app = flask.Flask("get-json")
    app.config.update(PROPAGATE_EXCEPTIONS=False)
    idem = Idempotency(app, store=store, tenant=lambda: "alpha")
    api = flask.Blueprint("api", __name__)

    @api.post("/orders")
    @idem.idempotent
    def order() -> t.Any:
        return {"amount": flask.request.get_json()["amount"]}, 201

    _own_handlers(app, api, kind)
    app.register_blueprint(api)
    client = app.test_client()
    headers = {"Idempotency-Key": "bad-json", "Content-Type": "application/json"}
    first = client.post("/orders", data=b"{not json", headers=headers)
    assert first.status_code == 500
    retry = client.post("/orders", data=b"{not json", headers=headers)
    assert "Idempotent-Replayed" not in retry.headers, "the handler's 500 was replayed"
    record = store.get(Scope("alpha", "POST /orders", "bad-json"))
    assert record is not None and record.state is not State.COMPLETED
