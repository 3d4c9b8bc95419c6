"""Archived partitions: expired ones detached into a schema of their own, dropped after its
retention, by ``flask idem maintain`` only (PostgreSQL; nothing on SQLite)."""

from __future__ import annotations

import hashlib
import json
import threading
import typing as t

import flask
import pytest
import sqlalchemy as sa

from flask_idem import Idempotency, Scope, create_store
from flask_idem.core.config import Settings
from flask_idem.core.errors import ConfigurationError
from flask_idem.core.key_digest import unkeyed
from flask_idem.core.record import Archive
from flask_idem.ops.metrics import exposition
from flask_idem.ops.migrate import upgrade
from flask_idem.store import SQLStore
from tests.support.drivers import PG_DRIVERS, spelled_for
from tests.support.helpers import partition_names, run_sql, store_on

FP = hashlib.sha256(b"request").digest()
DAY = 86400
ARCHIVE = Archive("idempotency_archive", DAY)


@pytest.fixture(scope="module")
def archive_url(fresh_pg_database: t.Callable[[], str]) -> str:
    """A database of its own: these tests detach partitions and create a schema."""
    url = fresh_pg_database()
    upgrade(url)
    return url


@pytest.fixture(params=PG_DRIVERS, ids=["psycopg2", "psycopg"])
def store(request: pytest.FixtureRequest, archive_url: str) -> t.Iterator[SQLStore]:
    """An empty store, through each driver, on a fresh migration's partitions (yesterday to
    7 days ahead) and no archive schema; archiving is left for each test to switch on."""
    with store_on(spelled_for(archive_url, request.param)) as store:
        run_sql(store, "DROP SCHEMA IF EXISTS idempotency_archive CASCADE")
        run_sql(store, "SELECT idempotency_create_partitions(7, false, 1)")
        yield store


def _yesterday(store: SQLStore) -> str:
    day = run_sql(store, "SELECT to_char((now() AT TIME ZONE 'UTC')::date - 1, 'YYYYMMDD')")
    return f"idempotency_keys_p{day[0][0]}"


def _archived(store: SQLStore) -> set[str]:
    rows = run_sql(
        store, "SELECT tablename FROM pg_tables WHERE schemaname = 'idempotency_archive'"
    )
    return {row[0] for row in rows}


def _claim_yesterday(store: SQLStore, scope: Scope, *, expired: bool) -> None:
    """A record claimed yesterday at noon, past its TTL (and its lease) or live for a week."""
    store.claim(scope, FP, ttl=60, lease=30)
    ttl = "interval '60 seconds'" if expired else "interval '8 days'"
    run_sql(
        store,
        "UPDATE idempotency_keys SET "
        "created_at = (now() AT TIME ZONE 'UTC')::date - interval '12 hours', "
        f"expires_at = (now() AT TIME ZONE 'UTC')::date - interval '12 hours' + {ttl}, "
        "lease_expires_at = (now() AT TIME ZONE 'UTC')::date - interval '12 hours' "
        "WHERE key = :key",
        key=unkeyed(scope.tenant, scope.key),
    )


def _archived_days_ago(store: SQLStore, name: str, days: int) -> None:
    """Move an archived partition's mark into the past (SQL, never sleep)."""
    then = f"(now() AT TIME ZONE 'UTC') - interval '{days} days'"
    when = run_sql(store, f"SELECT to_char({then}, 'YYYY-MM-DD\"T\"HH24:MI:SS')")[0][0]
    mark = f"flask_idem archived at {when}+00:00"
    run_sql(store, f"COMMENT ON TABLE idempotency_archive.{name} IS '{mark}'")


