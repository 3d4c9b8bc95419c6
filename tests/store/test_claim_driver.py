"""The claim on the driver's cursor (``PostgresStore._claim_row``) keeps
what SQLAlchemy's own execution does: the same statement and record, SQLAlchemy's exceptions,
the pool renewed on a disconnect, an interrupted connection discarded, the engine's autocommit
setting kept, and everything that watches an engine (cursor and ``handle_error`` listeners,
``echo``) still seeing the claim, through ``exec_driver_sql``. Most tests run on both paths:
``driver`` (nothing watches the engine) and ``traced`` (a cursor listener)."""

from __future__ import annotations

import dataclasses
import os
import time
import typing as t
import warnings

import psycopg2
import psycopg2.errors
import psycopg2.extensions
import pytest
import sqlalchemy as sa

from flask_idem import Scope, State, StoreUnavailable, create_store
from flask_idem.ops.migrate import upgrade
from flask_idem.store import SQLStore, create_engine, normalize_url
from flask_idem.testing import empty_store
from flask_idem.testing.contract import FP, RESPONSE
from tests.support.drivers import (
    cursor_class,
    driver_of,
    is_idle,
    pg_url_on_each_driver,  # noqa: F401 (the driver tests on both drivers)
)

pytestmark = [pytest.mark.postgresql, pytest.mark.usefixtures("sqlalchemy_path")]


def _noop(*_args: t.Any) -> None:
    pass


