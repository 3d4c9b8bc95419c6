"""Behind PgBouncer in transaction pooling mode, with its default configuration: the store
works, its bounds hold per transaction, nothing it sets stays on a server connection another
client gets next, and the sample app keeps its guarantees (one charge per key in a storm and
after a worker killed mid-request, 503 in bounded time from a frozen database, no raw key in the
server log).

Its own durable cluster (it gets frozen), and a PgBouncer in front of it
(``tests/support/pgbouncer.py``, installed with apt when missing). The store's own tests also run
against a PgBouncer that drops the start-up options instead of refusing them
(``ignore_startup_parameters = options``).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import http.client
import os
import signal
import time
import typing as t
from pathlib import Path

import psycopg2
import pytest
import sqlalchemy as sa

from flask_idem import Scope
from flask_idem.core.errors import StoreUnavailable
from flask_idem.ops import check
from flask_idem.ops.migrate import upgrade
from flask_idem.store import create_engine, create_store, engines
from tests.e2e.test_faults import (
    BOUND,
    PROMISED,
    SLACK,
    assert_answer,
    assert_healthy,
    assert_no_key_in,
    executions,
    frozen,
    new_customer,
    new_key,
    payment,
    settle,
)
from tests.e2e.test_sample_app import in_background, wait_for
from tests.support import pgbouncer, pgcluster
from tests.support.drivers import PG_DRIVERS, spelled_for
from tests.support.helpers import store_on
from tests.support.sample_server import Reply, SampleServer, migrate
from tests.support.stalled import answered_while, table_locked

pytestmark = [pytest.mark.postgresql, pytest.mark.slow, pytest.mark.usefixtures("sqlalchemy_path")]

#: What the claim functions bound their transaction with when the session has no bound.
CLAIM_BOUND = f"{engines.STATEMENT_TIMEOUT:g}s"
#: Settings a store session must never leave behind on a pooled server connection, and the
#: server's defaults (the cluster sets none of them).
SESSION_DEFAULTS = {
    "statement_timeout": "0",
    "lock_timeout": "0",
    "log_min_error_statement": "error",
    "log_statement": "none",
    "default_transaction_isolation": "read committed",
    "flask_idem.reserved": None,
    "flask_idem.startup": None,
}
#: Sample-app lease for the killed-worker test (seconds).
LEASE = 3


@pytest.fixture(scope="module")
def cluster() -> t.Iterator[pgcluster.Cluster]:
    # Frozen by a test, so never the session's shared cluster; durable: a 201 must survive.
    if not pgcluster.have_server_binaries():
        pytest.fail(pgcluster.NO_SERVER)
    cluster = pgcluster.Cluster(pgcluster.PG_DIR / f"pooler-{os.getpid()}")
    try:
        cluster.start(durable=True)
        yield cluster
        assert_no_key_in(cluster.log_file)
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def database(cluster: pgcluster.Cluster) -> str:
    """A migrated database, its URL straight to the server."""
    url = pgcluster.create_database(cluster.url)
    migrate(url)
    return url


def _pooler(cluster: pgcluster.Cluster, **settings: str) -> t.Iterator[pgbouncer.PgBouncer]:
    pooler = pgbouncer.PgBouncer(cluster.url, settings)
    try:
        pooler.start()
        yield pooler
    finally:
        pooler.stop()


@pytest.fixture(scope="module")
def pooler(cluster: pgcluster.Cluster) -> t.Iterator[pgbouncer.PgBouncer]:
    """PgBouncer's default configuration in transaction mode: start-up options refused."""
    yield from _pooler(cluster)


@pytest.fixture(scope="module")
def ignoring_pooler(cluster: pgcluster.Cluster) -> t.Iterator[pgbouncer.PgBouncer]:
    """The same, told to drop the start-up options it cannot pass on."""
    yield from _pooler(cluster, ignore_startup_parameters="options")


