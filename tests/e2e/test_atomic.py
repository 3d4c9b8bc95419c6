"""The atomic mode: the claim, the business rows and the stored response commit once.

In process on both databases (outcomes, SQL budget, refused external calls), then under
gunicorn with real processes: concurrent duplicates from 16 client threads in 8 processes for
50 keys, and a worker killed mid-view, which must leave nothing behind.
"""

from __future__ import annotations

import base64
import concurrent.futures
import contextlib
import datetime as dt
import http.client
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import typing as t
from pathlib import Path

import flask
import pytest
import sqlalchemy as sa

from flask_idem import ConfigurationError, Idempotency, Scope, StoreUnavailable
from flask_idem.core.key_digest import unkeyed
from flask_idem.store import SQLStore, create_engine
from tests.support import atomic_app
from tests.support.answers import post
from tests.support.helpers import Counter, count_statements, record_count
from tests.support.pgcluster import ROOT, free_port
from tests.support.wire import post_json

Factory = t.Callable[..., tuple[flask.Flask, Idempotency, Counter]]
ledger = sa.Table(
    "atomic_ledger",
    sa.MetaData(),
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("note", sa.String(32), nullable=False),
)


@pytest.fixture
def business(store: SQLStore) -> t.Iterator[sa.Table]:
    ledger.metadata.create_all(store.engine)
    yield ledger
    ledger.metadata.drop_all(store.engine)


@contextlib.contextmanager
def _seen(
    engine: sa.Engine, event: str, pick: t.Callable[[sa.Connection], t.Any]
) -> t.Iterator[list[t.Any]]:
    """What ``pick`` makes of the connection of every ``event`` of ``engine`` in the block."""
    picked: list[t.Any] = []

    def listener(connection: sa.Connection, *_: t.Any) -> None:
        picked.append(pick(connection))

    sa.event.listen(engine, event, listener)
    try:
        yield picked
    finally:
        sa.event.remove(engine, event, listener)


def _in_autocommit(connection: sa.Connection) -> bool:
    return bool(getattr(connection.connection.dbapi_connection, "autocommit", False))


def _rows(store: SQLStore, table: sa.Table) -> int:
    with store.engine.connect() as conn:
        return int(conn.execute(sa.select(sa.func.count()).select_from(table)).scalar_one())


def test_one_commit_replay_and_mismatch(
    app_factory: Factory, store: SQLStore, business: sa.Table
) -> None:
    app, idem, counter = app_factory()

    @app.post("/write")
    @idem.idempotent(atomic=True)
    def write() -> t.Any:
        counter.bump()
        idem.connection().execute(business.insert().values(note="paid"))
        return {"ok": True}, 201

    client = app.test_client()
    with _seen(store.engine, "commit", lambda conn: conn) as commits:
        with count_statements(store.engine) as seen:
            first = post(client, "k", {"n": 1}, path="/write")
    assert first.status_code == 201
    assert len(commits) == 1, "claim, business row and stored response: one commit"
    if store.dialect == "postgresql":
        # The lookup of a completed record (none: a new key), the claim (a reservation,
        # migration 0007), the business INSERT and the record, inserted completed (migration
        # 0014's function): nothing else on the wire, and the record is written once.
        assert len(seen) == 4 and "idempotency_find_completed(" in seen[0], seen
        assert "idempotency_claim_reserve(" in seen[1], seen
        assert seen[3].startswith("SELECT idempotency_complete_reserved("), seen
        with store.engine.connect() as conn:
            row = conn.execute(
                sa.text(
                    "SELECT state, response_status, claim_token IS NOT NULL, "
                    "completed_at IS NOT NULL, expires_at - created_at FROM idempotency_keys"
                )
            ).one()
        assert row[:4] == ("completed", 201, True, True)
        assert row[4] == dt.timedelta(seconds=app.extensions["idempotency"].settings.ttl)
    with _seen(store.engine, "before_cursor_execute", _in_autocommit) as in_autocommit:
        with count_statements(store.engine) as seen:
            replay = post(client, "k", {"n": 1}, path="/write")
    assert replay.headers["Idempotent-Replayed"] == "true"
    if store.dialect == "postgresql":
        # The lookup of a completed record, alone, in autocommit: no transaction opened, none
        # rolled back.
        assert len(seen) == 1 and "idempotency_find_completed(" in seen[0], seen
        assert in_autocommit == [True], "an atomic replay opened a transaction"
    mismatch = client.post("/write", json={"n": 2}, headers={"Idempotency-Key": "k"})
    assert mismatch.status_code == 422
    assert counter.calls == 1 and _rows(store, business) == 1


