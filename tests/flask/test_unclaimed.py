"""A protected view's requests that claim nothing keep their writes exactly as claimed ones.

A view written for flask_idem does not commit: flask_idem commits its business transaction with
the stored response. Switched off (``IDEMPOTENCY_ENABLED = False``, the unit-test switch), with
an optional key left out, or called with a method outside ``IDEMPOTENCY_METHODS``, the same
view must still commit what it wrote, through ``db.session`` and through ``idem.connection()``,
in both claim modes and on both databases; and roll it back where a claimed request would
(an exception, a never-stored status, ``idem.refuse()``).
"""

from __future__ import annotations

import typing as t

import flask
import pytest
import sqlalchemy as sa
from flask import Flask

from flask_idem import Idempotency
from flask_idem.store import normalize_url
from tests.support.fsa_app import Order, db, discard, notes

#: How a request to a protected view ends up unclaimed: config, and the method it is sent with.
UNCLAIMED = {
    "switched off": ({"IDEMPOTENCY_ENABLED": False}, "POST"),
    "optional key left out": ({"IDEMPOTENCY_KEY_REQUIRED": False}, "POST"),
    "method outside IDEMPOTENCY_METHODS": ({}, "PUT"),
}
MODES = {"durable": {}, "atomic": {"atomic": True}}


def _build(db_url: str, config: dict[str, t.Any], options: dict[str, t.Any]) -> Flask:
    app = Flask("unclaimed")
    app.config.update(
        SQLALCHEMY_DATABASE_URI=normalize_url(db_url).render_as_string(hide_password=False),
        PROPAGATE_EXCEPTIONS=False,
        **config,
    )
    db.init_app(app)
    idem = Idempotency(app, db=db, tenant=lambda: "alpha")
    with app.app_context():
        db.create_all()

    @app.route("/orm/<note>", methods=["POST", "PUT"])
    @idem.idempotent(**options)
    def orm_write(note: str) -> t.Any:
        db.session.add(Order(note=note))  # no commit: flask_idem commits
        if note == "crash":
            db.session.flush()
            raise RuntimeError("after the flush")
        if note == "busy":
            return {"busy": True}, 503
        if note == "refused":
            return idem.refuse(({"later": True}, 429))
        return {"note": note}, 201

    @app.route("/core/<note>", methods=["POST", "PUT"])
    @idem.idempotent(**options)
    def core_write(note: str) -> t.Any:
        idem.connection().execute(sa.insert(Order.__table__).values(note=note))
        if note == "crash":
            raise RuntimeError("after the insert")
        return {"note": note}, 201

    return app


@pytest.fixture
def build(db_url: str) -> t.Iterator[t.Callable[..., Flask]]:
    apps: list[Flask] = []

    def make(config: dict[str, t.Any], options: dict[str, t.Any]) -> Flask:
        apps.append(_build(db_url, config, options))
        return apps[-1]

    yield make
    for app in apps:
        discard(app)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("how", UNCLAIMED)
def test_unclaimed_requests_commit_what_the_view_wrote(
    build: t.Callable[..., Flask], how: str, mode: str
) -> None:
    config, method = UNCLAIMED[how]
    app = build(config, MODES[mode])
    client = app.test_client()
    for path in ("/orm/orm", "/core/core"):
        response = client.open(path, method=method)
        assert response.status_code == 201, response.get_data(as_text=True)
        assert "Idempotent-Replayed" not in response.headers
    assert notes(app) == ["core", "orm"], "both writes committed"


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("how", UNCLAIMED)
def test_unclaimed_requests_roll_back_where_a_claimed_one_would(
    build: t.Callable[..., Flask], how: str, mode: str
) -> None:
    config, method = UNCLAIMED[how]
    app = build(config, MODES[mode])
    client = app.test_client()
    assert client.open("/orm/crash", method=method).status_code == 500
    assert client.open("/core/crash", method=method).status_code == 500
    assert client.open("/orm/busy", method=method).status_code == 503
    assert client.open("/orm/refused", method=method).status_code == 429
    assert notes(app) == [], "nothing of a crash, a never-stored status or a refusal commits"


def test_a_switched_off_blueprint_keeps_its_writes(db_url: str) -> None:
    app = Flask("unclaimed-blueprint")
    app.config.update(
        SQLALCHEMY_DATABASE_URI=normalize_url(db_url).render_as_string(hide_password=False),
        IDEMPOTENCY_ENABLED=False,
    )
    db.init_app(app)
    idem = Idempotency(db=db, tenant=lambda: "alpha")
    api = flask.Blueprint("api", __name__)
    idem.protect_blueprint(api)

    @api.post("/orders")
    def create_order() -> t.Any:
        db.session.add(Order(note="bp"))
        return {"ok": True}, 201

    app.register_blueprint(api)
    idem.init_app(app)
    with app.app_context():
        db.create_all()
    try:
        assert app.test_client().post("/orders").status_code == 201
        assert notes(app) == ["bp"]
    finally:
        discard(app)


def test_an_unprotected_view_that_raises_commits_nothing_of_idem_connection(
    build: t.Callable[..., Flask],
) -> None:
    app = build({}, {})
    idem: Idempotency = app.extensions["idempotency"].extension

    @app.post("/plain/<note>")
    def plain(note: str) -> t.Any:
        idem.connection().execute(sa.insert(Order.__table__).values(note=note))
        if note == "crash":
            raise RuntimeError("after the insert")
        return {"ok": True}, 201

    client = app.test_client()
    assert client.post("/plain/crash").status_code == 500
    assert client.post("/plain/kept").status_code == 201
    assert notes(app) == ["kept"]