@pytest.fixture(params=["refusing", "ignoring"])
def any_pooler(request: pytest.FixtureRequest) -> pgbouncer.PgBouncer:
    """Each of the two PgBouncers."""
    name = "pooler" if request.param == "refusing" else "ignoring_pooler"
    return t.cast(pgbouncer.PgBouncer, request.getfixturevalue(name))


@pytest.fixture(params=PG_DRIVERS, ids=["psycopg2", "psycopg"])
def driver(request: pytest.FixtureRequest) -> str:
    """Each PostgreSQL driver (psycopg 3 prepares statements it runs often: not behind it)."""
    return str(request.param)


@pytest.fixture
def pooled_store(database: str, any_pooler: pgbouncer.PgBouncer, driver: str) -> t.Iterator[t.Any]:
    """An empty store whose engine reaches the database through PgBouncer."""
    with store_on(spelled_for(any_pooler.url(database), driver)) as store:
        yield store


@pytest.fixture(params=["own", "foreign"])
def build_store(request: pytest.FixtureRequest) -> t.Callable[[str], t.Any]:
    """A store on flask_idem's own engine, or on one the application built with no options
    (Flask-SQLAlchemy's ``db=`` without ``SQLALCHEMY_ENGINE_OPTIONS``)."""
    if request.param == "own":
        return create_store
    return lambda url: create_store(sa.create_engine(url))


def _settings(cursor: t.Any) -> dict[str, str | None]:
    names = list(SESSION_DEFAULTS)
    cursor.execute(
        "SELECT " + ", ".join("nullif(current_setting(%s, true), '')" for _ in names), names
    )
    return dict(zip(names, cursor.fetchone(), strict=True))


def _scope(name: str) -> Scope:
    return Scope("tenant-a", "POST /v1/payments", new_key() + name)


# -- the store -----------------------------------------------------------------------------


def test_an_atomic_claim_bounds_its_business_transaction_behind_the_pooler(
    pooled_store: t.Any,
) -> None:
    """The session gets no start-up options, so the claim sets the bounds for its own
    transaction: what the view runs after it is bounded on the server, and its failures are
    logged without their statement."""
    assert pooled_store.claim(_scope("durable"), b"f" * 32, ttl=60, lease=30).claimed
    with pooled_store.begin() as connection:
        claimed = pooled_store.claim_atomic(connection, _scope("atomic"), b"f" * 32, ttl=60)
        assert claimed is not None and claimed.claimed
        cursor = connection.connection.dbapi_connection.cursor()
        seen = _settings(cursor)
        assert (seen["statement_timeout"], seen["lock_timeout"]) == (CLAIM_BOUND, CLAIM_BOUND)
        assert seen["log_min_error_statement"] == "panic"
        cursor.execute("SELECT current_setting('transaction_isolation')")
        assert cursor.fetchone() == ("read committed",)
        started = time.monotonic()
        with pytest.raises(sa.exc.OperationalError, match="statement timeout"):
            connection.exec_driver_sql("SELECT pg_sleep(30)")
        # The server's own bound, not the client-side deadline one second later.
        assert time.monotonic() - started < engines.STATEMENT_TIMEOUT + engines.DEADLINE_GRACE


def test_the_check_sends_an_operator_behind_the_pooler_to_the_role(pooled_store: t.Any) -> None:
    """Start-up settings and GRANT SET cannot reach a pooled session: only ALTER ROLE can, and
    the check's advice says so (the cluster's role has none of them)."""
    findings = {finding.check: finding for finding in check.run(pooled_store, partitions_ahead=0)}
    for name in ("statement_timeout", "lock_timeout", "log_min_error_statement"):
        assert findings[name].status is check.Status.WARNING
        assert "ALTER ROLE" in findings[name].detail, findings[name].detail
        assert "engine_options" not in findings[name].detail
        assert "GRANT SET" not in findings[name].detail