@pytest.mark.parametrize("failure", ["raise", "503", "downstream_key", "side_effect"])
def test_a_failure_leaves_nothing_and_the_retry_runs(
    app_factory: Factory, store: SQLStore, business: sa.Table, failure: str
) -> None:
    app, idem, counter = app_factory()

    @app.post("/write")
    @idem.idempotent(atomic=True)
    def write() -> t.Any:
        idem.connection().execute(business.insert().values(note="half"))
        if counter.bump() == 1:
            if failure == "raise":
                raise RuntimeError("half-way")
            if failure == "503":
                return "busy", 503
            getattr(idem, failure)(*(["charge"] if failure == "downstream_key" else []))
        return "done", 201

    client = app.test_client()
    first = post(client, "k", {"n": 1}, path="/write")
    assert first.status_code in (500, 503)
    assert record_count(store) == 0 and _rows(store, business) == 0, "nothing committed"
    assert post(client, "k", {"n": 1}, path="/write").status_code == 201
    assert _rows(store, business) == 1 and counter.calls == 2


def test_an_external_call_is_refused_loudly(app_factory: Factory, caplog: t.Any) -> None:
    app, idem, _ = app_factory()
    app.config["PROPAGATE_EXCEPTIONS"] = True

    @app.post("/charge")
    @idem.idempotent(atomic=True)
    def charge() -> t.Any:
        idem.downstream_key("charge")
        return "charged", 201

    with pytest.raises(RuntimeError, match="atomic view"):
        post(app.test_client(), "k", {"n": 1}, path="/charge")


@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
def test_a_duplicate_gets_409_at_once_while_the_first_runs(
    app_factory: Factory, store: SQLStore
) -> None:
    app, idem, counter = app_factory()
    inside, release = threading.Event(), threading.Event()

    @app.post("/slow")
    @idem.idempotent(atomic=True)
    def slow() -> t.Any:
        counter.bump()
        inside.set()
        release.wait(10)
        return "done", 201

    first: list[t.Any] = []
    thread = threading.Thread(
        target=lambda: first.append(post(app.test_client(), "k", {"n": 1}, path="/slow"))
    )
    thread.start()
    assert inside.wait(10)
    started = time.monotonic()
    duplicate = post(app.test_client(), "k", {"n": 1}, path="/slow")
    assert time.monotonic() - started < 2, "never a wait on the first request's lock"
    assert duplicate.status_code == 409 and duplicate.headers["Retry-After"] == "1"
    release.set()
    thread.join()
    assert first[0].status_code == 201
    assert (
        post(app.test_client(), "k", {"n": 1}, path="/slow").headers["Idempotent-Replayed"]
        == "true"
    )
    assert counter.calls == 1