def test_an_expired_partition_is_detached_into_the_archive_with_its_rows(
    store: SQLStore,
) -> None:
    store.use_archive(ARCHIVE)
    scope = Scope("alpha", "POST /v1/payments", "old")
    _claim_yesterday(store, scope, expired=True)
    yesterday = _yesterday(store)

    report = store.maintain(ahead=7)

    assert report.archived == (yesterday,) and report.dropped == ()
    assert yesterday not in partition_names(store) and _archived(store) == {yesterday}
    rows = run_sql(store, f"SELECT tenant, key FROM idempotency_archive.{yesterday}")
    assert [tuple(row) for row in rows] == [("alpha", unkeyed("alpha", "old"))], (
        "the rows went with it"
    )
    assert store.get(scope) is None, "out of the hot table"
    assert store.claim(scope, FP, ttl=60, lease=30).claimed
    assert store.archived_partitions() == 1 and store.health().archived_partitions == 1
    assert store.maintain(ahead=7).archived == (), "archiving is idempotent"


def test_a_partition_with_a_live_record_is_not_archived(store: SQLStore) -> None:
    store.use_archive(ARCHIVE)
    scope = Scope("alpha", "POST /v1/payments", "live")
    _claim_yesterday(store, scope, expired=False)
    report = store.maintain(ahead=7)
    assert report.archived == () and _yesterday(store) in partition_names(store)
    assert store.get(scope) is not None


def test_archived_partitions_are_dropped_after_their_retention(store: SQLStore) -> None:
    store.use_archive(ARCHIVE)
    yesterday = _yesterday(store)
    assert store.maintain(ahead=7).archived == (yesterday,)
    kept = store.maintain(ahead=7)
    assert kept.archive_dropped == () and _archived(store) == {yesterday}, "kept a day"

    _archived_days_ago(store, yesterday, 2)
    dry = store.maintain(ahead=7, dry_run=True)
    assert dry.archive_dropped == (yesterday,) and _archived(store) == {yesterday}
    report = store.maintain(ahead=7)
    assert report.archive_dropped == (yesterday,) and _archived(store) == set()
    assert store.archived_partitions() == 0


def test_a_table_flask_idem_did_not_archive_is_never_dropped(store: SQLStore) -> None:
    store.use_archive(ARCHIVE)
    run_sql(store, "CREATE SCHEMA idempotency_archive")
    run_sql(store, "CREATE TABLE idempotency_archive.idempotency_keys_p20000101 (id int)")
    report = store.maintain(ahead=7)
    assert report.archive_dropped == ()
    assert "idempotency_keys_p20000101" in _archived(store)
    assert store.archived_partitions() == 1, "only flask_idem's own partitions count"


def test_a_name_taken_in_the_archive_leaves_the_partition_and_upkeep_goes_on(
    store: SQLStore, caplog: pytest.LogCaptureFixture
) -> None:
    """A table named like the expiring partition in the archive (an operator's copy, a
    restore): that partition stays attached with its rows, and the rest of upkeep still runs."""
    store.use_archive(ARCHIVE)
    scope = Scope("alpha", "POST /v1/payments", "old")
    _claim_yesterday(store, scope, expired=True)
    yesterday = _yesterday(store)
    run_sql(store, "CREATE SCHEMA idempotency_archive")
    run_sql(store, f"CREATE TABLE idempotency_archive.{yesterday} (copy text)")
    run_sql(store, f"INSERT INTO idempotency_archive.{yesterday} VALUES ('the operator''s')")
    run_sql(store, "CREATE TABLE idempotency_archive.idempotency_keys_p20000101 (id int)")
    _archived_days_ago(store, "idempotency_keys_p20000101", 2)

    with caplog.at_level("WARNING", logger="flask_idem"):
        report = store.maintain(ahead=7)
        again = store.maintain(ahead=7)

    assert report.archived == () and again.archived == () and report.dropped == ()
    assert report.archive_dropped == ("idempotency_keys_p20000101",), "upkeep went on"
    assert yesterday in partition_names(store) and _archived(store) == {yesterday}
    rows = run_sql(store, f"SELECT tenant, key FROM public.{yesterday}")
    assert [tuple(row) for row in rows] == [("alpha", unkeyed("alpha", "old"))], (
        "its rows stay in the hot table"
    )
    copy = run_sql(store, f"SELECT copy FROM idempotency_archive.{yesterday}")
    assert [tuple(row) for row in copy] == [("the operator's",)], "the other table untouched"
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any(f"{yesterday} stays attached" in message for message in warnings)
    assert not any("old" in message.split() for message in warnings), "no key logged"