def test_a_durable_claim_waits_for_a_held_scope_lock_no_longer_than_the_bound(
    pooled_store: t.Any, database: str
) -> None:
    scope = _scope("locked")
    holder = psycopg2.connect(database)
    try:
        with holder.cursor() as cursor:
            cursor.execute(
                "SELECT pg_advisory_xact_lock(hashtext('flask_idem'), "
                "hashtext(%s || E'\\x1f' || %s || E'\\x1f' || %s))",
                # The claim locks the key as stored (its digest).
                (scope.tenant, scope.endpoint, pooled_store.keys.stored(scope.tenant, scope.key)),
            )
        started = time.monotonic()
        with pytest.raises(StoreUnavailable) as caught:
            pooled_store.claim(scope, b"f" * 32, ttl=60, lease=30)
        waited = time.monotonic() - started
    finally:
        holder.rollback()
        holder.close()
    assert "lock timeout" in str(caught.value.__cause__)
    assert engines.STATEMENT_TIMEOUT - 0.5 < waited < engines.STATEMENT_TIMEOUT + 1.5


def test_nothing_stays_on_a_server_connection_another_client_gets(
    cluster: pgcluster.Cluster,
    any_pooler: pgbouncer.PgBouncer,
    driver: str,
    build_store: t.Callable[[str], t.Any],
) -> None:
    """After the store's sessions (durable and atomic claims, from several threads at once),
    every server connection PgBouncer holds shows the server's defaults to a plain client,
    also when the store's engine is the application's own."""
    database = pgcluster.create_database(cluster.url)  # its own: no other client's backends
    upgrade(database)
    pooled_store = build_store(spelled_for(any_pooler.url(database), driver))

    def work(n: int) -> None:
        assert pooled_store.claim(_scope(f"d{n}"), b"f" * 32, ttl=60, lease=30).claimed
        with pooled_store.begin() as connection:
            assert pooled_store.claim_atomic(connection, _scope(f"a{n}"), b"f" * 32, ttl=60)

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        list(pool.map(work, range(24)))
    pooled_store.engine.dispose()
    direct = psycopg2.connect(database)
    direct.autocommit = True
    with direct.cursor() as cursor:
        cursor.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
            "AND backend_type = 'client backend' AND pid <> pg_backend_pid()"
        )
        servers = {pid for (pid,) in cursor.fetchall()}
    direct.close()
    assert servers, "PgBouncer keeps its server connections"
    # Each plain client holds a transaction open, so each gets a server connection of its own.
    clients = [psycopg2.connect(any_pooler.url(database)) for _ in servers]
    try:
        seen_pids = set()
        for client in clients:
            with client.cursor() as cursor:
                cursor.execute("SELECT pg_backend_pid()")
                seen_pids.add(cursor.fetchone()[0])
                assert _settings(cursor) == SESSION_DEFAULTS
        assert servers <= seen_pids, "every server connection the store used was looked at"
    finally:
        for client in clients:
            client.close()


def test_psycopg_3_claims_follow_the_pooler_to_another_server_connection(
    database: str, any_pooler: pgbouncer.PgBouncer, build_store: t.Callable[[str], t.Any]
) -> None:
    """psycopg 3 prepares a statement it runs often, on the server connection of that moment;
    PgBouncer 1.18 sends the next transaction wherever a server connection is free, where that
    statement does not exist. Store sessions behind a pooler prepare nothing, on the
    application's own engine too."""
    store = build_store(spelled_for(any_pooler.url(database), "postgresql+psycopg"))
    other = psycopg2.connect(any_pooler.url(database))
    try:
        for n in range(8):  # past psycopg's prepare_threshold (5), on one pooled connection
            assert store.claim(_scope(f"before{n}"), b"f" * 32, ttl=60, lease=30).claimed
        with other.cursor() as cursor:  # holds the server connection the claims just used
            cursor.execute("SELECT 1")
        for n in range(3):
            assert store.claim(_scope(f"after{n}"), b"f" * 32, ttl=60, lease=30).claimed
    finally:
        other.close()
        store.engine.dispose()