@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
def test_a_replay_is_answered_while_another_holds_the_scope_lock(
    app_factory: Factory, store: SQLStore
) -> None:
    """Concurrent replays of a completed key (the holder of the try-lock may only be
    replaying) replay, never 409; a record in progress still answers 409, and a scope whose
    record expired is still claimed only by the lock holder (the lookup is for completed,
    live records)."""
    app, idem, counter = app_factory()

    @app.post("/done")
    @idem.idempotent(atomic=True)
    def done() -> t.Any:
        counter.bump()
        return {"n": counter.calls}, 201

    client = app.test_client()
    first = post(client, "k", {"n": 1}, path="/done")
    assert first.status_code == 201
    lock = (
        "SELECT pg_advisory_xact_lock(hashtext('flask_idem'),"
        " hashtext(:tenant || E'\\x1f' || :endpoint || E'\\x1f' || :key))"
    )
    # The claim locks the key as stored (its digest), so the test locks that.
    scope = {"tenant": "alpha", "endpoint": "POST /done", "key": unkeyed("alpha", "k")}
    with store.engine.connect() as holder:
        holder.begin()
        holder.execute(sa.text(lock), scope)
        started = time.monotonic()
        again = post(client, "k", {"n": 1}, path="/done")
        assert time.monotonic() - started < 2
        assert again.status_code == 201 and again.headers["Idempotent-Replayed"] == "true"
        assert again.get_json() == first.get_json()
        mismatch = client.post("/done", json={"n": 2}, headers={"Idempotency-Key": "k"})
        assert mismatch.status_code == 422
        # No record yet for a locked scope: busy, as before.
        holder.execute(sa.text(lock), scope | {"key": unkeyed("alpha", "fresh")})
        assert post(client, "fresh", {"n": 1}, path="/done").status_code == 409
        holder.rollback()
    assert counter.calls == 1
    # Expired: the lookup does not see it, so a holder of the lock keeps the scope.
    with store.engine.begin() as conn:
        conn.exec_driver_sql(
            "UPDATE idempotency_keys SET expires_at = now() - interval '1 hour',"
            " created_at = now() - interval '2 hours', completed_at = now() - interval '2 hours'"
            " WHERE key = %(key)s",
            {"key": unkeyed("alpha", "k")},
        )
    with store.engine.connect() as holder:
        holder.begin()
        holder.execute(sa.text(lock), scope)
        assert post(client, "k", {"n": 1}, path="/done").status_code == 409
        holder.rollback()
    assert post(client, "k", {"n": 1}, path="/done").status_code == 201 and counter.calls == 2


