"""The fault suite: the sample app under gunicorn while its database misbehaves.

Its own PostgreSQL cluster (it gets frozen, killed and filled up, so it must not be the session's
shared one) with at most 40 connections. Every test asserts, for what it breaks:

* an answer within the promised time (a silent database: 503 within the statement timeout plus
  its one second of grace; generous bounds, no timing beyond them);
* no 5xx with a traceback, and no gunicorn worker killed or crashed;
* no lost committed result (a 201 answered before the fault replays after it) and at most one
  execution per key (counted in the app's own tables);
* no raw key in any log: gunicorn's, and PostgreSQL's own log file.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import typing as t
import uuid
from pathlib import Path

import psycopg2
import pytest

from flask_idem.store import engines
from tests.support import pgcluster
from tests.support.drivers import PG_DRIVERS, spelled_for
from tests.support.sample_server import BETA, Reply, SampleServer, migrate, stored_key
from tests.support.stalled import answered_while, table_locked, timed

pytestmark = [pytest.mark.postgresql, pytest.mark.slow]

#: A silent database answers 503 after the statement timeout and its grace; this bound is
#: generous on purpose (2 shared cores), yet well below gunicorn's 30 s worker timeout.
PROMISED = engines.STATEMENT_TIMEOUT + engines.DEADLINE_GRACE
BOUND = PROMISED + 6
#: What a request may add to the store's promise when that is the bound under test: the
#: hooks' own work and the scheduling of 2 shared cores, never a second database wait.
SLACK = 0.9
#: Every key any test sent: none may appear in any log.
SENT_KEYS: list[str] = []


def new_key() -> str:
    key = f"fault-{uuid.uuid4().hex}"
    SENT_KEYS.append(key)
    return key


def new_customer() -> str:
    return f"cus_{uuid.uuid4().hex[:12]}"


def payment(customer: str, amount: int = 4200) -> dict[str, t.Any]:
    return {"amount": amount, "currency": "eur", "customer": customer}


@pytest.fixture(scope="module")
def cluster() -> t.Iterator[pgcluster.Cluster]:
    # The suite freezes and kills its server, so it always starts its own (also when
    # DATABASE_URL names a shared one); without server binaries it fails, never skips.
    if not pgcluster.have_server_binaries():
        pytest.fail(pgcluster.NO_SERVER)
    cluster = pgcluster.Cluster(pgcluster.PG_DIR / f"faults-{os.getpid()}")
    try:
        # Durable: an immediate stop must not lose a committed result (the shared test cluster
        # runs with synchronous_commit=off, which would).
        cluster.start(durable=True, settings={"max_connections": "40"})
        yield cluster
        assert_no_key_in(cluster.log_file)
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def database(cluster: pgcluster.Cluster) -> str:
    url = pgcluster.create_database(cluster.url)
    migrate(url)
    return url


@pytest.fixture(params=PG_DRIVERS, ids=["psycopg2", "psycopg"])
def server(
    request: pytest.FixtureRequest, database: str, tmp_path: Path
) -> t.Iterator[SampleServer]:
    # Threads enough for every concurrent request of a test, whichever worker accepts it: a
    # request queued behind a busy thread would measure the queue, not the store.
    server = SampleServer(spelled_for(database, request.param), tmp_path, threads=8)
    yield server
    server.stop()
    assert_healthy(server)


def assert_no_key_in(path: Path) -> None:
    text = path.read_bytes().decode("utf-8", "replace")
    leaked = [key for key in SENT_KEYS if key in text]
    assert not leaked, f"raw keys in {path.name}: {leaked[:3]}"


def assert_healthy(server: SampleServer) -> None:
    """No crash, no worker timeout, no raw key in gunicorn's log."""
    text = server.server_log.read_text(errors="replace")
    for sign in ("WORKER TIMEOUT", "Error handling request", "Exception in worker", "SIGKILL"):
        assert sign not in text, text[-3000:]
    assert_no_key_in(server.server_log)


