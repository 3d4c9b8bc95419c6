"""Testing kit for applications that use flask_idem.

* ``IDEMPOTENCY_ENABLED = False`` in a test configuration runs every view and job unprotected
  (no claim, no database needed), for unit tests of the views themselves.
* :func:`ready_store` gives a migrated store on SQLite (a temporary file) or on the test's
  PostgreSQL, emptied afterwards; the pytest plugin (:mod:`flask_idem.testing.plugin`, loaded
  automatically once flask-idem is installed) wraps it as the ``idem_store`` fixture, and its
  database as ``idem_database_url``.
* :func:`count_runs` and :func:`assert_ran_once` check the property that matters: retries of
  one request ran the view once and got the first answer back.
* :class:`flask_idem.testing.contract.StoreContract` is the store contract suite, for authors
  of a custom store (:class:`~flask_idem.RequestStore`, :class:`~flask_idem.Store`).

Nothing here is imported by ``import flask_idem``; only the contract and the plugin need pytest.
"""

from __future__ import annotations

import contextlib
import dataclasses
import secrets
import tempfile
import typing as t

import sqlalchemy as sa
from flask import Flask

from ..core import signals
from ..core.config import EXTENSION_NAME
from ..core.record import Scope
from ..core.wire import KEY_HEADER, REPLAYED_HEADER
from ..ops.migrate import upgrade
from ..store import RequestStore, SQLStore, create_store
from ..store.table import AUDIT_TABLE_NAME, TABLE_NAME

if t.TYPE_CHECKING:
    from flask.testing import FlaskClient
    from werkzeug.test import TestResponse

__all__ = [
    "Runs",
    "age_record",
    "assert_ran_once",
    "count_runs",
    "empty_store",
    "ready_store",
]


@contextlib.contextmanager
def ready_store(url: str | sa.URL | None = None, *, migrate: bool = True) -> t.Iterator[SQLStore]:
    """A store on a migrated database, emptied and disposed of afterwards.

    :param url: the test's database (PostgreSQL or SQLite); None: a SQLite file in a temporary
        directory, removed afterwards.
    :param migrate: run flask_idem's migrations first (a no-op on a database at head).
    """
    with contextlib.ExitStack() as stack:
        if url is None:
            directory = stack.enter_context(tempfile.TemporaryDirectory(prefix="flask-idem-"))
            url = f"sqlite:///{directory}/idem.sqlite3"
        if migrate:
            upgrade(url)
        store = create_store(url)
        stack.callback(store.engine.dispose)
        empty_store(store)
        try:
            yield store
        finally:
            empty_store(store)


def empty_store(store: RequestStore) -> None:
    """Delete every record (between tests; the schema stays)."""
    tables = [TABLE_NAME, AUDIT_TABLE_NAME]
    with store.engine.begin() as conn:
        if store.engine.dialect.name == "postgresql":
            conn.exec_driver_sql(f"TRUNCATE {', '.join(tables)}")
        else:
            for name in tables:
                conn.exec_driver_sql(f"DELETE FROM {name}")


def age_record(store: RequestStore, scope: Scope, seconds: float, *columns: str) -> None:
    """Move a record of a SQL store ``seconds`` into the past (its creation, expiry, lease and
    completion, or only ``columns``). Stores read the database clock: never ``sleep``."""
    columns = columns or ("created_at", "expires_at", "lease_expires_at", "completed_at")
    if store.engine.dialect.name == "postgresql":
        # In UTC timestamps, whose arithmetic is immutable: Citus refuses a STABLE operator
        # (timestamptz - interval) applied to a column in an UPDATE.
        moved = {
            c: f"timezone('UTC', timezone('UTC', {c}) - make_interval(secs => {float(seconds)}))"
            for c in columns
        }
    else:
        moved = {
            c: f"strftime('%Y-%m-%d %H:%M:%f', {c}, '{-float(seconds):+f} seconds') || '000'"
            for c in columns
        }
    assignments = ", ".join(f"{c} = {expr}" for c, expr in moved.items())
    with store.engine.begin() as conn:
        # The key as the store digested it (every listed secret's form, during a rotation).
        statement = sa.text(
            f"UPDATE {TABLE_NAME} SET {assignments} "  # noqa: S608
            "WHERE tenant = :tenant AND endpoint = :endpoint AND key IN :keys"
        ).bindparams(sa.bindparam("keys", expanding=True))
        keys = store.keys.candidates(scope.tenant, scope.key)
        conn.execute(
            statement, {"tenant": scope.tenant, "endpoint": scope.endpoint, "keys": list(keys)}
        )


@dataclasses.dataclass
class Runs:
    """Executions of protected views and jobs (claims granted), as :func:`count_runs` saw
    them: one entry per run, its endpoint (``"POST /v1/payments"``, ``"JOB <name>"``)."""

    endpoints: list[str] = dataclasses.field(default_factory=list)

    @property
    def count(self) -> int:
        return len(self.endpoints)


@contextlib.contextmanager
def count_runs(app: Flask) -> t.Iterator[Runs]:
    """Count the executions of ``app``'s protected views and jobs while the block runs.

    A run is a granted claim (the ``claimed`` signal): a first attempt, or a takeover that
    re-runs an unknown outcome. A replay, a 409 or a 422 is no run.
    """
    runs = Runs()

    def seen(_sender: t.Any, *, endpoint: str, **_: t.Any) -> None:
        runs.endpoints.append(endpoint)

    signals.claimed.connect(seen, app)
    try:
        yield runs
    finally:
        signals.claimed.disconnect(seen, app)


def assert_ran_once(
    client: FlaskClient,
    path: str,
    *,
    method: str = "POST",
    key: str | None = None,
    times: int = 3,
    header: str | None = None,
    **request: t.Any,
) -> list[TestResponse]:
    """Send one request ``times`` times with one key; assert that the view ran once and that
    every retry got the first answer back, byte for byte, marked ``Idempotent-Replayed``.

    ::

        responses = assert_ran_once(client, "/payments", json={"amount": 100})
        assert responses[0].status_code == 201

    :param key: the idempotency key (default: a new random one).
    :param header: the header that carries it (default: the app's ``IDEMPOTENCY_HEADER``).
    :param request: more arguments of :meth:`client.open <werkzeug.test.Client.open>`
        (``json=``, ``headers=``...).
    :returns: the responses, the first one first.
    """
    if times < 2:
        raise ValueError("a retry needs at least two requests")
    app = client.application
    key = key or f"test-{secrets.token_hex(8)}"
    state = app.extensions.get(EXTENSION_NAME)  # the parsed settings, when init_app ran
    header = header or (KEY_HEADER if state is None else state.settings.header)
    headers = {**dict(request.pop("headers", {}) or {}), header: key}
    with count_runs(app) as runs:
        responses = [
            client.open(path, method=method, headers=headers, **request) for _ in range(times)
        ]
    first, retries = responses[0], responses[1:]
    assert runs.count == 1, (
        f"the view ran protected {runs.count} times for {times} requests, not once"
        + (" (is it protected? an unprotected view never claims)" if not runs.count else "")
    )
    assert REPLAYED_HEADER not in first.headers, "the first request was a replay"
    for number, retry in enumerate(retries, start=2):
        assert retry.headers.get(REPLAYED_HEADER) == "true", (
            f"request {number} was not replayed (status {retry.status_code})"
        )
        assert retry.status_code == first.status_code, (
            f"request {number}: {retry.status_code}, first: {first.status_code}"
        )
        assert retry.get_data() == first.get_data(), f"request {number}: another body"
    return responses
