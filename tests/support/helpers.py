"""Helpers the tiers share: empty stores and business tables, raw SQL and the partitions it
sees, counting view runs and SQL statements, moving a record in time."""

from __future__ import annotations

import contextlib
import threading
import time
import typing as t

import sqlalchemy as sa

from flask_idem.store import SQLStore, create_store
from flask_idem.testing import age_record, empty_store

T = t.TypeVar("T")

#: Move the scope's record into the past (SQL, never sleep: the store reads the database clock).
shift = age_record


@contextlib.contextmanager
def store_on(url: str) -> t.Iterator[SQLStore]:
    """An empty store on ``url`` for the block, emptied again and its engine disposed after it
    (no connection stays checked out)."""
    store = create_store(url)
    empty_store(store)
    yield store
    empty_store(store)
    store.engine.dispose()


def run_sql(store: SQLStore, statement: str, **params: t.Any) -> list[sa.Row[t.Any]]:
    """Run ``statement`` on the store's engine in a transaction of its own, committed: its
    rows, or none for a statement that returns none."""
    with store.engine.begin() as conn:
        result = conn.execute(sa.text(statement), params)
        return list(result.all()) if result.returns_rows else []


def record_count(store: SQLStore) -> int:
    """How many records the store's table holds (every tenant, every partition)."""
    with store.engine.connect() as conn:
        return int(conn.exec_driver_sql("SELECT count(*) FROM idempotency_keys").scalar_one())


def partition_names(store: SQLStore) -> set[str]:
    """The names of the partitions attached to ``idempotency_keys`` (PostgreSQL)."""
    rows = run_sql(
        store,
        "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
        "WHERE i.inhparent = 'idempotency_keys'::regclass",
    )
    return {str(row[0]) for row in rows}


@contextlib.contextmanager
def with_tables(store: SQLStore, *tables: sa.Table) -> t.Iterator[SQLStore]:
    """``store`` with business ``tables`` (a view's writes through ``idem.connection()``)
    created in its database for the block, dropped after it."""
    for table in tables:
        table.metadata.create_all(store.engine)
    yield store
    for table in tables:
        table.metadata.drop_all(store.engine)


def count_statements(engine: sa.Engine) -> t.ContextManager[list[str]]:
    """Collect every SQL statement the engine sends while the block runs."""
    return _sent(engine, lambda statement, _parameters: statement)


def bound_parameters(engine: sa.Engine) -> t.ContextManager[list[t.Any]]:
    """Collect the driver parameters of every statement the engine sends while the block
    runs."""
    return _sent(engine, lambda _statement, parameters: parameters)


@contextlib.contextmanager
def _sent(engine: sa.Engine, pick: t.Callable[[str, t.Any], T]) -> t.Iterator[list[T]]:
    seen: list[T] = []

    def record(_conn: t.Any, _cursor: t.Any, statement: str, parameters: t.Any, *_: t.Any) -> None:
        seen.append(pick(statement, parameters))

    sa.event.listen(engine, "before_cursor_execute", record)
    try:
        yield seen
    finally:
        sa.event.remove(engine, "before_cursor_execute", record)


def wait_until(condition: t.Callable[[], t.Any], what: str, timeout: float = 15) -> None:
    """Poll ``condition`` until it holds; fail saying ``what`` was awaited after ``timeout``
    seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


class Counter:
    """Counts view executions: the property every idempotency test is about."""

    def __init__(self) -> None:
        self.calls = 0
        self.lock = threading.Lock()

    def bump(self) -> int:
        with self.lock:
            self.calls += 1
            return self.calls


#: The lookup of a scope's live completed record as releases before revision 0014 sent it.
_FIND_COMPLETED_AS_TEXT = (
    "SELECT false AS claimed, k.fingerprint, k.state::text AS state,"
    " k.claim_token::text AS claim_token, k.lease_expires_at, k.response_status,"
    " k.response_headers, k.response_body, k.created_at, k.completed_at, k.expires_at,"
    " clock_timestamp() AS db_now FROM idempotency_keys AS k"
    " WHERE k.tenant = %(tenant)s AND k.endpoint = %(endpoint)s AND k.key = %(key)s"
    " AND k.state = 'completed' AND (k.expires_at > clock_timestamp()"
    " OR coalesce(k.completed_at, k.lease_expires_at, k.created_at)"
    " + (k.expires_at - k.created_at) > clock_timestamp())"
    " ORDER BY k.created_at DESC LIMIT 1"
)


@contextlib.contextmanager
def statements_before_0014(store: SQLStore) -> t.Iterator[None]:
    """The PostgreSQL store sends, for the block, the statements of releases before revision
    0014 instead of calling its functions: to write and read records under an earlier
    revision's schema, which has none of them."""
    from flask_idem.store import postgresql
    from flask_idem.store.sql import Precompiled

    if store.engine.dialect.name != "postgresql":
        yield
        return
    names = ("_complete_statement", "_insert_completed_statement")
    as_text = {
        name: Precompiled(getattr(store, name).statement, store.engine.dialect) for name in names
    }
    find = postgresql._FIND_COMPLETED
    store.__dict__.update(as_text)
    postgresql._FIND_COMPLETED = _FIND_COMPLETED_AS_TEXT
    try:
        yield
    finally:
        postgresql._FIND_COMPLETED = find
        for name in names:
            store.__dict__.pop(name, None)
