"""The store contract (:mod:`flask_idem.testing.contract`) on PostgreSQL and SQLite, and what
only SQL stores promise: the database clock, failures as ``StoreUnavailable``, round trips."""

from __future__ import annotations

import contextlib
import io
import signal
import threading
import time
import typing as t

import psycopg2
import psycopg2.extensions
import psycopg2.extras
import pytest
import sqlalchemy as sa

from flask_idem import ClaimResult, Scope, State, StoredResponse, StoreUnavailable, create_store
from flask_idem.core.sealing import Sealer
from flask_idem.store import SQLStore, create_engine, normalize_url
from flask_idem.testing import age_record, empty_store
from flask_idem.testing.contract import FP, OTHER_FP, RESPONSE, StoreContract
from tests.support.drivers import (
    db_url_on_each_driver,  # noqa: F401 (the store contract on both drivers)
    is_idle,
    spelled_for,
)
from tests.support.helpers import count_statements, store_on


@pytest.mark.usefixtures("sqlalchemy_path")
class TestSQLStores(StoreContract):
    """The exported contract, on each dialect and driver, on both of the store's paths to the
    driver (SQLAlchemy's private fast path and its public API only; ``store`` comes from
    conftest)."""


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


def _headers_are_sql_null(store: SQLStore, scope: Scope) -> bool:
    """Whether the scope's record has SQL NULL in ``response_headers`` (JSON ``null`` is not:
    it is text on SQLite and a jsonb value on PostgreSQL)."""
    with store.engine.connect() as conn:
        return bool(
            conn.execute(
                sa.text(
                    "SELECT response_headers IS NULL FROM idempotency_keys "
                    "WHERE tenant = :tenant AND endpoint = :endpoint AND key = :key"
                ),
                {
                    "tenant": scope.tenant,
                    "endpoint": scope.endpoint,
                    "key": store.keys.stored(scope.tenant, scope.key),
                },
            ).scalar_one()
        )


def test_a_sealed_snapshot_has_sql_null_headers(store: SQLStore, scope: Scope) -> None:
    """SQL tells a sealed envelope from a plain snapshot by SQL NULL in ``response_headers``
    (``flask idem keys`` counts by it), never JSON ``null``: through the
    completion on each dialect, and the atomic mode's completed insert on PostgreSQL."""
    store.use_sealer(Sealer(compress_min=64))
    sealed = StoredResponse(201, (("Content-Type", "application/json"),), b"0" * 4096)
    token = store.claim(scope, FP, ttl=60, lease=30).token
    assert store.complete(scope, token, sealed)
    assert _headers_are_sql_null(store, scope)
    plain = Scope(scope.tenant, scope.endpoint, scope.key + "-plain")
    assert store.complete(plain, store.claim(plain, FP, ttl=60, lease=30).token, RESPONSE)
    assert not _headers_are_sql_null(store, plain)
    if store.dialect == "postgresql":
        atomic = Scope(scope.tenant, scope.endpoint, scope.key + "-atomic")
        with store.engine.connect() as conn:
            conn.begin()
            claimed = store.claim_atomic(conn, atomic, FP, ttl=60)
            assert claimed is not None and claimed.reservation is not None
            assert claimed.reservation.complete(sealed)
            conn.commit()
        assert _headers_are_sql_null(store, atomic)
    for each in (scope, plain):
        record = store.get(each)
        assert record is not None and record.response == (sealed if each is scope else RESPONSE)


def _rows_of(store: SQLStore, scope: Scope) -> int:
    with store.engine.connect() as conn:
        return int(
            conn.execute(
                sa.text("SELECT count(*) FROM idempotency_keys WHERE key = :key"),
                {"key": store.keys.stored(scope.tenant, scope.key)},
            ).scalar_one()
        )