def assert_answer(reply: Reply, statuses: t.Collection[int]) -> None:
    assert reply.status in statuses, (reply.status, reply.body[:500])
    if reply.status >= 500:
        assert reply.headers["Content-Type"] == "application/problem+json", reply.body
        assert b"Traceback" not in reply.body
        assert reply.json()["type"].endswith("/store-unavailable"), reply.body


def executions(server: SampleServer, customer: str) -> int:
    return int(server.scalar("SELECT count(*) FROM payments WHERE customer = :c", c=customer))


def settle(server: SampleServer, key: str, body: dict[str, t.Any], timeout: float = 30) -> Reply:
    """Retry with the same key until the answer is final (the database is back)."""
    deadline = time.monotonic() + timeout
    while True:
        reply = server.pay(key, body)
        if reply.status not in (409, 503) or time.monotonic() > deadline:
            return reply
        time.sleep(0.3)


@contextlib.contextmanager
def frozen(cluster: pgcluster.Cluster) -> t.Iterator[None]:
    """SIGSTOP the postmaster and every backend: connections stay open and acknowledged.

    The postmaster stops first, so that no child is forked after the list of its children is
    read; a child that exits before its signal (an autovacuum worker, a closed session) is
    skipped. Whatever was stopped is resumed whatever happens: a server left stopped fails
    every later test of the cluster and hangs the ones that wait for it."""
    postmaster, *_ = cluster.server_pids()
    stopped: list[int] = []
    try:
        os.kill(postmaster, signal.SIGSTOP)
        stopped.append(postmaster)
        for pid in cluster.server_pids()[1:]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
                stopped.append(pid)
        yield
    finally:
        for pid in reversed(stopped):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


# -- forked workers ------------------------------------------------------------------------


@pytest.mark.parametrize("driver", PG_DRIVERS)
def test_preloaded_workers_never_share_a_connection(
    database: str, driver: str, tmp_path: Path
) -> None:
    """``--preload`` with the start-up partition check: the master's pooled connection must
    not reach the workers (it answered 500s and other requests' payments)."""
    server = SampleServer(
        spelled_for(database, driver),
        tmp_path,
        workers=4,
        args=["--preload"],
        FLASK_IDEMPOTENCY_ENSURE_PARTITIONS="true",
    )
    try:
        for _round in range(3):
            jobs = [(new_key(), new_customer(), 1000 + n, n % 2 == 0) for n in range(16)]

            def send(job: tuple[str, str, int, bool]) -> tuple[tuple[str, str, int, bool], Reply]:
                key, customer, amount, beta = job
                api_key = {"api_key": BETA} if beta else {}
                return job, server.pay(key, payment(customer, amount), **api_key)

            with concurrent.futures.ThreadPoolExecutor(16) as pool:
                for (key, customer, amount, _beta), reply in pool.map(send, jobs):
                    assert reply.status == 201, reply.body
                    assert (reply.json()["customer"], reply.json()["amount"]) == (
                        customer,
                        amount,
                    )
                    assert reply.headers["Idempotency-Key"] == key
                    assert executions(server, customer) == 1
    finally:
        server.stop()
    assert_healthy(server)


# -- a frozen, a restarted and a full database ----------------------------------------------


def test_frozen_database_answers_503_in_time_and_loses_nothing(
    cluster: pgcluster.Cluster, server: SampleServer
) -> None:
    done_key, done_customer = new_key(), new_customer()
    done = server.pay(done_key, payment(done_customer))
    assert done.status == 201
    workers = sorted(server.workers())
    jobs = [(new_key(), new_customer()) for _ in range(6)]
    # Pooled connections (a statement that never returns) and new ones (a postmaster
    # that never answers the start-up packet) alike.
    calls: list[t.Callable[[], Reply]] = [
        lambda k=k, c=c: server.pay(k, payment(c), timeout=60) for k, c in jobs
    ]
    calls.append(lambda: server.pay(done_key, payment(done_customer)))
    answered = answered_while(frozen(cluster), calls)
    for reply, seconds in answered:
        assert_answer(reply, {503})
        assert seconds < BOUND, f"answered after {seconds:.1f} s"
    assert sorted(server.workers()) == workers, "no worker was killed"
    for key, customer in jobs:
        reply = settle(server, key, payment(customer))
        assert reply.status == 201, reply.body
        assert executions(server, customer) == 1
    replay = settle(server, done_key, payment(done_customer))
    assert (replay.status, replay.body) == (201, done.body), "the committed result survives"
    assert replay.headers["Idempotent-Replayed"] == "true"
    assert executions(server, done_customer) == 1


