"""Helpers the tiers share: empty stores and business tables, counting view runs and SQL
statements, moving a record in time."""

from __future__ import annotations

import contextlib
import threading
import typing as t

import sqlalchemy as sa

from flask_idem.store import SQLStore, create_store
from flask_idem.testing import age_record, empty_store

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


@contextlib.contextmanager
def with_tables(store: SQLStore, *tables: sa.Table) -> t.Iterator[SQLStore]:
    """``store`` with business ``tables`` (a view's writes through ``idem.connection()``)
    created in its database for the block, dropped after it."""
    for table in tables:
        table.metadata.create_all(store.engine)
    yield store
    for table in tables:
        table.metadata.drop_all(store.engine)


@contextlib.contextmanager
def count_statements(engine: sa.Engine) -> t.Iterator[list[str]]:
    """Collect every SQL statement the engine sends while the block runs."""
    seen: list[str] = []

    def record(_conn: t.Any, _cursor: t.Any, statement: str, *_args: t.Any) -> None:
        seen.append(statement)

    sa.event.listen(engine, "before_cursor_execute", record)
    try:
        yield seen
    finally:
        sa.event.remove(engine, "before_cursor_execute", record)


class Counter:
    """Counts view executions: the property every idempotency test is about."""

    def __init__(self) -> None:
        self.calls = 0
        self.lock = threading.Lock()

    def bump(self) -> int:
        with self.lock:
            self.calls += 1
            return self.calls
