"""``IDEMPOTENCY_DATABASE_URL`` naming Flask-SQLAlchemy's database in another spelling
(``localhost`` for ``127.0.0.1``, libpq's query parameters, a SQLite file through a symbolic
link, the same relative SQLite URL in both settings) is the same database: ``db.session``
commits with the stored answer and the view's rows are kept.
"""

from __future__ import annotations

import os
import typing as t
from pathlib import Path

import pytest
import sqlalchemy as sa
from flask import Flask

from flask_idem import Idempotency
from flask_idem.ops.migrate import upgrade
from flask_idem.store import normalize_url
from flask_idem.testing import empty_store
from tests.support.fsa_app import Order, db, discard


def _pg_spellings(pg_url: str) -> dict[str, str]:
    url = normalize_url(pg_url)
    other_host = {"127.0.0.1": "localhost", "localhost": "127.0.0.1"}.get(url.host or "")
    query = {"host": url.host or "", "port": str(url.port or 5432)}
    if url.username:
        query["user"] = url.username
    if url.password:
        query["password"] = url.password
    spellings = {
        "query-parameters": sa.URL.create(
            "postgresql", database=url.database, query=query
        ).render_as_string(hide_password=False),
    }
    if other_host:
        spellings["other-host-name"] = url.set(host=other_host).render_as_string(
            hide_password=False
        )
    return spellings


def _run(fsa_url: str, idem_url: str) -> tuple[bool, list[int], int]:
    app = Flask("spellings")
    app.config.update(
        SQLALCHEMY_DATABASE_URI=fsa_url,
        IDEMPOTENCY_DATABASE_URL=idem_url,  # the same database, spelled another way
        PROPAGATE_EXCEPTIONS=False,
    )
    db.init_app(app)
    idem = Idempotency(app, tenant=lambda: "alpha")
    state = app.extensions["idempotency"]
    empty_store(state.store)

    @app.post("/orders")
    @idem.idempotent
    def create_order() -> t.Any:
        db.session.add(Order())  # committed by flask_idem with the stored response
        return {"ok": True}, 201

    with app.app_context():
        db.create_all()
    try:
        client = app.test_client()
        statuses = [
            client.post("/orders", headers={"Idempotency-Key": "spelling"}).status_code
            for _ in range(2)
        ]
        with app.app_context():
            rows = int(db.session.scalar(sa.select(sa.func.count()).select_from(Order)) or 0)
            db.session.remove()
    finally:
        discard(app)
        state.store.engine.dispose()
    return state.sessions is not None, statuses, rows


def test_postgresql_spellings_of_the_same_database(pg_url: str) -> None:
    fsa_url = normalize_url(pg_url).render_as_string(hide_password=False)
    failures = {}
    for name, spelled in _pg_spellings(pg_url).items():
        same, statuses, rows = _run(fsa_url, spelled)
        if not same or rows != 1:
            failures[name] = (same, statuses, rows)
    assert not failures, f"(same?, answers, rows) per spelling: {failures}"


def test_sqlite_file_through_a_symbolic_link(tmp_path: Path) -> None:
    real = tmp_path / "data"
    real.mkdir()
    (tmp_path / "link").symlink_to(real, target_is_directory=True)
    upgrade(f"sqlite:///{real / 'app.sqlite3'}")
    same, statuses, rows = _run(
        f"sqlite:///{tmp_path / 'link' / 'app.sqlite3'}", f"sqlite:///{real / 'app.sqlite3'}"
    )
    assert os.path.samefile(tmp_path / "link" / "app.sqlite3", real / "app.sqlite3")
    assert same and rows == 1, f"same={same}, answers {statuses}, rows {rows}"


def test_sqlite_relative_url_named_twice(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/flask-sqlalchemy.md's own example URL, ``sqlite:///payments.sqlite3``, given to both
    settings: Flask-SQLAlchemy opens it in the instance folder, the store in the working
    directory. "Naming the same one again is the same as naming none" (the docs), yet the
    store gets a second file and db.session's rows are never committed."""
    monkeypatch.chdir(tmp_path)  # Flask("spellings") has no module: its root is here
    (tmp_path / "instance").mkdir()
    url = "sqlite:///payments.sqlite3"
    upgrade(url)  # the store's file, as alembic run from here migrates it
    upgrade(f"sqlite:///{tmp_path / 'instance' / 'payments.sqlite3'}")  # Flask-SQLAlchemy's
    same, statuses, rows = _run(url, url)
    assert same and rows == 1, f"same={same}, answers {statuses}, rows {rows}"