def test_the_claim_the_lookup_and_the_purge_agree_at_the_end_of_the_ttl(
    store: SQLStore, scope: Scope
) -> None:
    """Whether a record is live is decided in several statements (the claim functions, the
    lookups, the purge of old rows): a record moments before the end of its TTL, counted from
    the end of its request, is live for all of them, and moments after it, for none. It was
    claimed 40 days ago (on PostgreSQL in DEFAULT, where upkeep purges row by row)."""
    token = store.claim(scope, FP, ttl=3600, lease=30).token
    assert store.complete(scope, token, RESPONSE)
    age_record(store, scope, 40 * 86400, "created_at", "expires_at")
    age_record(store, scope, 3600 - 5, "completed_at")  # live for 5 more seconds
    assert store.get(scope) is not None, "the lookup"
    assert [r.state for r in store.find(scope.tenant, scope.key)] == [State.COMPLETED]
    assert store.maintain(ahead=7).purged == 0 and _rows_of(store, scope) == 1, "the purge"
    again = store.claim(scope, FP, ttl=3600, lease=30)
    assert not again.claimed and again.record.response == RESPONSE, "the claim"

    if store.dialect == "postgresql":
        replay = _atomic_claim(store, scope)
        assert replay is not None and not replay.claimed, "the lookup before a transaction"
        assert replay.record.response == RESPONSE

    age_record(store, scope, 10, "completed_at")  # its TTL ended 5 seconds ago
    assert store.get(scope) is None, "the lookup"
    assert store.find(scope.tenant, scope.key) == []
    if store.dialect == "postgresql":
        reserved = _atomic_claim(store, scope)
        assert reserved is not None and reserved.claimed, "the lookup before a transaction"
    fresh = store.claim(scope, OTHER_FP, ttl=3600, lease=30)
    assert fresh.claimed, "the claim"
    assert store.maintain(ahead=7).purged == 1, "the purge"
    assert _rows_of(store, scope) == 1 and store.get(scope) is not None, "the fresh one stays"


def _atomic_claim(store: SQLStore, scope: Scope, *, busy: bool = False) -> ClaimResult | None:
    """An atomic claim of ``scope`` as an atomic view makes it, in a transaction rolled back
    after it: the lookup of a completed record before the transaction (a replay: that one
    statement, asserted), else the claim in it. ``busy``: that transaction has sent a statement
    already (the lookup leaves it to the claim, asserted), and another holds the scope's lock
    (the claim reads the completed record without it)."""
    lock = (
        "SELECT pg_advisory_xact_lock(hashtext('flask_idem'),"
        " hashtext(:tenant || E'\\x1f' || :endpoint || E'\\x1f' || :key))"
    )
    stored = {
        "tenant": scope.tenant,
        "endpoint": scope.endpoint,
        "key": store.keys.stored(scope.tenant, scope.key),
    }
    with contextlib.ExitStack() as stack:
        if busy:
            holder = stack.enter_context(store.engine.begin())
            holder.execute(sa.text(lock), stored)
        connection = stack.enter_context(store.engine.connect())
        connection.begin()
        if busy:
            connection.exec_driver_sql("SELECT 1")
        with count_statements(store.engine) as seen:
            completed = store.completed_before_claim(scope, connection)
        if completed is not None:
            assert not busy
            assert len(seen) == 1 and "idempotency_find_completed(" in seen[0], seen
            result: ClaimResult | None = ClaimResult(completed, claimed=False)
        else:
            assert seen == [] if busy else len(seen) == 1, seen
            result = store.claim_atomic(connection, scope, FP, ttl=3600)
        connection.rollback()
    return result


@pytest.mark.parametrize(
    "seconds",
    [0, 86400, 40 * 86400, -3600],
    ids=["today", "yesterday", "default-partition", "an-hour-ahead"],
)
def test_an_atomic_replay_finds_its_record_in_every_partition(
    pg_store: SQLStore, scope: Scope, seconds: int
) -> None:
    """The lookup of a completed record (before an atomic request's transaction, and by a
    claim that found the scope's lock held: migration 0014's function) finds it in any
    partition that can hold a live one: today's, yesterday's, DEFAULT (a day with no
    partition), and one dated after the database's clock (a clock stepped back)."""
    token = pg_store.claim(scope, FP, ttl=60 * 86400, lease=30).token
    assert pg_store.complete(scope, token, RESPONSE)
    age_record(pg_store, scope, seconds)
    for busy in (False, True):
        found = _atomic_claim(pg_store, scope, busy=busy)
        assert found is not None and not found.claimed, busy
        assert found.record.response == RESPONSE