def test_a_dry_run_archives_nothing(store: SQLStore) -> None:
    store.use_archive(ARCHIVE)
    yesterday = _yesterday(store)
    assert store.maintain(ahead=7, dry_run=True).archived == (yesterday,)
    assert yesterday in partition_names(store) and _archived(store) == set()


def test_a_busy_table_leaves_the_partition_for_the_next_run(store: SQLStore) -> None:
    """A reader holding the table makes the detach give up at once (claims queue behind a
    waiting exclusive lock), and the partition is neither archived nor dropped."""
    store.use_archive(ARCHIVE)
    yesterday = _yesterday(store)
    locked, release = threading.Event(), threading.Event()

    def hold() -> None:
        with store.engine.begin() as conn:
            conn.execute(sa.text("LOCK TABLE idempotency_keys IN ACCESS SHARE MODE"))
            locked.set()
            release.wait(30)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert locked.wait(30)
        report = store.maintain(ahead=7)
    finally:
        release.set()
        holder.join()
    assert report.archived == () and report.dropped == ()
    assert yesterday in partition_names(store)
    assert store.maintain(ahead=7).archived == (yesterday,)


def test_flask_idem_maintain_archives_and_reports_it(store: SQLStore) -> None:
    app = flask.Flask("archive")
    app.config["IDEMPOTENCY_ARCHIVE_RETENTION"] = 7 * DAY
    Idempotency(app, store=store, tenant=lambda: "alpha")
    yesterday = _yesterday(store)
    runner = app.test_cli_runner()

    dry = runner.invoke(args=["idem", "maintain", "--dry-run", "--json"])
    assert dry.exit_code == 0, dry.output
    assert json.loads(dry.stdout)["archived"] == [yesterday]
    done = runner.invoke(args=["idem", "maintain"])
    assert done.exit_code == 0, done.output
    assert f"archived 1 partition: {yesterday}\n" in done.stdout
    assert "dropped 0 partitions from the archive\n" in done.stdout
    assert "idempotency_archived_partitions 1.0" in exposition(store, None).decode()


def test_without_an_archive_the_metric_is_absent(store: SQLStore) -> None:
    assert store.archived_partitions() is None
    assert "idempotency_archived_partitions" not in exposition(store, None).decode()


def test_on_sqlite_archiving_does_nothing(sqlite_url: str) -> None:
    """SQLite has one plain table: expired rows are deleted as before, nothing is archived."""
    store = create_store(sqlite_url)
    try:
        app = flask.Flask("archive-sqlite")
        app.config["IDEMPOTENCY_ARCHIVE_RETENTION"] = DAY
        Idempotency(app, store=store, tenant=lambda: "alpha")
        done = app.test_cli_runner().invoke(args=["idem", "maintain", "--json"])
        assert done.exit_code == 0, done.output
        dumped = json.loads(done.stdout)
        assert dumped["dialect"] == "sqlite" and "archived" not in dumped
        assert store.archived_partitions() is None
    finally:
        store.engine.dispose()


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"IDEMPOTENCY_ARCHIVE_RETENTION": 60}, "at least 3600"),
        ({"IDEMPOTENCY_ARCHIVE_RETENTION": "soon"}, "must be a number"),
        (
            {"IDEMPOTENCY_ARCHIVE_RETENTION": DAY, "IDEMPOTENCY_ARCHIVE_SCHEMA": "Archive; DROP"},
            "lowercase SQL name",
        ),
        ({"IDEMPOTENCY_ARCHIVE_RETENTION": DAY, "IDEMPOTENCY_ARCHIVE_SCHEMA": "pg_x"}, "not pg_"),
    ],
)
def test_bad_archive_settings_are_refused(config: dict[str, t.Any], message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        Settings.from_mapping(config)


def test_archiving_is_off_by_default() -> None:
    assert Settings.from_mapping({}).archive is None
    settings = Settings.from_mapping({"IDEMPOTENCY_ARCHIVE_RETENTION": DAY})
    assert settings.archive == Archive("idempotency_archive", DAY)