@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
def test_repeatable_read_is_refused(store: SQLStore) -> None:
    connection = store.begin()
    try:
        connection.exec_driver_sql("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        with pytest.raises(StoreUnavailable) as refused:
            store.claim_atomic(connection, Scope("t", "POST /x", "k"), b"f" * 32, ttl=60)
        assert "needs READ COMMITTED" in str(refused.value.__cause__)
    finally:
        connection.close()


# -- real processes -----------------------------------------------------------------------------


class _Gunicorn:
    def __init__(self, url: str, workdir: Path, **env: str) -> None:
        # The app's table exists before the workers boot: four workers creating it at once
        # race on CREATE TABLE, and a worker that loses fails to boot, taking gunicorn down.
        engine = create_engine(url)
        atomic_app.orders.metadata.create_all(engine)
        engine.dispose()
        self.port = free_port()
        self.log = workdir / "gunicorn.log"
        command = [
            str(Path(sys.executable).with_name("gunicorn")),
            *("-w", "4", "--threads", "4", "-b", f"127.0.0.1:{self.port}"),
            *("--graceful-timeout", "2", "--no-control-socket"),
            "tests.support.atomic_app:create_app()",
        ]
        with open(self.log, "wb") as log:
            self.process = subprocess.Popen(
                command,
                cwd=ROOT,
                env={**os.environ, "DATABASE_URL": url, **env},
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            assert self.process.poll() is None, self.log.read_text()[-3000:]
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=2).close()
                return
            except OSError:
                time.sleep(0.1)
        raise AssertionError(f"gunicorn did not listen:\n{self.log.read_text()[-3000:]}")

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        self.process.wait(timeout=15)


def order(port: int, key: str, reference: str, timeout: float = 30) -> tuple[int, str]:
    """An order over a real socket: its status and its ``Idempotent-Replayed`` header."""
    reply = post_json(port, key, {"reference": reference}, path="/orders", timeout=timeout)
    return reply.status, reply.headers.get("Idempotent-Replayed") or ""


def _client_process(port: int, keys: list[str], start: t.Any, answers: t.Any) -> None:
    """One of 8 client processes: 2 threads each send every key once, released together."""
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        for key in keys:
            start.wait()
            for status, replayed in pool.map(order, [port] * 2, [key] * 2, [key] * 2):
                answers.put((key, status, replayed))


@pytest.fixture(params=["postgresql", "sqlite"])
def atomic_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    from flask_idem.ops.migrate import upgrade

    if request.param == "postgresql":
        url = str(request.getfixturevalue("fresh_pg_database")())
    else:
        url = f"sqlite:///{tmp_path / 'atomic.sqlite3'}"
    upgrade(url)
    return url


def test_16_threads_in_8_processes_on_one_key_write_one_row(
    atomic_url: str, tmp_path: Path
) -> None:
    server = _Gunicorn(atomic_url, tmp_path)
    keys = [f"order-{n}" for n in range(50)]
    context = multiprocessing.get_context("spawn")
    start, answers = context.Barrier(8), context.Queue()
    clients = [
        context.Process(target=_client_process, args=(server.port, keys, start, answers))
        for _ in range(8)
    ]
    try:
        for client in clients:
            client.start()
        seen = [answers.get(timeout=120) for _ in range(16 * len(keys))]
        for client in clients:
            client.join(timeout=30)
    finally:
        server.stop()
    assert {status for _, status, _ in seen} <= {201, 409}, seen
    for key in keys:
        fresh = [s for k, s, replayed in seen if k == key and s == 201 and not replayed]
        assert len(fresh) == 1, (key, [a for a in seen if a[0] == key])
    engine = create_engine(atomic_url)
    try:
        with engine.connect() as conn:
            counts = conn.execute(
                sa.select(atomic_app.orders.c.reference, sa.func.count()).group_by(
                    atomic_app.orders.c.reference
                )
            ).all()
    finally:
        engine.dispose()
    assert sorted(counts) == sorted((key, 1) for key in keys), "exactly one row per key"
    assert "Traceback" not in server.log.read_text()


def test_a_worker_killed_mid_view_leaves_nothing_and_the_retry_runs_once(
    atomic_url: str, tmp_path: Path
) -> None:
    pidfile = tmp_path / "worker.pid"
    server = _Gunicorn(atomic_url, tmp_path, ATOMIC_APP_SLEEP="30", ATOMIC_APP_PIDFILE=str(pidfile))
    engine = create_engine(atomic_url)
    try:
        lost: list[t.Any] = []

        def first() -> None:
            try:
                lost.append(order(server.port, "killed", "killed"))
            except (OSError, http.client.HTTPException) as exc:
                lost.append(exc)

        thread = threading.Thread(target=first)
        thread.start()
        deadline = time.monotonic() + 15
        # The view writes the file in place: it exists a moment before it holds the pid.
        while not (pidfile.exists() and pidfile.read_text().strip()):
            assert time.monotonic() < deadline, "the view never started"
            time.sleep(0.05)
        os.kill(int(pidfile.read_text()), signal.SIGKILL)
        thread.join(timeout=15)
        assert isinstance(lost[0], Exception), lost
        with engine.connect() as conn:
            assert conn.exec_driver_sql("SELECT count(*) FROM idempotency_keys").scalar() == 0
            assert (
                conn.execute(sa.select(sa.func.count()).select_from(atomic_app.orders)).scalar()
                == 0
            )
        pidfile.unlink()
    finally:
        server.stop()
    again = _Gunicorn(atomic_url, tmp_path)
    try:
        assert order(again.port, "killed", "killed") == (201, "")
        assert order(again.port, "killed", "killed") == (201, "true")
    finally:
        again.stop()
    with engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(atomic_app.orders)).scalar() == 1
    engine.dispose()


