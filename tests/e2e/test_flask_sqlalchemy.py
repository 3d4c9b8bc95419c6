"""Flask-SQLAlchemy sessions as the business transaction, in both claim modes, both databases."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
import typing as t

import flask
import pytest
import sqlalchemy as sa
from flask import Flask

from flask_idem import ConfigurationError, Idempotency
from flask_idem.core.key_digest import unkeyed
from flask_idem.store import create_engine
from flask_idem.testing import assert_ran_once, count_runs
from tests.support import orm_app

MODES = ("durable", "atomic")


@pytest.fixture
def orm(db_url: str) -> t.Iterator[tuple[Flask, Idempotency]]:
    app, idem = orm_app.create_app(db_url)
    yield app, idem
    with app.app_context():
        orm_app.db.drop_all()
        with orm_app.db.engine.begin() as conn:
            conn.exec_driver_sql("DELETE FROM idempotency_keys")
        orm_app.db.engine.dispose()


def _payments(app: Flask) -> list[str]:
    with app.app_context():
        return list(orm_app.db.session.scalars(sa.select(orm_app.Payment.idem_key)))


@pytest.mark.parametrize("mode", MODES)
def test_session_writes_commit_with_the_stored_response(
    orm: tuple[Flask, Idempotency], mode: str
) -> None:
    app, idem = orm
    assert app.extensions["idempotency"].store.engine is _engine(app), "the app's engine"
    responses = assert_ran_once(app.test_client(), f"/{mode}", json={"amount": 100}, key="k1")
    assert responses[0].status_code == 201
    assert _payments(app) == ["k1"]


def _engine(app: Flask) -> sa.Engine:
    with app.app_context():
        return t.cast(sa.Engine, orm_app.db.engine)


@pytest.mark.parametrize("mode", MODES)
def test_a_failure_after_the_flush_rolls_the_rows_back(
    orm: tuple[Flask, Idempotency], mode: str
) -> None:
    app, _ = orm
    client = app.test_client()
    with count_runs(app) as runs:
        failed = client.post(f"/{mode}", json={"amount": 13}, headers={"Idempotency-Key": "k"})
        again = client.post(f"/{mode}", json={"amount": 13}, headers={"Idempotency-Key": "k"})
    assert failed.status_code == 500 and _payments(app) == []
    if mode == "atomic":
        assert again.status_code == 500 and runs.count == 2, "rolled back: the key is free"
    else:
        assert again.status_code == 409, "durable: unknown outcome, never run again"


@pytest.mark.parametrize("mode", MODES)
def test_a_view_committing_the_session_itself_is_refused(
    orm: tuple[Flask, Idempotency], mode: str
) -> None:
    app, _ = orm
    reply = app.test_client().post(f"/{mode}", json={"amount": 7}, headers={"Idempotency-Key": "c"})
    assert reply.status_code == 500
    assert _payments(app) == [], "nothing committed before its stored response"


def test_a_never_stored_status_after_orm_writes_gives_the_key_back_at_once(
    orm: tuple[Flask, Idempotency],
) -> None:
    """The session's own transaction (SQLite's write lock) is rolled back before the key is
    given back: never a 5 s wait on its own lock and a key left in progress."""
    app, _ = orm
    client = app.test_client()
    started = time.monotonic()
    with count_runs(app) as runs:
        first = client.post("/busy", headers={"Idempotency-Key": "b"})
        again = client.post("/busy", headers={"Idempotency-Key": "b"})
    assert time.monotonic() - started < 3
    assert (first.status_code, again.status_code, runs.count) == (503, 503, 2), "released"
    assert _payments(app) == []
    with _engine(app).connect() as conn:
        assert conn.exec_driver_sql("SELECT count(*) FROM idempotency_keys").scalar() == 0


def test_a_released_savepoint_is_no_commit_of_the_view(orm: tuple[Flask, Idempotency]) -> None:
    app, _ = orm
    client = app.test_client()
    assert client.post("/nested", headers={"Idempotency-Key": "n"}).status_code == 201
    assert (
        client.post("/nested", headers={"Idempotency-Key": "n"}).headers["Idempotent-Replayed"]
        == "true"
    )
    assert _payments(app) == ["n"]


def test_db_must_be_registered_first(db_url: str) -> None:
    from flask_sqlalchemy import SQLAlchemy

    app = Flask("order")
    with pytest.raises(ConfigurationError, match="db.init_app"):
        Idempotency(app, db=SQLAlchemy())


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_kill_9_leaves_both_or_neither(db_url: str, mode: str) -> None:
    """A worker killed at random points: every payment row has its stored response and every
    stored response its payment row."""
    app, _ = orm_app.create_app(db_url)  # creates the table for the child processes
    prefix = f"kill-{mode}"
    try:
        for round_ in range(6):
            child = subprocess.Popen(
                [sys.executable, "-m", "tests.support.orm_app", db_url, mode, f"{prefix}{round_}"],
                stdout=subprocess.PIPE,
                env={**os.environ, "PYTHONPATH": os.getcwd()},
            )
            assert child.stdout is not None and child.stdout.readline() == b"ready\n"
            time.sleep(random.uniform(0.05, 0.4))
            child.send_signal(signal.SIGKILL)
            child.wait(timeout=30)
            child.stdout.close()
        engine = create_engine(db_url)
        try:
            with engine.connect() as conn:
                rows = conn.execute(
                    sa.text("SELECT idem_key FROM orm_payments WHERE idem_key LIKE :p"),
                    {"p": f"{prefix}%"},
                ).scalars()
                paid = list(rows)
                # Keys are stored as their digests (the orm app's tenant is alpha): the digest
                # of every key a child can have sent (PREFIX-0, PREFIX-1, ... per round).
                sent = {
                    unkeyed("alpha", f"{prefix}{r}-{n}"): f"{prefix}{r}-{n}"
                    for r in range(6)
                    for n in range(1000)
                }
                completed = sa.text("SELECT key FROM idempotency_keys WHERE state = 'completed'")
                stored = {sent[k] for k in conn.execute(completed).scalars() if k in sent}
        finally:
            engine.dispose()
        assert len(paid) == len(set(paid)), "one payment per key"
        assert set(paid) == stored, "a payment row exactly when its response is stored"
        assert len(stored) > 0, "the workers got some requests through"
    finally:
        with app.app_context():
            orm_app.db.drop_all()
            with orm_app.db.engine.begin() as conn:
                conn.exec_driver_sql("DELETE FROM idempotency_keys")
            orm_app.db.engine.dispose()


@pytest.mark.parametrize("mode", MODES)
def test_a_job_inside_a_protected_view_is_refused(
    orm: tuple[Flask, Idempotency], mode: str
) -> None:
    """The job would share ``db.session`` with the view: its commit would publish the view's
    payment without its record (and free an atomic view's key), so a retry would charge again.
    Refused loudly instead; nothing commits, and the key is not completed."""
    app, idem = orm
    receipts: list[str] = []

    @idem.job("receipt", key="order", tenant=lambda order: "alpha")
    def receipt(order: str) -> str:
        receipts.append(order)
        return order

    @app.post(f"/with-job-{mode}")
    @idem.idempotent(atomic=mode == "atomic")
    def with_job() -> t.Any:
        key = flask.request.headers["Idempotency-Key"]
        orm_app.db.session.add(orm_app.Payment(idem_key=key, amount=5))
        orm_app.db.session.flush()
        receipt(key)
        return {"ok": True}, 201

    client = app.test_client()
    with count_runs(app) as runs:
        first = client.post(f"/with-job-{mode}", headers={"Idempotency-Key": "j"})
        again = client.post(f"/with-job-{mode}", headers={"Idempotency-Key": "j"})
    assert first.status_code == 500 and receipts == []
    assert _payments(app) == [], "the view's payment never committed"
    if mode == "atomic":
        assert again.status_code == 500 and runs.count == 2, "rolled back: the key is free"
    else:
        assert again.status_code == 409, "durable: unknown outcome, never run again"
    with app.app_context():
        assert receipt("outside") == "outside", "outside a protected request the job runs"


def _session_app(pg_url: str, name: str, **config: t.Any) -> tuple[Flask, t.Any, Idempotency]:
    """An app whose business transaction is its Flask-SQLAlchemy session (``db=db``)."""
    from flask_sqlalchemy import SQLAlchemy

    from flask_idem.store import engine_options, normalize_url

    url = normalize_url(pg_url).render_as_string(hide_password=False)
    app = Flask(name)
    app.config.update(
        SQLALCHEMY_DATABASE_URI=url,
        SQLALCHEMY_ENGINE_OPTIONS=engine_options(url),
        PROPAGATE_EXCEPTIONS=False,
        **config,
    )
    db = SQLAlchemy(app)
    return app, db, Idempotency(app, db=db, tenant=lambda: "alpha")


@pytest.mark.postgresql
@pytest.mark.parametrize("mode", MODES)
def test_a_session_commit_that_fails_never_answers_the_views_response(
    pg_url: str, mode: str
) -> None:
    """The session's COMMIT fails (a deferred constraint): the client is told 503, never the
    view's 201 for rows that were not committed."""
    app, db, idem = _session_app(pg_url, f"commit-fails-{mode}")
    table = f"deferred_{mode}_{time.monotonic_ns()}"
    with app.app_context():
        with db.engine.begin() as conn:
            conn.exec_driver_sql(
                f"CREATE TABLE {table} (n int, UNIQUE (n) DEFERRABLE INITIALLY DEFERRED)"
            )

    @app.post("/pay")
    @idem.idempotent(atomic=mode == "atomic")
    def pay() -> t.Any:
        db.session.execute(sa.text(f"INSERT INTO {table} VALUES (1), (1)"))  # fails at COMMIT
        return {"paid": True}, 201

    try:
        answer = app.test_client().post("/pay", json={}, headers={"Idempotency-Key": table})
        assert answer.status_code == 503, answer.get_json()
        with app.app_context():
            assert db.session.execute(sa.text(f"SELECT count(*) FROM {table}")).scalar() == 0
    finally:
        with app.app_context():
            db.session.rollback()
            with db.engine.begin() as conn:
                conn.exec_driver_sql(f"DROP TABLE {table}")
            db.engine.dispose()


@pytest.mark.postgresql
def test_an_atomic_duplicate_waits_for_the_running_request_and_replays_it(pg_url: str) -> None:
    """With ``db=db`` and ``IDEMPOTENCY_WAIT``, a duplicate that finds the key busy rolls the
    session back and claims again: on the connection the session hands out next, never on the
    one it let go (a 500, ``This Connection is closed``)."""
    app, db, idem = _session_app(pg_url, "waits", IDEMPOTENCY_WAIT=5)
    runs: list[int] = []

    @app.post("/slow")
    @idem.idempotent(atomic=True)
    def slow() -> t.Any:
        runs.append(1)
        time.sleep(0.5)
        return {"run": len(runs)}, 201

    key = f"waits-{time.monotonic_ns()}"
    answers: dict[int, t.Any] = {}

    def send(n: int) -> None:
        answers[n] = app.test_client().post("/slow", json={}, headers={"Idempotency-Key": key})

    first = threading.Thread(target=send, args=(1,))
    first.start()
    time.sleep(0.2)
    send(2)
    first.join()
    try:
        assert answers[1].status_code == 201 and answers[1].get_json() == {"run": 1}
        assert answers[2].status_code == 201, answers[2].get_json()
        assert answers[2].headers["Idempotent-Replayed"] == "true"
        assert answers[2].get_json() == {"run": 1} and len(runs) == 1
    finally:
        with app.app_context():
            db.engine.dispose()
