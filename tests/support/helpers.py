"""Helpers the tiers share: counting view runs and SQL statements, moving a record in time."""

from __future__ import annotations

import contextlib
import threading
import typing as t

import sqlalchemy as sa

from flask_idem.testing import age_record

#: Move the scope's record into the past (SQL, never sleep: the store reads the database clock).
shift = age_record


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