def test_an_atomic_view_committing_itself_is_refused(
    app_factory: Factory, store: SQLStore, business: sa.Table
) -> None:
    app, idem, counter = app_factory()

    @app.post("/self-commit")
    @idem.idempotent(atomic=True)
    def self_commit() -> t.Any:
        conn = idem.connection()
        conn.execute(business.insert().values(note="early"))
        if counter.bump() == 1:
            conn.commit()  # would publish the claim half-way
        return "done", 201

    client = app.test_client()
    assert post(client, "k", {"n": 1}, path="/self-commit").status_code == 500
    assert record_count(store) == 0 and _rows(store, business) == 0, "nothing was committed"
    assert post(client, "k", {"n": 1}, path="/self-commit").status_code == 201
    assert _rows(store, business) == 1


def test_atomic_views_refuse_recovery_options(app_factory: Factory) -> None:
    _, idem, _ = app_factory()
    for options in ({"recovery": "reexecute"}, {"release_before_contact": True}):
        with pytest.raises(ConfigurationError, match="atomic view never leaves"):
            idem.idempotent(atomic=True, **options)


@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
def test_an_autocommit_engine_is_refused_in_atomic_views(db_url: str) -> None:
    engine = sa.create_engine(
        sa.make_url(db_url).set(drivername="postgresql+psycopg2"), isolation_level="AUTOCOMMIT"
    )
    try:
        app = flask.Flask("autocommit")
        app.config.update(IDEMPOTENCY_ENGINE=engine, PROPAGATE_EXCEPTIONS=True)
        idem = Idempotency(app, tenant=lambda: "alpha")

        @app.post("/write")
        @idem.idempotent(atomic=True)
        def write() -> t.Any:
            return "done", 201

        with pytest.raises(ConfigurationError, match="autocommit"):
            post(app.test_client(), "k", {"n": 1}, path="/write")
    finally:
        engine.dispose()


# -- isolation ----------------------------------------------------------------------------------


def test_claims_stay_exclusive_when_the_database_defaults_to_repeatable_read(
    fresh_pg_database: t.Callable[[], str],
) -> None:
    """Under REPEATABLE READ the claim's lookup would miss the winner's committed row."""
    from flask_idem.ops.migrate import upgrade
    from flask_idem.store import create_store

    url = fresh_pg_database()
    upgrade(url)
    raw = sa.create_engine(sa.make_url(url).set(drivername="postgresql+psycopg2"))
    with raw.begin() as conn:
        name = conn.exec_driver_sql("SELECT current_database()").scalar()
        conn.exec_driver_sql(
            f"ALTER DATABASE \"{name}\" SET default_transaction_isolation = 'repeatable read'"
        )
    raw.dispose()  # new sessions get the new default
    ours = create_store(url)  # flask_idem's engine: its sessions use READ COMMITTED
    theirs = create_store(raw)  # an application engine that keeps the database default
    try:
        wins: list[bool] = []
        for n in range(20):
            scope = Scope("t", "POST /rr", f"k{n}")
            barrier = threading.Barrier(4)

            def claim(scope: Scope = scope, barrier: threading.Barrier = barrier) -> bool:
                barrier.wait()
                return ours.claim(scope, b"f" * 32, ttl=60, lease=30).claimed

            with concurrent.futures.ThreadPoolExecutor(4) as pool:
                outcome = list(pool.map(lambda _: claim(), range(4)))
            wins.append(outcome.count(True) == 1)
        assert all(wins), "exactly one claim wins each key"
        with pytest.raises(StoreUnavailable) as refused:
            theirs.claim(Scope("t", "POST /rr", "theirs"), b"f" * 32, ttl=60, lease=30)
        assert "needs READ COMMITTED" in str(refused.value.__cause__), "refused, never doubled"
    finally:
        ours.engine.dispose()
        raw.dispose()


