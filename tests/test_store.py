"""The store contract (:mod:`flask_idem.testing.contract`) on PostgreSQL and SQLite, and what
only SQL stores promise: the database clock, failures as ``StoreUnavailable``, round trips."""

from __future__ import annotations

import dataclasses
import io
import typing as t

import psycopg2
import psycopg2.extensions
import psycopg2.extras
import pytest
import sqlalchemy as sa

from flask_idem import Scope, State, StoredResponse, StoreUnavailable, create_store
from flask_idem.migrate import upgrade
from flask_idem.store import SQLStore, create_engine, normalize_url
from flask_idem.testing.contract import FP, RESPONSE, StoreContract

from .conftest import count_statements


class TestSQLStores(StoreContract):
    """The exported contract, on each dialect (``store`` comes from conftest)."""


def test_times_come_from_the_database_clock(store: SQLStore, scope: Scope) -> None:
    record = store.claim(scope, FP, ttl=60, lease=30).record
    with store.engine.connect() as conn:
        if store.dialect == "postgresql":
            db_now = conn.execute(sa.text("SELECT now()")).scalar_one()
        else:
            db_now = conn.execute(sa.text("SELECT datetime('now')")).scalar_one()
    assert abs((record.now - record.created_at).total_seconds()) < 1
    assert str(db_now)[:13] == record.now.strftime("%Y-%m-%d %H")[:13]


def test_unreachable_database_raises_store_unavailable(db_url: str, scope: Scope) -> None:
    if db_url.startswith("sqlite"):
        broken = create_store("sqlite:////nonexistent-dir/for/sure/idem.sqlite3")
    else:
        broken = create_store("postgresql://nobody@127.0.0.1:1/none")
    for call in (
        lambda: broken.claim(scope, FP, ttl=60, lease=30),
        lambda: broken.get(scope),
        lambda: broken.complete(scope, "0" * 32, RESPONSE),
        lambda: broken.release(scope, "0" * 32),
        lambda: broken.maintain(ahead=1),
    ):
        with pytest.raises(StoreUnavailable):
            call()
    broken.engine.dispose()


def test_a_value_the_completion_cannot_bind_fails_closed(store: SQLStore, scope: Scope) -> None:
    # The completion is sent precompiled: a bind processor's failure (a header value JSON
    # cannot encode) is a store failure, as through SQLAlchemy's own execution, and the
    # record stays in progress, never half written.
    token = store.claim(scope, FP, ttl=60, lease=30).token
    unencodable = StoredResponse(201, (("Location", object()),), b"{}")  # type: ignore[arg-type]
    with pytest.raises(StoreUnavailable):
        store.complete(scope, token, unencodable)
    assert store.get(scope).state is State.IN_PROGRESS  # type: ignore[union-attr]
    assert store.complete(scope, token, RESPONSE)


def test_missing_schema_raises_store_unavailable(tmp_path: object, scope: Scope) -> None:
    empty = create_store(f"sqlite:///{tmp_path}/empty.sqlite3")
    with pytest.raises(StoreUnavailable):
        empty.claim(scope, FP, ttl=60, lease=30)
    empty.engine.dispose()


class TestRoundTrips:
    """The SQL budget on PostgreSQL, counted at the driver (every statement is a round trip)."""

    def test_claim_is_one_statement_new_or_existing(self, pg_store: SQLStore, scope: Scope) -> None:
        with count_statements(pg_store.engine) as new:
            token = pg_store.claim(scope, FP, ttl=60, lease=30).token
        with count_statements(pg_store.engine) as existing:
            pg_store.claim(scope, FP, ttl=60, lease=30)
        assert len(new) == 1, new
        assert len(existing) == 1, existing
        with count_statements(pg_store.engine) as complete:
            pg_store.complete(scope, token, RESPONSE)
        assert len(complete) == 1, complete
        with count_statements(pg_store.engine) as replay:
            assert pg_store.claim(scope, FP, ttl=60, lease=30).record.response == RESPONSE
        assert len(replay) == 1, replay

    def test_release_is_one_statement(self, pg_store: SQLStore, scope: Scope) -> None:
        token = pg_store.claim(scope, FP, ttl=60, lease=30).token
        with count_statements(pg_store.engine) as seen:
            assert pg_store.release(scope, token)
        assert len(seen) == 1, seen

    def test_primitives_send_no_begin_or_commit(self, pg_store: SQLStore, scope: Scope) -> None:
        # psycopg2 sends BEGIN before, and the pool COMMIT after, any statement that runs
        # outside autocommit: each would be another round trip.
        modes: list[bool] = []

        def record(conn: sa.Connection, *_args: object) -> None:
            modes.append(conn.connection.dbapi_connection.autocommit)  # type: ignore[union-attr]

        sa.event.listen(pg_store.engine, "before_cursor_execute", record)
        try:
            token = pg_store.claim(scope, FP, ttl=60, lease=30).token
            pg_store.renew(scope, token, lease=30)
            pg_store.complete(scope, token, RESPONSE)
            pg_store.claim(scope, FP, ttl=60, lease=30)
        finally:
            sa.event.remove(pg_store.engine, "before_cursor_execute", record)
        assert modes == [True, True, True, True]


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
        admin = psycopg2.connect(_libpq_url(store))
        admin.autocommit = True
        try:
            with admin.cursor() as cursor:
                try:
                    cursor.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
                except psycopg2.Error:
                    pytest.skip("pg_stat_statements is not loaded on this server")
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
        with psycopg2.connect(_libpq_url(pg_store)) as admin, admin.cursor() as cursor:
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
        class Interrupting(psycopg2.extensions.cursor):  # type: ignore[misc]
            armed = True

            def execute(self, query: str, *args: t.Any) -> t.Any:
                result = super().execute(query, *args)
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


