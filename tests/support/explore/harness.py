"""The real parts the explorer drives: a migrated SQLite store on a controllable clock, a Flask
app with the extension on it, a lease keeper without a thread, and a store that fails on demand.

The store's rows (and the business table's) are the only state outside Python objects: they are
read after every step and written back when the search returns to a state.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import hashlib
import logging
import sqlite3
import tempfile
import typing as t

import sqlalchemy as sa
from flask import Flask

from flask_idem import Idempotency
from flask_idem.core.record import Record
from flask_idem.lease import LeaseKeeper, Watch
from flask_idem.ops.migrate import upgrade
from flask_idem.state import AppState
from flask_idem.store import SQLiteStore, create_store
from flask_idem.store.table import TABLE_NAME

LEASE = 10.0
TTL = 100.0
START = dt.datetime(2030, 1, 1, tzinfo=dt.timezone.utc)
TENANT = "acme"
ENDPOINT = "POST /payments"
KEY = "order-1"
#: The request every client sends (one client operation): one fingerprint.
FINGERPRINT = hashlib.sha256(b"POST /payments amount=100").digest()
#: Another request under the same key (another amount): a client bug, answered 422.
OTHER_FINGERPRINT = hashlib.sha256(b"POST /payments amount=999").digest()

_metadata = sa.MetaData()
#: The application's own rows: what a payment view commits with its stored answer.
payments = sa.Table(
    "payments",
    _metadata,
    sa.Column("id", sa.Integer, primary_key=True),
    sa.Column("charge", sa.String),
    sa.Column("record_created_at", sa.String, nullable=False),
)

Rows = tuple[tuple[tuple[t.Any, ...], ...], tuple[tuple[t.Any, ...], ...]]


class SteppedKeeper(LeaseKeeper):
    """The lease keeper without its thread: the explorer renews a lease when it schedules the
    keeper (:meth:`LeaseKeeper.renew`, the thread's own renewal)."""

    def watch(self, record: Record, lease: float) -> Watch:
        return Watch(record, lease, due=0.0)


class Harness:
    """One exploration's database, store, app and clock."""

    def __init__(self, stack: contextlib.ExitStack) -> None:
        for name in ("flask_idem", "flask_idem.events"):
            # Every failure the explorer injects is logged: thousands of lines, no news.
            logger = logging.getLogger(name)
            stack.callback(setattr, logger, "disabled", logger.disabled)
            logger.disabled = True
        directory = stack.enter_context(tempfile.TemporaryDirectory(prefix="flask-idem-explore-"))
        url = f"sqlite:///{directory}/explore.sqlite3"
        upgrade(url)
        store = create_store(url)
        assert isinstance(store, SQLiteStore)
        stack.callback(store.engine.dispose)
        self.now = START
        store.use_clock(lambda: self.now)
        _metadata.create_all(store.engine)
        self.store = store
        #: Set by a step that makes the store's next statement fail (then cleared).
        self.fail_next = False
        sa.event.listen(store.engine, "before_cursor_execute", self._maybe_fail)
        self.app = Flask("explore")
        self.app.config.update(
            IDEMPOTENCY_LEASE=LEASE, IDEMPOTENCY_TTL=TTL, IDEMPOTENCY_BLUEPRINT_PREFIX=None
        )
        self.idem = Idempotency(self.app, store=store)
        with self.app.app_context():
            self.state = AppState.current()
        self.state.keeper = SteppedKeeper(store)
        self._columns = self._column_names()

    def _maybe_fail(self, conn: t.Any, cursor: t.Any, statement: str, *args: t.Any) -> None:
        # Only the store's statements: a view's business INSERT failing is the view's failure.
        if self.fail_next and TABLE_NAME in statement:
            self.fail_next = False
            raise sa.exc.OperationalError(statement, None, sqlite3.OperationalError("injected"))

    def _column_names(self) -> tuple[str, ...]:
        with self.store.engine.connect() as conn:
            result = conn.exec_driver_sql(f"SELECT * FROM {TABLE_NAME} LIMIT 0")  # noqa: S608
            return tuple(result.keys())

    def column(self, row: tuple[t.Any, ...], name: str) -> t.Any:
        return row[self._columns.index(name)]

    def read(self) -> Rows:
        """Every record and every payment row, in a fixed order."""
        with self.store.engine.connect() as conn:
            keys = conn.exec_driver_sql(f"SELECT * FROM {TABLE_NAME} ORDER BY created_at")  # noqa: S608
            records = tuple(tuple(row) for row in keys)
            paid = conn.exec_driver_sql("SELECT * FROM payments ORDER BY id")
            return records, tuple(tuple(row) for row in paid)

    def write(self, rows: Rows) -> None:
        """Put the tables back as ``rows`` says."""
        records, paid = rows
        marks = ", ".join("?" for _ in self._columns)
        with self.store.engine.begin() as conn:
            conn.exec_driver_sql(f"DELETE FROM {TABLE_NAME}")  # noqa: S608
            conn.exec_driver_sql("DELETE FROM payments")
            if records:
                conn.exec_driver_sql(f"INSERT INTO {TABLE_NAME} VALUES ({marks})", list(records))  # noqa: S608
            if paid:
                conn.exec_driver_sql("INSERT INTO payments VALUES (?, ?, ?)", list(paid))


def stamp(moment: dt.datetime) -> str:
    """A time as the SQLite store writes it (text that sorts as time does)."""
    return moment.astimezone(dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S.%f")


def parse(text: str) -> dt.datetime:
    return dt.datetime.strptime(text, "%Y-%m-%d %H:%M:%S.%f").replace(tzinfo=dt.timezone.utc)