def test_an_atomic_claim_after_a_commit_sent_as_sql_still_claims(pg_url: str, scope: Scope) -> None:
    """A hook that ended the business connection's transaction with a ``COMMIT`` sent as SQL
    leaves the server idle and psycopg2 believing a transaction is open. The lookup before the
    claim puts the driver back in step and finds the record in autocommit, and the claim on
    that connection answers as it always did (never a driver error escaping as a 500)."""
    with store_on(pg_url) as store:
        token = store.claim(scope, FP, ttl=60, lease=30).token
        assert store.complete(scope, token, RESPONSE)
        connection = store.begin()
        try:
            connection.exec_driver_sql("SELECT 1")
            connection.exec_driver_sql("COMMIT")
            found = store.completed_before_claim(scope, connection)
            assert found is not None and found.response == RESPONSE
            assert connection.connection.dbapi_connection.info.transaction_status == 0, "idle"
            claimed = store.claim_atomic(connection, scope, FP, ttl=60)
            assert claimed is not None and not claimed.claimed
        finally:
            connection.rollback()
            connection.close()


def test_the_lookup_before_the_transaction_gives_up_on_a_locked_table(
    pg_url: str, scope: Scope
) -> None:
    """The lookup of a completed record runs before the claim, which bounds its own wait (4 s)
    where the session has no timeouts (an application's engine, a pooler): it bounds its own
    too, so a table locked by DDL answers 503, never a wait without end."""
    store = create_store(sa.create_engine(normalize_url(pg_url)))  # no session timeouts
    try:
        token = store.claim(scope, FP, ttl=60, lease=30).token
        assert store.complete(scope, token, RESPONSE)
        with store.engine.connect() as locker, store.engine.connect() as connection:
            locker.exec_driver_sql("LOCK TABLE idempotency_keys IN ACCESS EXCLUSIVE MODE")
            # Released after 10 s whatever happens: an unbounded wait then finds the record.
            release = threading.Timer(10, locker.rollback)
            release.start()
            started = time.monotonic()
            try:
                connection.begin()
                with pytest.raises(StoreUnavailable):
                    store.completed_before_claim(scope, connection)
                assert time.monotonic() - started < 8
            finally:
                release.cancel()
                locker.rollback()
    finally:
        store.engine.dispose()


@pytest.mark.parametrize("reset", ["rollback", None], ids=["reset", "no-reset"])
@pytest.mark.parametrize("mode", ["durable", "atomic"])
def test_a_statement_interrupted_in_autocommit_never_goes_back_to_the_pool(
    pg_url: str, scope: Scope, mode: str, reset: str | None
) -> None:
    """An exception raised by a signal handler (an app's request timeout) while a statement
    sent in autocommit waits on the server (a table lock held elsewhere): psycopg 3 then
    refuses to leave autocommit, its statement still running. The durable claim, and the
    lookup before an atomic claim, answer StoreUnavailable (503, never a driver error as a
    500), and the connection is discarded: the pool never hands it out again in autocommit or
    mid-statement, also with no reset on return."""

    class RequestTimeout(Exception):
        pass

    def timeout(*_: object) -> None:
        raise RequestTimeout

    url = spelled_for(pg_url, "postgresql+psycopg")
    engine = sa.create_engine(
        normalize_url(url), pool_size=1, max_overflow=0, pool_reset_on_return=reset
    )
    store = create_store(engine)
    empty_store(store)
    previous = signal.signal(signal.SIGALRM, timeout)
    try:
        with (
            psycopg2.connect(sa.make_url(pg_url).render_as_string(hide_password=False)) as locker,
            locker.cursor() as cursor,
        ):
            cursor.execute("LOCK TABLE idempotency_keys IN ACCESS EXCLUSIVE MODE")
            signal.setitimer(signal.ITIMER_REAL, 0.3)
            with pytest.raises(StoreUnavailable):
                if mode == "durable":
                    store.claim(scope, FP, ttl=60, lease=30)
                else:
                    with engine.connect() as connection:
                        connection.begin()
                        store.completed_before_claim(scope, connection)
            signal.setitimer(signal.ITIMER_REAL, 0)
            locker.rollback()
        with engine.connect() as conn:
            dbapi_connection = conn.connection.dbapi_connection
            assert not dbapi_connection.autocommit and is_idle(dbapi_connection)
            assert conn.exec_driver_sql("SELECT 1").scalar_one() == 1
        # The server may have run the interrupted claim once its lock came free: its record is
        # then in progress, its outcome unknown to the client (a 503), and its lease ends it.
        after = Scope(scope.tenant, scope.endpoint, f"{scope.key}-after")
        assert store.claim(after, FP, ttl=60, lease=30).claimed
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        engine.dispose()


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