def _libpq_url(store: SQLStore) -> str:
    return store.engine.url.set(drivername="postgresql").render_as_string(hide_password=False)


def test_errors_never_carry_keys_or_tokens(db_url: str, scope: Scope) -> None:
    store = create_store(db_url)
    try:
        token = store.claim(scope, FP, ttl=60, lease=30).token
        with store.engine.begin() as conn:
            conn.exec_driver_sql("DROP TABLE IF EXISTS idem_scratch")
        failing = sa.text("SELECT * FROM idem_scratch WHERE key = :key AND token = :token")
        with pytest.raises(sa.exc.SQLAlchemyError) as info, store.engine.connect() as conn:
            conn.execute(failing, {"key": scope.key, "token": token})
        assert scope.key not in str(info.value) and token not in str(info.value)
    finally:
        store.engine.dispose()


def test_a_silent_database_fails_within_seconds(scope: Scope) -> None:
    """A server that accepts connections but never answers: StoreUnavailable, no hang."""
    import socket
    import time

    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    silent = create_store(f"postgresql://nobody@127.0.0.1:{port}/none")
    try:
        started = time.monotonic()
        with pytest.raises(StoreUnavailable):
            silent.claim(scope, FP, ttl=60, lease=30)
        assert time.monotonic() - started < 15
    finally:
        silent.engine.dispose()
        listener.close()


def _copy_and_large_object(connection: t.Any) -> tuple[str, int, bytes]:
    """COPY both ways and a large object on a raw psycopg2 connection (then rolled back)."""
    with connection.cursor() as cursor:
        out = io.StringIO()
        cursor.copy_expert("COPY (SELECT 42) TO STDOUT", out)
        cursor.execute("CREATE TEMP TABLE idem_copy (x int)")
        cursor.copy_from(io.StringIO("1\n2\n"), "idem_copy")
        cursor.execute("SELECT count(*) FROM idem_copy")
        (copied,) = cursor.fetchone()
    written = connection.lobject(0, "wb")
    written.write(b"large")
    oid = written.oid
    written.close()
    read = connection.lobject(oid, "rb").read()
    connection.rollback()
    return out.getvalue().strip(), copied, read


@pytest.mark.postgresql
def test_the_applications_own_connections_keep_copy_and_large_objects(
    pg_store: SQLStore, pg_url: str, scope: Scope
) -> None:
    """flask_idem's deadline is no process-wide psycopg2 state (no "green" mode): COPY and
    large objects keep working on every other connection once a store exists and ran."""
    assert pg_store.claim(scope, FP, ttl=60, lease=30).claimed
    assert psycopg2.extensions.get_wait_callback() is None
    expected = ("42", 2, b"large")

    plain = psycopg2.connect(pg_url)
    try:
        assert _copy_and_large_object(plain) == expected
    finally:
        plain.close()

    own = sa.create_engine(normalize_url(pg_url))  # the application's own engine
    migrations = create_engine(pg_url, statement_timeout=None)  # flask_idem's, no deadline
    try:
        for engine in (own, migrations, pg_store.engine):
            with engine.connect() as conn:
                assert _copy_and_large_object(conn.connection.dbapi_connection) == expected
    finally:
        own.dispose()
        migrations.dispose()
    assert pg_store.get(scope) is not None, "the store still works"


@pytest.mark.postgresql
def test_store_connections_keep_every_cursor_kind(pg_store: SQLStore) -> None:
    """The deadline wraps cursor classes of the application's choice and named cursors."""
    with pg_store.engine.connect() as conn:
        raw = conn.connection.dbapi_connection
        with raw.cursor(cursor_factory=psycopg2.extras.RealDictCursor) as cursor:
            assert isinstance(cursor, psycopg2.extras.RealDictCursor)
            assert type(cursor).execute is not psycopg2.extras.RealDictCursor.execute, "bounded"
            cursor.execute("SELECT 1 AS one")
            assert cursor.fetchone() == {"one": 1}
        named = raw.cursor("idem_named")
        assert type(named).fetchmany is not psycopg2.extensions.cursor.fetchmany, "bounded"
        named.itersize = 2
        named.execute("SELECT generate_series(1, 5)")
        assert [row[0] for row in named] == [1, 2, 3, 4, 5]
        named.close()
        streamed = conn.execution_options(stream_results=True).exec_driver_sql(
            "SELECT generate_series(1, 3)"
        )
        assert [row[0] for row in streamed] == [1, 2, 3]
        conn.rollback()