def _warm(pooler: pgbouncer.PgBouncer, database: str) -> None:
    """Let PgBouncer hold a server connection to ``database``: a client's login then completes
    without the server (frozen or not), and a new engine gets as far as its setup."""
    client = psycopg2.connect(pooler.url(database))
    try:
        with client.cursor() as cursor:
            cursor.execute("SELECT 1")
    finally:
        client.close()


#: How long PgBouncer may refuse logins after a freeze: a server login that failed during it
#: makes it refuse every login for ``server_login_retry`` (15 s by default).
RECOVERY = 45.0


@contextlib.contextmanager
def frozen_behind(
    cluster: pgcluster.Cluster, pooler: pgbouncer.PgBouncer, database: str
) -> t.Iterator[None]:
    """:func:`frozen`, then wait until PgBouncer serves again, so that the next test starts
    with a pooler that logs clients in (its retry delay after a failed server login is
    PgBouncer's, not flask_idem's: the test that froze the server waits it out)."""
    try:
        with frozen(cluster):
            yield
    finally:
        deadline = time.monotonic() + RECOVERY
        while True:
            try:
                _warm(pooler, database)
                break
            except psycopg2.OperationalError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)


def test_a_fresh_engines_concurrent_claims_answer_a_frozen_database_in_time(
    cluster: pgcluster.Cluster, database: str, pooler: pgbouncer.PgBouncer, driver: str
) -> None:
    """A worker that never reached the database before it froze: its first connection's setup
    (SQLAlchemy's first-connect queries, the pooler check) runs under a lock the other threads
    wait on, and each of them then ran the same setup again with a full deadline of its own, so
    the third claim answered after three deadlines (15 s). One deadline bounds each claim, the
    wait for that lock included."""
    store = create_store(spelled_for(pooler.url(database), driver))
    scopes = [_scope(f"fresh{n}") for n in range(3)]
    _warm(pooler, database)

    def claim(scope: Scope) -> float:
        started = time.monotonic()
        with pytest.raises(StoreUnavailable):
            store.claim(scope, b"f" * 32, ttl=60, lease=30)
        return time.monotonic() - started

    try:
        with (
            frozen_behind(cluster, pooler, database),
            concurrent.futures.ThreadPoolExecutor(len(scopes)) as pool,
        ):
            waited = list(pool.map(claim, scopes))
    finally:
        store.engine.dispose()
    assert max(waited) < PROMISED + SLACK, f"answered after {[round(w, 1) for w in waited]} s"


def test_a_fresh_engines_concurrent_connections_set_up_within_one_deadline(
    cluster: pgcluster.Cluster, database: str, pooler: pgbouncer.PgBouncer, driver: str
) -> None:
    """The same lock, for any engine flask_idem builds, outside any store operation (the
    sample's rate-limit counters, a view's own queries): a new connection's setup waits for
    the server at most one deadline in all, the wait for another thread's setup included."""
    engine = create_engine(spelled_for(pooler.url(database), driver))
    _warm(pooler, database)

    def connect(_: int) -> float:
        started = time.monotonic()
        with pytest.raises(sa.exc.OperationalError), engine.connect() as connection:
            connection.execute(sa.text("SELECT 1"))
        return time.monotonic() - started

    try:
        with (
            frozen_behind(cluster, pooler, database),
            concurrent.futures.ThreadPoolExecutor(3) as pool,
        ):
            waited = list(pool.map(connect, range(3)))
    finally:
        engine.dispose()
    assert max(waited) < PROMISED + SLACK, f"answered after {[round(w, 1) for w in waited]} s"


# -- the sample app under gunicorn -----------------------------------------------------------


@pytest.fixture
def served(
    database: str, pooler: pgbouncer.PgBouncer, tmp_path: Path
) -> t.Iterator[t.Callable[..., SampleServer]]:
    """Start the sample app on the database through PgBouncer (``SampleServer`` settings)."""
    started: list[tuple[SampleServer, bool]] = []

    def start(*, kills_a_worker: bool = False, **env: str) -> SampleServer:
        server = SampleServer(pooler.url(database), tmp_path, threads=8, **env)
        started.append((server, kills_a_worker))
        return server

    yield start
    for server, killed_one in started:
        server.stop()
        if not killed_one:
            assert_healthy(server)


