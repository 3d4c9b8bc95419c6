"""Shared fixtures: real PostgreSQL (throwaway cluster or DATABASE_URL) and SQLite stores."""

from __future__ import annotations

import os
import typing as t
from pathlib import Path

import flask
import pytest
from flask import Flask

from flask_idem import Idempotency, Scope
from flask_idem.ops.migrate import upgrade
from flask_idem.store import SQLStore

from .support import citus_cluster, debian, fsa_app, pgcluster, redis_server
from .support.helpers import Counter, store_on
from .support.sqlalchemy_paths import sqlalchemy_path  # noqa: F401 (a fixture)

DIALECTS = ("postgresql", "sqlite")


@pytest.fixture(scope="session")
def pg_server_url() -> t.Iterator[str]:
    """A PostgreSQL server: ``DATABASE_URL`` when set, else a cluster started for this run."""
    given = os.environ.get("DATABASE_URL")
    if given:
        yield given
        return
    if not pgcluster.have_server_binaries():
        pytest.exit(pgcluster.NO_SERVER, returncode=3)
    cluster = pgcluster.Cluster(pgcluster.PG_DIR / f"test-{os.getpid()}")
    try:
        cluster.start()
        yield cluster.url
    finally:
        cluster.stop()


@pytest.fixture(scope="session")
def citus_server() -> t.Iterator[citus_cluster.CitusCluster]:
    """A Citus coordinator and two workers for this run, Citus installed first when missing.

    Without Citus the tests that need it skip with one line saying why, or fail under
    ``FLASK_IDEM_REQUIRE_CITUS=1`` (CI), where a skipped Citus test would hide a regression.
    """
    try:
        citus_cluster.ensure_installed()
    except citus_cluster.CitusUnavailable as exc:
        message = f"{citus_cluster.DID_NOT_RUN}: {exc}"
        if citus_cluster.required():
            pytest.fail(f"{message} ({citus_cluster.REQUIRE_VARIABLE} is set)", pytrace=False)
        pytest.skip(message)
    cluster = citus_cluster.CitusCluster(pgcluster.PG_DIR / f"citus-{os.getpid()}")
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="session")
def redis_url() -> t.Iterator[str]:
    """A throwaway Redis server for this run (the broker of the Celery and RQ tests),
    ``redis-server`` installed first when missing.

    Without one the tests that need it skip with one line saying why, or fail under
    ``FLASK_IDEM_REQUIRE_REDIS=1`` (CI).
    """
    server = redis_server.RedisServer()
    try:
        server.start()
    except debian.NotInstallable as exc:
        message = f"{redis_server.DID_NOT_RUN}: {exc}"
        if redis_server.required():
            pytest.fail(f"{message} ({redis_server.REQUIRE_VARIABLE} is set)", pytrace=False)
        pytest.skip(message)
    try:
        yield server.url
    finally:
        server.stop()


def pytest_terminal_summary(terminalreporter: t.Any) -> None:
    """Say in one line, after the summary, that the Citus or broker tests were skipped, and
    why."""
    reasons = {
        str(report.longrepr[2]).removeprefix("Skipped: ")
        for report in terminalreporter.stats.get("skipped", [])
        if isinstance(report.longrepr, tuple)
        and any(
            reason in report.longrepr[2]
            for reason in (citus_cluster.DID_NOT_RUN, redis_server.DID_NOT_RUN)
        )
    }
    for reason in sorted(reasons):
        terminalreporter.write_line(reason, yellow=True, bold=True)


@pytest.fixture(scope="session")
def fresh_pg_database(pg_server_url: str) -> t.Iterator[t.Callable[[], str]]:
    """A factory of empty databases on the test server, all dropped at the end."""
    created: list[str] = []

    def make() -> str:
        url = pgcluster.create_database(pg_server_url)
        created.append(url)
        return url

    yield make
    for url in created:
        pgcluster.drop_database(url)


@pytest.fixture(scope="session")
def pg_url(fresh_pg_database: t.Callable[[], str]) -> str:
    """A migrated PostgreSQL database shared by the session (tables emptied per test)."""
    url = fresh_pg_database()
    upgrade(url)
    return url


@pytest.fixture(scope="session")
def sqlite_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A migrated SQLite file shared by the session (tables emptied per test)."""
    path: Path = tmp_path_factory.mktemp("sqlite") / "idem.sqlite3"
    url = f"sqlite:///{path}"
    upgrade(url)
    return url


@pytest.fixture(params=DIALECTS)
def db_url(request: pytest.FixtureRequest) -> str:
    """The URL of a migrated database, once for each dialect."""
    return str(
        request.getfixturevalue(f"{'pg' if request.param == 'postgresql' else 'sqlite'}_url")
    )


@pytest.fixture(params=DIALECTS)
def unmigrated_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A new database flask_idem's migrations never ran on, once for each dialect."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/unmigrated.sqlite3"
    return str(request.getfixturevalue("fresh_pg_database")())


@pytest.fixture
def store(db_url: str) -> t.Iterator[SQLStore]:
    """An empty store on each dialect."""
    with store_on(db_url) as store:
        yield store


@pytest.fixture
def pg_store(pg_url: str) -> t.Iterator[SQLStore]:
    """An empty PostgreSQL store."""
    with store_on(pg_url) as store:
        yield store


@pytest.fixture
def scope(request: pytest.FixtureRequest) -> Scope:
    return Scope("tenant-a", "POST /v1/payments", f"key-{request.node.name}"[:255])


@pytest.fixture
def app_factory(store: SQLStore) -> t.Callable[..., tuple[Flask, Idempotency, Counter]]:
    """Build a small payments app on the store's database with any ``IDEMPOTENCY_*`` config."""

    def make(
        *, tenant: str | None = "alpha", **config: t.Any
    ) -> tuple[Flask, Idempotency, Counter]:
        app = Flask("idem-test")
        app.config.update(TESTING=True, PROPAGATE_EXCEPTIONS=False)
        app.config.update(config)
        idem = Idempotency(store=store, tenant=lambda: flask.g.get("tenant", tenant))
        counter = Counter()

        @app.before_request
        def authenticate() -> None:
            header = flask.request.headers.get("X-Tenant")
            if header:
                flask.g.tenant = header

        idem.init_app(app)

        @app.post("/payments")
        @idem.idempotent(exclude=["client_ts"])
        def create_payment() -> t.Any:
            n = counter.bump()
            body = flask.request.get_json(silent=True) or {}
            headers = {
                "Location": f"/payments/pay_{n}",
                "Set-Cookie": f"last=pay_{n}",
                "X-Request-Id": str(n),
            }
            return flask.jsonify(id=f"pay_{n}", amount=body.get("amount")), 201, headers

        @app.get("/payments")
        def list_payments() -> t.Any:
            counter.bump()
            return flask.jsonify(data=[])

        # Touches nothing outside: it may promise that a failure committed nothing.
        @app.post("/status/<int:code>")
        @idem.idempotent(release_before_contact=True)
        def answer_status(code: int) -> t.Any:
            counter.bump()
            return flask.jsonify(code=code), code

        return app, idem, counter

    return make


@pytest.fixture
def fsa_apps() -> t.Iterator[list[Flask]]:
    """Flask-SQLAlchemy applications a test builds (``tests/support/fsa_app.py``), discarded
    after it."""
    made: list[Flask] = []
    yield made
    for app in made:
        fsa_app.discard(app)