def test_sealed_and_audited_like_a_durable_claim(
    app_factory: Factory, store: SQLStore, business: sa.Table
) -> None:
    """The reserved record (PostgreSQL) is sealed against the created_at it is inserted with,
    and audited as any claim: claimed, then completed, committed with the business row."""
    secret = base64.b64encode(os.urandom(32)).decode()
    app, idem, counter = app_factory(
        IDEMPOTENCY_AUDIT=True, IDEMPOTENCY_ENCRYPTION_KEYS={"k1": secret}
    )

    @app.post("/write")
    @idem.idempotent(atomic=True)
    def write() -> t.Any:
        counter.bump()
        idem.connection().execute(business.insert().values(note="paid"))
        return {"id": "pay_SECRET"}, 201

    client = app.test_client()
    first = post(client, "sealed", {"n": 1}, path="/write")
    replay = post(client, "sealed", {"n": 1}, path="/write")
    assert first.status_code == replay.status_code == 201
    assert replay.headers["Idempotent-Replayed"] == "true" and replay.data == first.data
    assert counter.calls == 1 and _rows(store, business) == 1
    with store.engine.connect() as conn:
        body = conn.execute(sa.text("SELECT response_body FROM idempotency_keys")).scalar_one()
        events = conn.execute(
            sa.text("SELECT event, state, status FROM idempotency_audit ORDER BY occurred_at")
        ).all()
    assert b"pay_SECRET" not in bytes(body)
    assert [tuple(e) for e in events] == [
        ("claimed", "in_progress", None),
        ("completed", "completed", 201),
    ]


def test_a_view_that_ends_its_own_transaction_loses_its_claim(
    app_factory: Factory, store: SQLStore, business: sa.Table
) -> None:
    """Rolling ``idem.connection()`` back mid-view (a retry loop after a deadlock) ends the
    transaction that held the scope: a duplicate runs meanwhile, so this attempt must not
    complete too. It answers 409 and its later writes roll back: one charge for the key."""
    app, idem, _ = app_factory()
    rolled_back, duplicate_done = threading.Event(), threading.Event()

    @app.post("/charge")
    @idem.idempotent(atomic=True)
    def charge() -> t.Any:
        who = flask.request.headers["X-Who"]
        connection = idem.connection()
        if who == "first":
            connection.execute(business.insert().values(note="attempt"))
            connection.rollback()
            rolled_back.set()
            assert duplicate_done.wait(30)
        connection.execute(business.insert().values(note=f"charge-{who}"))
        return {"charged": who}, 201

    answers: dict[str, t.Any] = {}

    def send(who: str) -> None:
        answers[who] = post(app, "k", {"n": 1}, path="/charge", **{"X-Who": who})

    first = threading.Thread(target=send, args=("first",))
    first.start()
    try:
        assert rolled_back.wait(30)
        send("duplicate")
    finally:
        duplicate_done.set()
        first.join(30)
    assert answers["duplicate"].status_code == 201
    assert answers["first"].status_code == 409
    assert answers["first"].get_json()["type"].endswith("request-in-progress")
    with store.engine.connect() as conn:
        notes = conn.execute(sa.select(business.c.note)).scalars().all()
    assert notes == ["charge-duplicate"] and record_count(store) == 1
    replay = post(app.test_client(), "k", {"n": 1}, path="/charge")
    assert replay.headers["Idempotent-Replayed"] == "true"
    assert replay.get_json() == {"charged": "duplicate"}