def test_a_frozen_database_answers_503_within_the_stores_bound_rate_limit_included(
    cluster: pgcluster.Cluster, server: SampleServer
) -> None:
    """The sample's rate-limit counters live in the same database and are counted before the
    claim: while it was frozen, their wait came on top of the claim's, and the answer took
    6 to 7.5 s where the store promises 5. Warm pools and cold ones (a worker that never
    connected opens new connections to a postmaster that never answers)."""
    for _ in range(4):
        assert server.pay(new_key(), payment(new_customer())).status == 201
    jobs = [(new_key(), new_customer()) for _ in range(6)]
    answered = answered_while(
        frozen(cluster), [lambda k=k, c=c: server.pay(k, payment(c)) for k, c in jobs]
    )
    for reply, seconds in answered:
        assert_answer(reply, {503})
        assert reply.headers["Idempotency-Key"]
        assert seconds < PROMISED + SLACK, f"answered after {seconds:.1f} s"
    for key, customer in jobs:
        assert settle(server, key, payment(customer)).status == 201
        assert executions(server, customer) == 1


def test_database_killed_and_restarted(cluster: pgcluster.Cluster, server: SampleServer) -> None:
    _kill_and_restart(cluster, server)


def test_database_killed_and_restarted_on_the_public_api_path(
    cluster: pgcluster.Cluster, database: str, tmp_path: Path
) -> None:
    """The same with ``IDEMPOTENCY_SQLALCHEMY_FAST_PATH`` off: the dead connections are dropped
    through SQLAlchemy's public API, not the fast path's ``pool._invalidate``."""
    server = SampleServer(
        database, tmp_path, threads=8, FLASK_IDEMPOTENCY_SQLALCHEMY_FAST_PATH="false"
    )
    try:
        _kill_and_restart(cluster, server)
    finally:
        server.stop()
    assert_healthy(server)


def _kill_and_restart(cluster: pgcluster.Cluster, server: SampleServer) -> None:
    """Answers 503 in time while the database is down, then the same keys finish once and a
    result committed before it replays."""
    done_key, done_customer = new_key(), new_customer()
    done = server.pay(done_key, payment(done_customer))
    assert done.status == 201
    cluster.stop_server("immediate")
    try:
        key, customer = new_key(), new_customer()
        for _ in range(3):
            reply, seconds = timed(lambda: server.pay(key, payment(customer)))
            assert_answer(reply, {503})
            assert seconds < BOUND
    finally:
        cluster.start_server()
    reply = settle(server, key, payment(customer))
    assert reply.status == 201, reply.body
    assert executions(server, customer) == 1
    replay = settle(server, done_key, payment(done_customer))
    assert (replay.status, replay.body) == (201, done.body)
    assert executions(server, done_customer) == 1


def test_out_of_connections(database: str, server: SampleServer) -> None:
    """Every connection slot taken, and the app's own connections gone: 503, then recovery."""
    dsn = database
    admin = psycopg2.connect(dsn)
    admin.autocommit = True
    hogs: list[t.Any] = []
    key, customer = new_key(), new_customer()
    try:
        with admin.cursor() as cursor:
            cursor.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE datname = current_database() AND pid <> pg_backend_pid()"
            )
        while True:
            try:
                hogs.append(psycopg2.connect(dsn))
            except psycopg2.OperationalError as exc:
                assert "too many clients" in str(exc) or "reserved" in str(exc), exc
                break
            assert len(hogs) < 100
        for _ in range(3):
            reply, seconds = timed(lambda: server.pay(key, payment(customer)))
            assert_answer(reply, {503})
            assert seconds < BOUND
    finally:
        for hog in hogs:
            hog.close()
        admin.close()
    reply = settle(server, key, payment(customer))
    assert reply.status == 201, reply.body
    assert executions(server, customer) == 1