def test_a_storm_of_one_key_charges_once(served: t.Callable[..., SampleServer]) -> None:
    server = served()
    key, customer = new_key(), new_customer()
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        replies = list(pool.map(lambda _: server.pay(key, payment(customer)), range(32)))
    for reply in replies:
        assert reply.status in (201, 409), reply.body
    assert executions(server, customer) == 1
    first = [reply for reply in replies if reply.status == 201]
    assert first and all(reply.body == first[0].body for reply in first)
    assert settle(server, key, payment(customer)).body == first[0].body


def test_a_worker_killed_mid_request_charges_once(
    served: t.Callable[..., SampleServer],
) -> None:
    server = served(
        kills_a_worker=True,
        SAMPLE_PROVIDER_LATENCY_MS="1500",
        FLASK_IDEMPOTENCY_LEASE=str(LEASE),
    )
    key, customer = new_key(), new_customer()
    connection = server.connection()
    connection.connect()
    assert connection.sock is not None
    client_port = connection.sock.getsockname()[1]
    thread, outcome = in_background(
        lambda: server.pay(key, payment(customer), connection=connection)
    )
    # The provider has charged and is "answering": kill the worker now.
    charged = "SELECT count(*) FROM provider_charges WHERE customer = :c"
    wait_for(lambda: server.scalar(charged, c=customer) == 1)
    worker = server.worker_serving(client_port)
    assert worker is not None and worker != server.process.pid
    os.kill(worker, signal.SIGKILL)
    thread.join()
    assert isinstance(outcome[0], http.client.HTTPException | OSError), outcome
    recovered = settle(server, key, payment(customer), timeout=LEASE + 20)
    assert recovered.status == 201, recovered.body
    assert server.scalar(charged, c=customer) == 1
    assert executions(server, customer) == 1
    replay = server.pay(key, payment(customer))
    assert (replay.status, replay.body) == (201, recovered.body)


def test_a_frozen_database_answers_503_in_time_and_loses_nothing(
    cluster: pgcluster.Cluster, served: t.Callable[..., SampleServer]
) -> None:
    server = served()
    done_key, done_customer = new_key(), new_customer()
    done = server.pay(done_key, payment(done_customer))
    assert done.status == 201, done.body
    jobs = [(new_key(), new_customer()) for _ in range(4)]
    calls: list[t.Callable[[], Reply]] = [
        lambda k=k, c=c: server.pay(k, payment(c), timeout=60) for k, c in jobs
    ]
    calls.append(lambda: server.pay(done_key, payment(done_customer)))
    answered = answered_while(frozen(cluster), calls)
    for reply, seconds in answered:
        assert_answer(reply, {503})
        assert seconds < BOUND, f"answered after {seconds:.1f} s"
    for key, customer in jobs:
        assert settle(server, key, payment(customer)).status == 201
        assert executions(server, customer) == 1
    replay = settle(server, done_key, payment(done_customer))
    assert (replay.status, replay.body) == (201, done.body)
    assert executions(server, done_customer) == 1


def test_claims_timing_out_keep_keys_out_of_the_server_log(
    cluster: pgcluster.Cluster, database: str, served: t.Callable[..., SampleServer]
) -> None:
    """Behind the pooler no session SET quiets the log: the claim does it for its own
    transaction, so a claim that times out is logged without its statement (its key)."""
    server = served()
    jobs = [(new_key(), new_customer()) for _ in range(3)]
    answered = answered_while(
        table_locked(database), [lambda k=k, c=c: server.pay(k, payment(c)) for k, c in jobs]
    )
    for reply, seconds in answered:
        assert_answer(reply, {503})
        assert seconds < BOUND
    assert "canceling statement due to lock timeout" in cluster.log_file.read_text(errors="replace")
    for key, customer in jobs:
        assert settle(server, key, payment(customer)).status == 201
    assert_no_key_in(cluster.log_file)