@pytest.mark.parametrize("atomic", [True, False])
def test_an_answer_that_took_longer_than_its_ttl_still_replays(
    app_factory: Factory, store: SQLStore, business: sa.Table, atomic: bool
) -> None:
    """A record is live for its TTL from the end of its request: the completion, committed
    with the business transaction, must date that end by its own clock, not by the start of a
    transaction opened before the view ran."""
    app, idem, counter = app_factory()

    @app.post("/slow")
    @idem.idempotent(atomic=atomic, ttl=1)
    def slow() -> t.Any:
        idem.connection().execute(business.insert().values(note="slow"))
        time.sleep(1.5)
        return {"n": counter.bump()}, 201

    client = app.test_client()
    assert post(client, "k", {"n": 1}, path="/slow").status_code == 201
    replay = post(client, "k", {"n": 1}, path="/slow")
    assert replay.status_code == 201 and replay.headers["Idempotent-Replayed"] == "true"
    assert counter.calls == 1 and _rows(store, business) == 1


def _orders(
    engine: sa.Engine, counter: Counter, hook: t.Callable[[Idempotency], None] | None = None
) -> flask.Flask:
    """An app on ``engine`` with an atomic view that counts its runs; ``hook`` runs before
    every request's claim."""
    app = flask.Flask("orders")
    app.config["IDEMPOTENCY_ENGINE"] = engine
    idem = Idempotency(app, tenant=lambda: "t1")
    if hook is not None:
        app.before_request(lambda: hook(idem))

    @app.post("/orders")
    @idem.idempotent(atomic=True)
    def create() -> t.Any:
        counter.bump()
        idem.connection().exec_driver_sql("SELECT 1")
        return {"ok": True}, 201

    return app


def _replays(
    engine: sa.Engine, hook: t.Callable[[Idempotency], None] | None = None
) -> list[tuple[int, str | None]]:
    """A new key, then two replays of it and the same key with another body (:func:`_orders`)."""
    counter = Counter()
    client = _orders(engine, counter, hook).test_client()
    key = f"replays-{time.monotonic_ns()}"
    answers = [
        client.post("/orders", json=body, headers={"Idempotency-Key": key})
        for body in ({"n": 1}, {"n": 1}, {"n": 1}, {"n": 2})
    ]
    assert counter.calls == 1
    return [(a.status_code, a.headers.get("Idempotent-Replayed")) for a in answers]


EXPECTED = [(201, None), (201, "true"), (201, "true"), (422, None)]


@pytest.mark.postgresql
def test_an_atomic_replay_is_one_statement_on_a_worker_that_never_met_the_key(
    pg_url: str,
) -> None:
    """Another process (its own app, store and pool) answers a replay of a key completed
    elsewhere, and a 422 for it, with the lookup of the completed record alone, in autocommit:
    no transaction opened, none rolled back."""
    first, other = create_engine(pg_url), create_engine(pg_url)
    counter = Counter()
    key = f"elsewhere-{time.monotonic_ns()}"
    try:
        created = (
            _orders(first, counter)
            .test_client()
            .post("/orders", json={"n": 1}, headers={"Idempotency-Key": key})
        )
        assert created.status_code == 201
        client = _orders(other, counter).test_client()
        for body, status in (({"n": 1}, 201), ({"n": 2}, 422)):
            with _seen(other, "before_cursor_execute", _in_autocommit) as in_autocommit:
                with count_statements(other) as seen:
                    answer = client.post("/orders", json=body, headers={"Idempotency-Key": key})
            assert answer.status_code == status, answer.get_data(as_text=True)
            assert len(seen) == 1 and "idempotency_find_completed(" in seen[0], seen
            assert in_autocommit == [True], "an atomic replay opened a transaction"
        assert counter.calls == 1
    finally:
        first.dispose()
        other.dispose()