def test_statements_timing_out_in_flight_keep_keys_out_of_the_server_log(
    cluster: pgcluster.Cluster, database: str, server: SampleServer
) -> None:
    """A table lock makes every claim time out (lock_timeout) while requests wait; PostgreSQL
    logs each error, but never the statement, so never the key."""
    # The proof that the log would show it: a session without flask_idem's settings.
    marker = new_key()
    plain = psycopg2.connect(database)
    with contextlib.suppress(psycopg2.Error), plain.cursor() as cursor:
        cursor.execute("SELECT 1 / 0 WHERE %s <> ''", (marker,))
    plain.close()
    text = cluster.log_file.read_text(errors="replace")
    assert marker in text, "PostgreSQL logs the statement (with the literal) of an error"
    SENT_KEYS.remove(marker)

    jobs = [(new_key(), new_customer()) for _ in range(4)]
    answered = answered_while(
        table_locked(database), [lambda k=k, c=c: server.pay(k, payment(c)) for k, c in jobs]
    )
    for reply, seconds in answered:
        assert_answer(reply, {503})
        assert seconds < BOUND
    # Logged: the error (lock or statement timeout, whichever fires first), not the statement.
    assert "canceling statement due to" in cluster.log_file.read_text(errors="replace")
    for key, customer in jobs:
        assert settle(server, key, payment(customer)).status == 201
        assert executions(server, customer) == 1
    assert_no_key_in(cluster.log_file)


# -- truncated uploads over a raw socket ----------------------------------------------------


