"""``flask idem check`` on migrated, unmigrated and degraded databases, on both dialects."""

from __future__ import annotations

import json
import typing as t

import flask
import pytest
import sqlalchemy as sa
from click.testing import Result

from flask_idem import Idempotency, create_store
from flask_idem.ops.migrate import upgrade
from flask_idem.store import PostgresStore, SQLStore, normalize_url
from flask_idem.store.expected_functions import EXPECTED_FUNCTIONS
from tests.store.test_migrations import HEAD

HINT = "run `flask idem db upgrade` (or `flask db upgrade heads` with Flask-Migrate)"
SESSION_CHECKS = ["statement_timeout", "lock_timeout", "isolation", "log_min_error_statement"]


def _check(store: SQLStore, *args: str, **config: t.Any) -> Result:
    app = flask.Flask("check")
    app.config.update(config)
    Idempotency(app, store=store, tenant=lambda: "alpha")
    return app.test_cli_runner().invoke(args=["idem", "check", *args])


def _lines(result: Result) -> dict[str, tuple[str, str]]:
    """check name -> (status, detail), in the printed order."""
    lines = {}
    for line in result.stdout.splitlines():
        status, rest = line.split(maxsplit=1)
        name, detail = rest.split(": ", 1)
        lines[name] = (status, detail)
    return lines


@pytest.fixture
def unmigrated_store(unmigrated_url: str) -> t.Iterator[SQLStore]:
    store = create_store(unmigrated_url)
    yield store
    store.engine.dispose()


@pytest.fixture
def migrated_store(unmigrated_store: SQLStore) -> SQLStore:
    upgrade(unmigrated_store.engine.url)
    return unmigrated_store


def test_a_migrated_database_passes_every_check(migrated_store: SQLStore) -> None:
    result = _check(migrated_store)
    assert result.exit_code == 0, result.output
    lines = _lines(result)
    expected = ["database", "schema"]
    if migrated_store.dialect == "postgresql":
        expected += ["functions", *SESSION_CHECKS, "partitions"]
    assert list(lines) == expected
    assert {status for status, _ in lines.values()} == {"ok"}, result.stdout
    assert lines["schema"][1] == f"at {HEAD}, the head (flask_idem_alembic_version)"
    if migrated_store.dialect == "postgresql":
        installed = f"all {len(EXPECTED_FUNCTIONS)} as this flask_idem's migrations install them"
        assert lines["functions"][1] == installed
        assert lines["isolation"][1] == "read committed"
        assert lines["statement_timeout"][1] == lines["lock_timeout"][1] == "4s"
        assert lines["log_min_error_statement"][1] == "panic"
        assert lines["partitions"][1].endswith(
            "is current, 7 ahead (IDEMPOTENCY_PARTITIONS_AHEAD = 7)"
        )
    answer = json.loads(_check(migrated_store, "--json").stdout)
    assert answer["ok"] is True
    assert [item["check"] for item in answer["checks"]] == expected


def test_an_unmigrated_database_fails_saying_how_to_migrate(unmigrated_store: SQLStore) -> None:
    result = _check(unmigrated_store)
    assert result.exit_code == 1, result.output
    lines = _lines(result)
    assert lines["database"][0] == "ok"
    assert lines["schema"] == ("error", f"flask_idem's tables are not migrated: {HINT}")
    assert "partitions" not in lines, "nothing to look at before the migration"
    answer = json.loads(_check(unmigrated_store, "--json").stdout)
    assert answer["ok"] is False
    assert {"check": "schema", "status": "error", "detail": lines["schema"][1]} in (
        answer["checks"]
    )


def test_a_schema_older_or_newer_than_the_package(unmigrated_store: SQLStore) -> None:
    upgrade(unmigrated_store.engine.url, "0005")
    older = _check(unmigrated_store)
    assert older.exit_code == 1
    assert _lines(older)["schema"] == (
        "error",
        f"at 0005, older than this flask_idem's head {HEAD}: {HINT}",
    )
    with unmigrated_store.engine.begin() as conn:
        conn.execute(sa.text("UPDATE flask_idem_alembic_version SET version_num = '0099'"))
    assert "functions" not in _lines(older), "the schema finding already says to upgrade"
    newer = _check(unmigrated_store)
    assert newer.exit_code == 0, "a newer release's schema may serve this one (rolling deploy)"
    status, detail = _lines(newer)["schema"]
    assert status == "warning" and "0099, a revision this flask_idem does not know" in detail
    assert "functions" not in _lines(newer), "a newer release's functions are its own"


