"""The store contract (:mod:`flask_idem.testing.contract`) on PostgreSQL and SQLite, and what
only SQL stores promise: the database clock, failures as ``StoreUnavailable``, round trips."""

from __future__ import annotations

import pytest
import sqlalchemy as sa

from flask_idem import Scope, StoreUnavailable, create_store
from flask_idem.store import SQLStore
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