def _raw_exchange(server: SampleServer, head: bytes, body: bytes) -> bytes:
    """Send a request head and part of a body, close our sending side, read the answer."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(head + body)
        sock.shutdown(socket.SHUT_WR)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    return answer


def _head(server: SampleServer, key: str, framing: str) -> bytes:
    return (
        "POST /v1/payments HTTP/1.1\r\n"
        f"Host: 127.0.0.1:{server.port}\r\n"
        "Authorization: Bearer sk_test_alpha\r\n"
        f"Idempotency-Key: {key}\r\n"
        "Content-Type: application/json\r\n"
        f"{framing}\r\n"
        "Connection: close\r\n\r\n"
    ).encode()


def test_truncated_uploads_are_400_before_any_claim(server: SampleServer) -> None:
    import json

    key, customer = new_key(), new_customer()
    body = json.dumps(payment(customer)).encode()
    answer = _raw_exchange(server, _head(server, key, f"Content-Length: {len(body)}"), body[:20])
    status_line, _, rest = answer.partition(b"\r\n")
    assert b" 400 " in status_line, answer[:500]
    assert b"request-body-incomplete" in rest
    assert (
        server.scalar("SELECT count(*) FROM idempotency_keys WHERE key = :k", k=stored_key(key))
        == 0
    )

    chunked_key = new_key()
    cut = f"{len(body):x}\r\n".encode() + body[:20]
    answer = _raw_exchange(server, _head(server, chunked_key, "Transfer-Encoding: chunked"), cut)
    assert b" 400 " in answer.partition(b"\r\n")[0], answer[:500]
    assert b"Traceback" not in answer
    assert (
        server.scalar(
            "SELECT count(*) FROM idempotency_keys WHERE key = :k", k=stored_key(chunked_key)
        )
        == 0
    )

    for retry_key in (key, chunked_key):
        retry = server.pay(retry_key, payment(customer if retry_key == key else new_customer()))
        assert retry.status == 201, retry.body
    assert executions(server, customer) == 1


# -- SQLite locked by another process -------------------------------------------------------

_LOCKER = """
import sqlite3, sys, time
connection = sqlite3.connect(sys.argv[1], isolation_level=None)
connection.execute("BEGIN EXCLUSIVE")
print("locked", flush=True)
time.sleep(float(sys.argv[2]))
connection.execute("ROLLBACK")
"""


def test_sqlite_locked_by_another_process_answers_503_in_time(tmp_path: Path) -> None:
    path = tmp_path / "locked.sqlite3"
    url = f"sqlite:///{path}"
    migrate(url)
    server = SampleServer(url, tmp_path, threads=2)
    try:
        done_key, done_customer = new_key(), new_customer()
        assert server.pay(done_key, payment(done_customer)).status == 201
        workers = sorted(server.workers())
        locker = subprocess.Popen(
            [sys.executable, "-c", _LOCKER, str(path), str(PROMISED + 4)],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert locker.stdout is not None and locker.stdout.readline().strip() == "locked"
            key, customer = new_key(), new_customer()
            reply, seconds = timed(lambda: server.pay(key, payment(customer)))
            assert_answer(reply, {503})
            assert seconds < BOUND
            assert sorted(server.workers()) == workers, "the worker survived the lock"
        finally:
            locker.wait(timeout=60)
            if locker.stdout is not None:
                locker.stdout.close()
        reply = settle(server, key, payment(customer))
        assert reply.status == 201, reply.body
        replay = server.pay(done_key, payment(done_customer))
        assert replay.headers["Idempotent-Replayed"] == "true"
    finally:
        server.stop()
    assert_healthy(server)


@pytest.mark.parametrize("driver", PG_DRIVERS)
def test_client_side_deadline_fires_on_a_frozen_backend(database: str, driver: str) -> None:
    """The measurement behind the promise: one frozen backend, one statement, one deadline."""
    from flask_idem.store import create_engine

    engine = create_engine(spelled_for(database, driver))
    try:
        with engine.connect() as conn:
            pid = conn.exec_driver_sql("SELECT pg_backend_pid()").scalar_one()
            os.kill(pid, signal.SIGSTOP)
            stopped = threading.Timer(PROMISED + 3, os.kill, (pid, signal.SIGCONT))
            stopped.start()
            started = time.monotonic()
            try:
                with pytest.raises(Exception, match="did not answer"):
                    conn.exec_driver_sql("SELECT 1")
                elapsed = time.monotonic() - started
            finally:
                stopped.cancel()
                os.kill(pid, signal.SIGCONT)
        assert PROMISED - 0.5 <= elapsed < PROMISED + 2, elapsed
        with engine.connect() as conn:
            assert conn.exec_driver_sql("SELECT 2").scalar_one() == 2, "the pool recovered"
    finally:
        engine.dispose()


@pytest.mark.parametrize("driver", PG_DRIVERS)
def test_a_frozen_store_backend_leaves_the_applications_connections_alone(
    database: str, driver: str
) -> None:
    """The deadline is per store connection: while a frozen backend fails a store call in
    time, the application's own connections (idle, or running longer than the deadline) are
    not touched, and COPY keeps working on them."""
    import io

    from flask_idem import Scope, StoreUnavailable
    from flask_idem.store import create_engine, create_store

    engine = create_engine(spelled_for(database, driver))
    store = create_store(engine)
    idle = psycopg2.connect(database)
    busy = psycopg2.connect(database)
    try:
        with engine.connect() as conn:  # the pool's only connection: the store's next call
            pid = conn.exec_driver_sql("SELECT pg_backend_pid()").scalar_one()
        with idle.cursor() as cursor:
            cursor.execute("SELECT pg_backend_pid()")
            idle_pid = cursor.fetchone()[0]
        idle.rollback()
        slept: list[t.Any] = []

        def sleep_past_the_deadline() -> None:
            with busy.cursor() as cursor:
                cursor.execute("SELECT pg_sleep(%s), 'slept'", (PROMISED + 1,))
                slept.append(cursor.fetchone()[1])

        sleeper = threading.Thread(target=sleep_past_the_deadline)
        sleeper.start()
        os.kill(pid, signal.SIGSTOP)
        thaw = threading.Timer(PROMISED + 3, os.kill, (pid, signal.SIGCONT))
        thaw.start()
        started = time.monotonic()
        try:
            with pytest.raises(StoreUnavailable):
                store.claim(Scope("t", "POST /frozen", new_key()), b"f" * 32, ttl=60, lease=30)
            elapsed = time.monotonic() - started
        finally:
            thaw.cancel()
            os.kill(pid, signal.SIGCONT)
        assert PROMISED - 0.5 <= elapsed < PROMISED + 2, elapsed
        sleeper.join(timeout=30)
        assert slept == ["slept"], "a connection of the application has no deadline"
        with idle.cursor() as cursor:
            cursor.execute("SELECT pg_backend_pid()")
            assert cursor.fetchone()[0] == idle_pid, "the idle connection is the same session"
            out = io.StringIO()
            cursor.copy_expert("COPY (SELECT 7) TO STDOUT", out)
            assert out.getvalue() == "7\n"
        with engine.connect() as conn:
            assert conn.exec_driver_sql("SELECT 2").scalar_one() == 2, "the pool recovered"
    finally:
        idle.close()
        busy.close()
        engine.dispose()


@pytest.mark.parametrize("silent", ["backend", "server"])
@pytest.mark.parametrize("driver", PG_DRIVERS)
def test_a_claim_that_lands_after_its_503_is_given_back(
    cluster: pgcluster.Cluster, database: str, driver: str, silent: str
) -> None:
    """A backend frozen with the claim already in its socket runs it when it thaws, after the
    request answered 503 "not executed": that record would hold the key in progress for its
    lease, then (``recovery="fail"``) answer outcome-pending for work that never ran. The
    process gives it back, fenced by its token, once the store answers: the retry runs. The
    backend alone frozen: the first give-back finds nothing (the store answers on another
    backend) and is tried again; the whole server frozen: the give-back waits for it."""
    import flask

    from flask_idem import Idempotency, Scope, State

    app = flask.Flask("given-back")
    app.config["IDEMPOTENCY_DATABASE_URL"] = spelled_for(database, driver)
    idem = Idempotency(app, tenant=lambda: "t")
    ran: list[int] = []

    @app.post("/notes")
    @idem.idempotent
    def notes() -> t.Any:
        ran.append(1)
        return {"ran": len(ran)}, 201

    store = app.extensions["idempotency"].store
    client = app.test_client()
    key = new_key()
    try:
        with store.engine.connect() as conn:  # the pool's only connection: the claim's
            pid = conn.exec_driver_sql("SELECT pg_backend_pid()").scalar_one()
        if silent == "backend":
            os.kill(pid, signal.SIGSTOP)
            thaw = threading.Timer(PROMISED + 3, os.kill, (pid, signal.SIGCONT))
            thaw.start()
            try:
                first = client.post("/notes", json={"n": 1}, headers={"Idempotency-Key": key})
            finally:
                thaw.join()
        else:
            with frozen(cluster):
                first = client.post("/notes", json={"n": 1}, headers={"Idempotency-Key": key})
                time.sleep(3)  # the first give-back fails: the server is still silent
        assert first.status_code == 503, first.get_data(as_text=True)
        assert ran == []
        # The landed claim answers 409 until it is given back (without: for its 30 s lease,
        # then outcome-pending).
        deadline = time.monotonic() + 20
        while True:
            second = client.post("/notes", json={"n": 1}, headers={"Idempotency-Key": key})
            if second.status_code != 409 or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert second.status_code == 201 and ran == [1], second.get_data(as_text=True)
        assert store.get(Scope("t", "POST /notes", key)).state is State.COMPLETED
    finally:
        with contextlib.suppress(ProcessLookupError, UnboundLocalError):
            os.kill(pid, signal.SIGCONT)
        store.engine.dispose()