@pytest.fixture(params=["driver", "traced"])
def path(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def _trace(engine: sa.Engine, path: str) -> None:
    if path == "traced":
        sa.event.listen(engine, "before_cursor_execute", _noop)


def _libpq(url: str) -> str:
    return normalize_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


def _store(engine: sa.Engine) -> SQLStore:
    """An empty store on ``engine`` (its own, so listeners and options stay in the test)."""
    store = create_store(engine)
    empty_store(store)
    return store


def _kill_pool(engine: sa.Engine, url: str, n: int = 1) -> None:
    held = [engine.connect() for _ in range(n)]
    pids = [c.exec_driver_sql("SELECT pg_backend_pid()").scalar_one() for c in held]
    for c in held:
        c.close()
    with psycopg2.connect(_libpq(url)) as admin, admin.cursor() as cur:
        cur.execute("SELECT pg_terminate_backend(p) FROM unnest(%s) AS p", (pids,))


class TestClaimThroughTheDriver:
    """The claim runs on the driver's cursor unless cursor listeners watch the engine
    (``PostgresStore._claim_row``): the same statement, record and failure handling either
    way. ``traced`` runs each test on both paths."""

    @pytest.fixture(params=["driver", "traced"])
    def traced(self, request: pytest.FixtureRequest, pg_store: SQLStore) -> t.Iterator[bool]:
        def ignore(*_args: object) -> None:
            pass

        if request.param == "traced":
            sa.event.listen(pg_store.engine, "before_cursor_execute", ignore)
        yield request.param == "traced"
        if request.param == "traced":
            sa.event.remove(pg_store.engine, "before_cursor_execute", ignore)

    def test_the_server_sees_one_statement_per_claim_and_no_transaction(
        self, fresh_pg_database: t.Callable[[], str], scope: Scope
    ) -> None:
        url = fresh_pg_database()
        upgrade(url)
        store = create_store(url)
        admin = psycopg2.connect(
            _libpq(str(store.engine.url.render_as_string(hide_password=False)))
        )
        admin.autocommit = True
        try:
            with admin.cursor() as cursor:
                try:
                    cursor.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
                except psycopg2.Error:
                    # The suite's own cluster always loads it (tests/support/pgcluster.py): only a
                    # server given by DATABASE_URL may lack it.
                    if not os.environ.get("DATABASE_URL"):
                        raise
                    pytest.skip("pg_stat_statements is not loaded on the DATABASE_URL server")
                with store.engine.connect():
                    pass  # SQLAlchemy's first-connect queries, in a transaction of their own
                cursor.execute("SELECT pg_stat_statements_reset()")
            new = store.claim(scope, FP, ttl=60, lease=30)
            assert new.claimed
            assert store.complete(scope, new.token, RESPONSE)
            replay = store.claim(scope, FP, ttl=60, lease=30)
            assert not replay.claimed and replay.record.response == RESPONSE
            with admin.cursor() as cursor:
                cursor.execute(
                    "SELECT query, calls FROM pg_stat_statements WHERE dbid = "
                    "(SELECT oid FROM pg_database WHERE datname = current_database()) "
                    "AND query NOT LIKE '%pg_stat_statements%'"
                )
                seen = dict(cursor.fetchall())
        finally:
            admin.close()
            store.engine.dispose()
        claims = {query: calls for query, calls in seen.items() if "idempotency_claim(" in query}
        assert list(claims.values()) == [2], seen
        assert not {"BEGIN", "COMMIT", "ROLLBACK"} & {q.strip().upper() for q in seen}, seen

    def test_both_paths_read_the_same_record(
        self, pg_store: SQLStore, scope: Scope, traced: bool
    ) -> None:
        new = pg_store.claim(scope, FP, ttl=60, lease=30)
        assert new.claimed and new.record.state is State.IN_PROGRESS
        assert pg_store.complete(scope, new.token, RESPONSE)
        found = pg_store.claim(scope, FP, ttl=60, lease=30)
        assert not found.claimed
        assert dataclasses.replace(found.record, now=None) == dataclasses.replace(
            pg_store.get(scope), now=None
        )
        assert found.record.response == RESPONSE
        assert found.record.created_at == new.record.created_at

    @pytest.mark.parametrize("mode", ["durable", "atomic"])
    def test_a_disconnect_renews_the_whole_pool(
        self, pg_store: SQLStore, scope: Scope, traced: bool, mode: str
    ) -> None:
        # Three pooled connections, all of them killed: the first claim fails closed, and the
        # next one must not be handed another dead connection.
        held = [pg_store.engine.connect() for _ in range(3)]
        pids = [conn.exec_driver_sql("SELECT pg_backend_pid()").scalar_one() for conn in held]
        for conn in held:
            conn.close()
        with (
            psycopg2.connect(
                _libpq(pg_store.engine.url.render_as_string(hide_password=False))
            ) as admin,
            admin.cursor() as cursor,
        ):
            cursor.execute("SELECT pg_terminate_backend(pid) FROM unnest(%s) AS pid", (pids,))
        with pytest.raises(StoreUnavailable) as info:
            _claim(pg_store, scope, mode)
        cause = info.value.__cause__
        assert isinstance(cause, sa.exc.OperationalError), repr(cause)
        assert cause.connection_invalidated
        assert scope.key not in str(cause)  # the engine hides parameters
        for _ in range(3):
            assert _claim(pg_store, scope, mode).record.scope == scope

    @pytest.mark.parametrize("mode", ["durable", "atomic"])
    def test_an_interrupted_claim_never_goes_back_to_the_pool(
        self, pg_url: str, scope: Scope, mode: str
    ) -> None:
        # KeyboardInterrupt, or gunicorn's SystemExit on a worker timeout, after the claim was
        # sent: the connection may still carry the claim's answer, so it is discarded.
        class Interrupting(cursor_class(pg_url)):  # type: ignore[misc]
            armed = True

            def execute(self, query: str, *args: t.Any, **kwargs: t.Any) -> t.Any:
                result = super().execute(query, *args, **kwargs)
                if Interrupting.armed and "FROM idempotency_claim" in query:
                    Interrupting.armed = False
                    raise KeyboardInterrupt
                return result

        engine = sa.create_engine(
            normalize_url(pg_url), connect_args={"cursor_factory": Interrupting}
        )
        store = create_store(engine)
        for variant in ("driver", "traced"):
            if variant == "traced":
                sa.event.listen(engine, "before_cursor_execute", lambda *_: None)
            with engine.connect() as conn:
                before = conn.exec_driver_sql("SELECT pg_backend_pid()").scalar_one()
            Interrupting.armed = True
            with pytest.raises(KeyboardInterrupt):
                _claim(store, scope, mode)
            with engine.connect() as conn:
                after = conn.exec_driver_sql("SELECT pg_backend_pid()").scalar_one()
            assert after != before, variant
        engine.dispose()


def _claim(store: SQLStore, scope: Scope, mode: str) -> t.Any:
    """A durable claim, or an atomic one in a transaction rolled back at once."""
    if mode == "durable":
        return store.claim(scope, FP, ttl=60, lease=30)
    connection = store.begin()
    try:
        return store.claim_atomic(connection, scope, FP, ttl=60)
    finally:
        connection.rollback()
        connection.close()


@pytest.mark.parametrize("mode", ["durable", "atomic"])
def test_handle_error_listener_sees_a_failing_claim(
    pg_url: str, scope: Scope, path: str, mode: str
) -> None:
    """A user's handle_error listener (Sentry, OpenTelemetry, custom disconnect rules)."""
    store = _store(create_engine(pg_url))
    engine = store.engine
    seen: list[str] = []

    @sa.event.listens_for(engine, "handle_error")
    def on_error(ctx: t.Any) -> None:
        seen.append(type(ctx.original_exception).__name__)

    _trace(engine, path)
    try:
        _kill_pool(engine, pg_url)
        with pytest.raises(StoreUnavailable):
            _claim(store, scope, mode)
        assert seen, f"{path}/{mode}: handle_error never called"
    finally:
        engine.dispose()


@pytest.mark.parametrize("mode", ["durable", "atomic"])
def test_failover_rule_in_handle_error_renews_the_pool(
    pg_url: str, scope: Scope, path: str, mode: str
) -> None:
    """SQLAlchemy's documented recipe for a failover: connections still pointing at the old
    primary (now read-only) are marked as disconnects in handle_error, so the pool is renewed.
    Here the first connection the pool opens is such a stale one."""
    store = _store(create_engine(pg_url))
    engine = store.engine
    opened = [0]

    @sa.event.listens_for(engine, "connect")
    def stale_first(dbapi_connection: t.Any, _rec: t.Any) -> None:
        opened[0] += 1
        if opened[0] == 1:
            ac = dbapi_connection.autocommit
            dbapi_connection.autocommit = True
            with dbapi_connection.cursor() as cur:
                cur.execute("SET default_transaction_read_only = on")
            dbapi_connection.autocommit = ac

    @sa.event.listens_for(engine, "handle_error")
    def failover(ctx: t.Any) -> None:
        if isinstance(ctx.original_exception, driver_of(pg_url).errors.ReadOnlySqlTransaction):
            ctx.is_disconnect = True

    _trace(engine, path)
    engine.dispose()  # the next connection the pool opens is the stale one
    results = []
    try:
        for i in range(5):
            s = Scope(scope.tenant, scope.endpoint, f"{scope.key[:200]}-{i}")
            try:
                _claim(store, s, mode)
                results.append("ok")
            except StoreUnavailable as exc:
                results.append(type(exc.__cause__).__name__)
    finally:
        engine.dispose()
    assert results[1:] == ["ok"] * 4, f"{path}/{mode}: {results}"


def test_an_autocommit_engine_stays_autocommit(pg_url: str, scope: Scope, path: str) -> None:
    """An application engine built with isolation_level='AUTOCOMMIT' (durable views only):
    after a claim on one of its connections, the application's own un-committed Core write on
    the same pooled connection must still be committed, as the engine promises."""
    engine = sa.create_engine(normalize_url(pg_url), isolation_level="AUTOCOMMIT", pool_size=1)
    store = _store(engine)
    _trace(engine, path)
    try:
        with engine.connect() as conn:
            conn.exec_driver_sql("CREATE TABLE IF NOT EXISTS claim_driver_writes (v text)")
            conn.exec_driver_sql("DELETE FROM claim_driver_writes")
        store.claim(scope, FP, ttl=60, lease=30)
        with engine.connect() as conn:
            conn.exec_driver_sql("INSERT INTO claim_driver_writes VALUES ('written')")
        with engine.connect() as conn:
            n = conn.exec_driver_sql("SELECT count(*) FROM claim_driver_writes").scalar_one()
        assert n == 1, f"{path}: the application's autocommit write was rolled back"
    finally:
        engine.dispose()


def test_a_checkout_listener_that_opened_a_transaction(
    pg_url: str, scope: Scope, path: str
) -> None:
    """A per-checkout SET (search_path, RLS tenant) run on the raw cursor leaves psycopg2 in a
    transaction: the claim must answer (or fail as StoreUnavailable), never a raw driver
    error (500)."""
    store = _store(create_engine(pg_url))
    engine = store.engine

    @sa.event.listens_for(engine, "checkout")
    def set_tenant(dbapi_connection: t.Any, _rec: t.Any, _proxy: t.Any) -> None:
        with dbapi_connection.cursor() as cur:
            cur.execute("SELECT set_config('app.tenant', 'alpha', false)")

    _trace(engine, path)
    try:
        # The claim needs a connection with no open transaction: it fails closed (503), every
        # time such a listener runs, never with a raw driver error (500).
        for _ in range(2):
            with pytest.raises(StoreUnavailable):
                store.claim(scope, FP, ttl=60, lease=30)
    finally:
        engine.dispose()


@pytest.mark.parametrize("mode", ["durable", "atomic"])
def test_pool_is_clean_and_quiet_after_a_disconnect(
    pg_url: str, scope: Scope, path: str, mode: str
) -> None:
    store = _store(create_engine(pg_url))
    engine = store.engine
    _trace(engine, path)
    try:
        _kill_pool(engine, pg_url, 3)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with pytest.raises(StoreUnavailable):
                _claim(store, scope, mode)
            assert engine.pool.checkedout() == 0
            for _ in range(3):
                _claim(store, scope, mode)
            assert engine.pool.checkedout() == 0
            with engine.connect() as conn:
                dbapi = conn.connection.dbapi_connection
                assert not dbapi.autocommit
                assert is_idle(dbapi)
    finally:
        engine.dispose()


def test_pre_ping_hides_a_killed_pool(pg_url: str, scope: Scope, path: str) -> None:
    store = _store(create_engine(pg_url, pool_pre_ping=True))
    engine = store.engine
    _trace(engine, path)
    try:
        _kill_pool(engine, pg_url, 2)
        assert store.claim(scope, FP, ttl=60, lease=30).claimed
    finally:
        engine.dispose()


def test_echo_logs_the_claim(pg_url: str, scope: Scope, path: str, caplog: t.Any) -> None:
    """create_engine(echo=True) / SQLALCHEMY_ECHO: is the claim in the engine's log?"""
    store = _store(create_engine(pg_url, echo=True))
    engine = store.engine
    _trace(engine, path)
    try:
        caplog.set_level("INFO", logger="sqlalchemy.engine")
        caplog.clear()
        store.claim(scope, FP, ttl=60, lease=30)
        logged = " ".join(r.getMessage() for r in caplog.records)
        assert "idempotency_claim" in logged, f"{path}: claim not echoed"
    finally:
        engine.dispose()


def test_a_class_level_listener_added_at_runtime_sees_the_claim(pg_url: str, scope: Scope) -> None:
    """SQLAlchemy's own profiling recipe listens on the Engine class, after engines exist."""
    store = _store(create_engine(pg_url))
    engine = store.engine
    seen: list[str] = []

    def record(_c: t.Any, _cur: t.Any, statement: str, *_a: t.Any) -> None:
        seen.append(statement)

    store.claim(scope, FP, ttl=60, lease=30)  # the engine's dispatch exists already
    sa.event.listen(sa.Engine, "before_cursor_execute", record)
    try:
        store.claim(
            Scope(scope.tenant, scope.endpoint, scope.key[:200] + "-2"), FP, ttl=60, lease=30
        )
    finally:
        sa.event.remove(sa.Engine, "before_cursor_execute", record)
        engine.dispose()
    assert any("idempotency_claim" in s for s in seen), seen


@pytest.mark.parametrize("mode", ["durable", "atomic"])
def test_a_backend_killed_while_the_pool_connects(
    pg_url: str, scope: Scope, path: str, mode: str
) -> None:
    """pg_terminate_backend / a restart racing a new connection: the backend dies after the
    start-up, while quiet_server_log's SET runs (a frozen server does the same through the
    deadline). The claim must fail as StoreUnavailable (503), or succeed: never a raw
    driver error or a ConfigurationError (500), and the pool must recover."""
    store = _store(create_engine(pg_url))
    engine = store.engine
    _trace(engine, path)
    engine.dispose()
    with engine.connect():
        pass  # first_connect done
    engine.dispose()
    armed = [True]

    def kill_me(dbapi_connection: t.Any, _rec: t.Any) -> None:
        if armed[0]:
            armed[0] = False
            pid = dbapi_connection.info.backend_pid
            with psycopg2.connect(_libpq(pg_url)) as admin, admin.cursor() as cur:
                cur.execute("SELECT pg_terminate_backend(%s, 2000)", (pid,))

    sa.event.listen(engine, "connect", kill_me, insert=True)
    outcomes = []
    try:
        for i in range(3):
            s = Scope(scope.tenant, scope.endpoint, f"{scope.key[:200]}-{i}")
            try:
                _claim(store, s, mode)
                outcomes.append("ok")
            except StoreUnavailable as exc:
                outcomes.append(f"503:{type(exc.__cause__).__name__}")
            except Exception as exc:  # noqa: BLE001
                outcomes.append(f"500:{type(exc).__name__}: {str(exc)[:80]}")
    finally:
        engine.dispose()
    assert not [o for o in outcomes if o.startswith("500")], outcomes
    assert outcomes[-1] == "ok", outcomes


@pytest.mark.parametrize("ending", ["commit", "rollback"])
def test_a_view_that_ends_its_own_transaction_still_completes(
    pg_url: str, path: str, ending: str
) -> None:
    """A durable view that commits (or rolls back) idem.connection() itself as its last step
    (SQLAlchemy 2.0's commit as you go): the completion then runs in the transaction
    SQLAlchemy begins next, and commits. On the driver's cursor it once ran in a transaction
    SQLAlchemy did not know of, which the pool rolled back: the record stayed in progress, and
    a ``recovery="reexecute"`` retry charged again. After its own rollback the view's 201
    stands for no row: it is never stored (500, the record ``unknown``, never in progress)."""
    from flask import Flask

    from flask_idem import Idempotency

    engine = create_engine(pg_url)
    _store(engine)
    _trace(engine, path)
    ledger = sa.Table("driver_ledger", sa.MetaData(), sa.Column("note", sa.String(32)))
    ledger.metadata.drop_all(engine)
    ledger.metadata.create_all(engine)
    app = Flask("ends-its-own")
    app.config.update(IDEMPOTENCY_ENGINE=engine, IDEMPOTENCY_LEASE=1)
    idem = Idempotency(app, tenant=lambda: "t")
    calls: list[int] = []

    @app.post("/pay")
    @idem.idempotent(recovery="reexecute")
    def pay() -> tuple[dict[str, int], int]:
        calls.append(1)
        conn = idem.connection()
        conn.execute(ledger.insert().values(note=f"charge {len(calls)}"))
        getattr(conn, ending)()
        return {"charge": len(calls)}, 201

    client = app.test_client()
    try:
        first = client.post("/pay", json={}, headers={"Idempotency-Key": f"own-{ending}"})
        with engine.connect() as conn:
            state = conn.exec_driver_sql("SELECT state FROM idempotency_keys").scalar_one()
        if ending == "rollback":
            assert first.status_code == 500, first.get_data(as_text=True)
            assert state == "unknown", f"{path}: the failure's record was lost ({state})"
            with engine.connect() as conn:
                count = sa.select(sa.func.count()).select_from(ledger)
                assert conn.execute(count).scalar_one() == 0
            return
        assert first.status_code == 201
        assert state == "completed", f"{path}/{ending}: the completion was lost"
        time.sleep(1.2)  # past the lease: an in-progress record would be taken over
        retry = client.post("/pay", json={}, headers={"Idempotency-Key": f"own-{ending}"})
        assert retry.headers.get("Idempotent-Replayed") == "true"
        assert retry.get_json() == {"charge": 1} and calls == [1]
        with engine.connect() as conn:
            rows = conn.execute(sa.select(sa.func.count()).select_from(ledger)).scalar_one()
        assert rows == 1
    finally:
        ledger.metadata.drop_all(engine)
        engine.dispose()


def test_an_interrupted_completion_commits_nothing_and_leaves_the_pool(
    pg_url: str, scope: Scope
) -> None:
    """gunicorn's SystemExit on a worker timeout right after the completion (the call of its
    function) was sent (on the driver's cursor, in the business transaction): the connection is
    discarded, never committed or pooled again, and the record stays in progress (its lease
    then ends it)."""

    class Interrupting(cursor_class(pg_url)):  # type: ignore[misc]
        armed = True

        def execute(self, query: str, *args: t.Any, **kwargs: t.Any) -> t.Any:
            result = super().execute(query, *args, **kwargs)
            if Interrupting.armed and query.startswith("SELECT idempotency_complete("):
                Interrupting.armed = False
                raise SystemExit(1)
            return result

    engine = sa.create_engine(normalize_url(pg_url), connect_args={"cursor_factory": Interrupting})
    store = _store(engine)
    try:
        claimed = store.claim(scope, FP, ttl=60, lease=30)
        assert claimed.claimed and claimed.token is not None
        connection = store.begin()
        before = connection.exec_driver_sql("SELECT pg_backend_pid()").scalar_one()
        with pytest.raises(SystemExit):
            store.complete(
                scope,
                claimed.token,
                RESPONSE,
                connection=connection,
                created_at=claimed.record.created_at,
            )
        assert connection.invalidated, "the interrupted connection must not be reused"
        connection.close()
        with engine.connect() as conn:
            after = conn.exec_driver_sql("SELECT pg_backend_pid()").scalar_one()
        assert after != before
        record = store.get(scope)
        assert record is not None and record.state is State.IN_PROGRESS
    finally:
        engine.dispose()