def test_functions_changed_outside_the_migrations(fresh_pg_database: t.Callable[[], str]) -> None:
    """Guards deploys against a head schema whose claim was edited by hand: the check fails,
    naming the function, and not one it left alone."""
    url = fresh_pg_database()
    upgrade(url)
    store = create_store(url)
    reserve = next(f.signature for f in EXPECTED_FUNCTIONS if "claim_reserve(" in f.signature)
    try:
        with store.engine.begin() as conn:
            definition = conn.execute(
                sa.text("SELECT pg_get_functiondef(to_regprocedure(:f))"), {"f": reserve}
            ).scalar_one()
            edited = definition.replace("'4s'", "'5s'", 1)
            conn.exec_driver_sql(edited, execution_options={"no_parameters": True})
        result = _check(store)
        assert result.exit_code == 1, result.output
        status, detail = _lines(result)["functions"]
        assert status == "error"
        assert detail.startswith(f"{reserve} changed: not as this flask_idem's head revision")
        assert "idempotency_claim(" not in detail
    finally:
        store.engine.dispose()


def test_partitions_for_now_and_ahead(fresh_pg_database: t.Callable[[], str]) -> None:
    url = fresh_pg_database()
    upgrade(url)
    store = create_store(url)
    assert isinstance(store, PostgresStore)
    try:
        wanted = _check(store, IDEMPOTENCY_PARTITIONS_AHEAD=9)
        assert wanted.exit_code == 0, "a partition fewer than wanted still serves"
        status, detail = _lines(wanted)["partitions"]
        assert status == "warning" and "only 7 ahead (IDEMPOTENCY_PARTITIONS_AHEAD = 9)" in detail
        assert "flask idem maintain" in detail

        current = store.current_partition()
        assert current is not None
        with store.engine.begin() as conn:
            conn.execute(sa.text(f"DROP TABLE {current}"))
        missing = _check(store)
        assert missing.exit_code == 1
        status, detail = _lines(missing)["partitions"]
        assert status == "error" and "they land in DEFAULT" in detail
        assert "flask idem maintain" in detail
    finally:
        store.engine.dispose()


def test_session_settings_the_store_relies_on(pg_url: str) -> None:
    engine = sa.create_engine(normalize_url(pg_url), isolation_level="SERIALIZABLE")
    store = create_store(engine)

    @sa.event.listens_for(engine, "connect")
    def as_without_the_grant(dbapi_connection: t.Any, _record: t.Any) -> None:
        # What a role that may not set it keeps (flask_idem's own SET came first).
        with dbapi_connection.cursor() as cursor:
            cursor.execute("SET log_min_error_statement = error")

    try:
        result = _check(store)
        assert result.exit_code == 1, "claims refuse SERIALIZABLE: every request would be 503"
        lines = _lines(result)
        for name in ("statement_timeout", "lock_timeout"):
            assert lines[name][0] == "warning" and lines[name][1].startswith("0, no bound")
        status, detail = lines["isolation"]
        assert status == "error" and "transactions run at serializable" in detail
        status, detail = lines["log_min_error_statement"]
        assert status == "warning" and "GRANT SET ON PARAMETER" in detail
    finally:
        engine.dispose()


def test_an_unreachable_database_is_one_error(unmigrated_url: str) -> None:
    broken = create_store(
        "sqlite:////nonexistent-dir/for/sure/idem.sqlite3"
        if unmigrated_url.startswith("sqlite")
        else "postgresql://nobody@127.0.0.1:1/none"
    )
    try:
        result = _check(broken)
        assert result.exit_code == 1
        assert _lines(result) == {
            "database": ("error", "idempotency store failed: OperationalError")
        }
    finally:
        broken.engine.dispose()