@pytest.mark.postgresql
def test_a_replay_takes_no_second_connection_from_the_pool(pg_url: str) -> None:
    """A hook that used idem.connection() before the claim holds the request's pooled
    connection: a replay is answered on that one, never on a second (a pool of one connection
    would time out: 503)."""
    engine = create_engine(pg_url, pool_size=1, max_overflow=0, pool_timeout=1)
    try:
        started = time.monotonic()
        hooked = _replays(
            engine, lambda idem: idem.connection().exec_driver_sql("SELECT 1") and None
        )
        assert hooked == EXPECTED
        assert time.monotonic() - started < 1
    finally:
        engine.dispose()


@pytest.mark.postgresql
def test_a_replay_behind_a_checkout_listener_that_opens_a_transaction(pg_url: str) -> None:
    """A pool checkout listener that runs a statement (a row-level-security tenant setting)
    hands connections out inside a transaction, which cannot be switched to autocommit: the
    lookup is then left to the claim in the transaction (never a 503), on the one connection
    the request checked out."""
    engine = create_engine(pg_url)
    checkouts: list[object] = []

    def tenant_setting(dbapi_connection: t.Any, *_: t.Any) -> None:
        checkouts.append(dbapi_connection)
        cursor = dbapi_connection.cursor()
        cursor.execute("SELECT set_config('app.tenant', 't1', false)")
        cursor.close()

    sa.event.listen(engine, "checkout", tenant_setting)
    try:
        assert _replays(engine) == EXPECTED
        assert len(checkouts) == 4, len(checkouts)
    finally:
        engine.dispose()


@pytest.mark.postgresql
@pytest.mark.parametrize("atomic", [True, False], ids=["atomic", "durable"])
def test_a_hook_that_commits_with_sql_leaves_the_view_its_transaction(
    pg_url: str, atomic: bool
) -> None:
    """A before_request hook that ends idem.connection()'s transaction with ``COMMIT`` sent as
    SQL: psycopg2 does not see it and would send no ``BEGIN`` after it, so every statement
    would commit on its own. Atomic: the claim's lock and reservation ended with its statement,
    the view's row committed with no record, and every retry ran the view again. Durable: a
    view that wrote and then failed before any contact had its key given back with its row
    committed, and the retry wrote a second. The business transaction is a real one again."""
    app = flask.Flask("hook-commits")
    app.config.update(IDEMPOTENCY_DATABASE_URL=pg_url, PROPAGATE_EXCEPTIONS=False)
    idem = Idempotency(app, tenant=lambda: "t1")
    engine = app.extensions["idempotency"].store.engine
    table = f"hook_commits_{time.monotonic_ns()}"
    with engine.begin() as conn:
        conn.exec_driver_sql(f"CREATE TABLE {table} (n int)")
    runs: list[int] = []

    @app.before_request
    def access_log() -> None:
        idem.connection().exec_driver_sql("SELECT 1")
        idem.connection().exec_driver_sql("COMMIT")

    @app.post("/pay")
    @idem.idempotent(atomic=atomic, **({} if atomic else {"release_before_contact": True}))
    def pay() -> t.Any:
        runs.append(1)
        idem.connection().exec_driver_sql(f"INSERT INTO {table} VALUES ({len(runs)})")
        if not atomic and len(runs) == 1:
            raise RuntimeError("the provider timed out before any contact")
        return {"paid": True}, 201

    client = app.test_client()
    try:
        answers = [
            client.post("/pay", json={}, headers={"Idempotency-Key": table}) for _ in range(3)
        ]
        statuses = [(a.status_code, a.headers.get("Idempotent-Replayed")) for a in answers]
        if atomic:
            assert statuses == [(201, None), (201, "true"), (201, "true")]
        else:
            assert statuses == [(500, None), (201, None), (201, "true")]
        with engine.connect() as conn:
            rows = [r[0] for r in conn.exec_driver_sql(f"SELECT n FROM {table} ORDER BY n")]
        assert rows == ([1] if atomic else [2]), "rows committed apart from their record"
    finally:
        with engine.begin() as conn:
            conn.exec_driver_sql(f"DROP TABLE {table}")
        engine.dispose()
