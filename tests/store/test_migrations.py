"""The migration builds what table.py describes, and goes back down, on both databases; without
a URL it finds the application's database."""

from __future__ import annotations

import typing as t

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from flask import Flask
from flask_sqlalchemy import SQLAlchemy

from flask_idem import Idempotency, Scope
from flask_idem.ops.migrate import downgrade, upgrade
from flask_idem.store import create_engine, create_store, normalize_url
from flask_idem.store.table import TABLE_NAME, VERSION_TABLE, metadata
from flask_idem.testing.contract import FP, RESPONSE
from tests.support.helpers import statements_before_0014

FUNCTIONS = {
    "idempotency_claim",
    "idempotency_claim_atomic",
    "idempotency_claim_reserve",
    "idempotency_complete",
    "idempotency_complete_reserved",
    "idempotency_find_completed",
    "idempotency_commit_flushed",
    "idempotency_create_partitions",
    "idempotency_drop_expired_partitions",
    "idempotency_audit_partitions",
}


@pytest.fixture(params=["postgresql", "sqlite"])
def empty_url(request: pytest.FixtureRequest, tmp_path: t.Any) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/migrations.sqlite3"
    return str(request.getfixturevalue("fresh_pg_database")())


def _functions(engine: sa.Engine) -> set[str]:
    with engine.connect() as conn:
        rows = conn.execute(
            sa.text("SELECT proname FROM pg_proc WHERE proname LIKE 'idempotency_%'")
        )
        return {row[0] for row in rows}


def _only_our_table(obj: t.Any, name: str | None, type_: str, *_: t.Any) -> bool:
    return type_ != "table" or name == TABLE_NAME


def _only_our_table_on(dialect: str) -> t.Callable[..., bool]:
    """:func:`_only_our_table`, and on PostgreSQL without the ``expires_at`` index that
    table.py describes: there it is DEFAULT's alone (revision 0014), checked on its own."""

    def include(obj: t.Any, name: str | None, type_: str, *rest: t.Any) -> bool:
        if dialect == "postgresql" and type_ == "index" and name == EXPIRES_INDEX:
            return False
        return _only_our_table(obj, name, type_, *rest)

    return include


EXPIRES_INDEX = "ix_idempotency_keys_expires_at"
DEFAULT_EXPIRES_INDEX = "ix_idempotency_keys_default_expires_at"


#: The newest revision.
HEAD = "0014"


def test_upgrade_matches_schema_and_downgrade_removes_it(empty_url: str) -> None:
    engine = create_engine(empty_url)
    try:
        upgrade(empty_url)
        inspector = sa.inspect(engine)
        assert TABLE_NAME in inspector.get_table_names()
        assert VERSION_TABLE in inspector.get_table_names()
        assert "alembic_version" not in inspector.get_table_names(), "own version table only"
        with engine.connect() as conn:
            include = _only_our_table_on(engine.dialect.name)
            context = MigrationContext.configure(
                conn, opts={"include_object": include, "compare_type": True}
            )
            assert compare_metadata(context, metadata) == []
            assert conn.execute(sa.text(f"SELECT version_num FROM {VERSION_TABLE}")).all() == [
                (HEAD,)
            ]
            check = {c["name"]: c["sqltext"] for c in inspector.get_check_constraints(TABLE_NAME)}
            assert "'reopened'" in check["ck_idempotency_keys_state"]
        if engine.dialect.name == "postgresql":
            assert _functions(engine) == FUNCTIONS

        downgrade(empty_url)
        inspector = sa.inspect(engine)
        assert TABLE_NAME not in inspector.get_table_names()
        assert not any(name.startswith(TABLE_NAME) for name in inspector.get_table_names())
        if engine.dialect.name == "postgresql":
            assert _functions(engine) == set()

        upgrade(empty_url)
        assert TABLE_NAME in sa.inspect(engine).get_table_names()
    finally:
        engine.dispose()


def _locks_on_citus(engine: sa.Engine, function: str) -> bool:
    """Whether the installed ``function`` takes its lock on the tenant's shard on Citus."""
    with engine.connect() as conn:
        text = conn.execute(
            sa.text("SELECT prosrc FROM pg_proc WHERE proname = :name"), {"name": function}
        ).scalar_one()
    return "citus.version" in text


def test_upgrade_from_0008_keeps_records_and_atomic_claims(empty_url: str) -> None:
    """Revision 0009 only replaces the atomic claim's text: a record written under 0008 still
    answers an atomic claim of its key after the upgrade, a new key is still claimed, and the
    downgrade puts 0008's claim back."""
    upgrade(empty_url, "0008")
    store = create_store(empty_url)
    with statements_before_0014(store):
        try:
            before = Scope("tenant", "POST /p", "before-0009")
            first = store.claim(before, FP, ttl=600, lease=30)
            assert first.claimed and store.complete(before, first.record.claim_token, RESPONSE)
            upgrade(empty_url, "0009")
            with store.engine.connect() as conn:
                version = conn.execute(sa.text(f"SELECT version_num FROM {VERSION_TABLE}"))
                assert version.scalar_one() == "0009"
            for revision in ("0009", "0008"):
                connection = store.begin()
                try:
                    replay = store.claim_atomic(connection, before, FP, ttl=600)
                    assert replay is not None and not replay.claimed
                    assert replay.record.response == RESPONSE
                    new = Scope("tenant", "POST /p", f"new-under-{revision}")
                    claimed = store.claim_atomic(connection, new, FP, ttl=600)
                    assert claimed is not None and claimed.claimed
                    if claimed.reservation is None:  # SQLite: the claim wrote the record
                        token = claimed.record.claim_token
                        assert store.complete(new, token, RESPONSE, connection=connection)
                    else:
                        assert claimed.reservation.complete(RESPONSE)
                    connection.commit()
                finally:
                    connection.close()
                assert store.get(new) is not None
                if store.engine.dialect.name == "postgresql":
                    assert _locks_on_citus(store.engine, "idempotency_claim_reserve") is (
                        revision == "0009"
                    )
                    downgrade(empty_url, "0008")
        finally:
            store.engine.dispose()


def test_upgrade_from_0009_keeps_records_and_durable_claims(empty_url: str) -> None:
    """Revision 0010 only replaces the durable claim's text: a record written under 0009
    still answers a claim of its key after the upgrade, a new key is still claimed once, and
    the downgrade puts back the claim 0009 has (revision 0008's text)."""
    upgrade(empty_url, "0009")
    store = create_store(empty_url)
    try:
        before = Scope("tenant", "POST /p", "before-0010")
        first = store.claim(before, FP, ttl=600, lease=30)
        assert first.claimed
        with statements_before_0014(store):
            assert store.complete(before, first.record.claim_token, RESPONSE)
        upgrade(empty_url, "0010")
        for revision in ("0010", "0009"):
            replay = store.claim(before, FP, ttl=600, lease=30)
            assert not replay.claimed and replay.record.response == RESPONSE
            new = Scope("tenant", "POST /p", f"new-under-{revision}")
            assert store.claim(new, FP, ttl=600, lease=30).claimed
            assert not store.claim(new, FP, ttl=600, lease=30).claimed
            if store.engine.dialect.name == "postgresql":
                assert _locks_on_citus(store.engine, "idempotency_claim") is (revision == "0010")
            downgrade(empty_url, "0009")
    finally:
        store.engine.dispose()


def test_upgrade_from_0007_drops_the_key_index_and_finds_keys_by_primary_key(
    empty_url: str,
) -> None:
    """From revision 0012 the (tenant, key) index is gone: a record completed under 0007 still
    replays and is still found by its key without an endpoint, on every endpoint it was used
    on; the downgrade builds the index again."""
    upgrade(empty_url, "0007")
    store = create_store(empty_url)
    engine = store.engine
    try:
        scopes = [Scope("tenant", endpoint, "before-0012") for endpoint in ("POST /a", "POST /b")]
        for scope in scopes:
            first = store.claim(scope, FP, ttl=600, lease=30)
            assert first.claimed
            with statements_before_0014(store):
                assert store.complete(scope, first.record.claim_token, RESPONSE)
        for revision, indexed in ((HEAD, False), ("0011", True)):
            if revision == HEAD:
                upgrade(empty_url)
            else:
                downgrade(empty_url, revision)
            indexes = {index["name"] for index in sa.inspect(engine).get_indexes(TABLE_NAME)}
            assert ("ix_idempotency_keys_tenant_key" in indexes) is indexed, indexes
            found = store.find("tenant", "before-0012")
            assert sorted(record.scope.endpoint for record in found) == ["POST /a", "POST /b"]
            replay = store.claim(scopes[0], FP, ttl=600, lease=30)
            assert not replay.claimed and replay.record.response == RESPONSE
    finally:
        engine.dispose()


#: Where revision 0013's check holds: the table, each partition, a detached one.
_FLUSH_CHECKS = sa.text(
    "SELECT conrelid::regclass::text FROM pg_constraint "
    "WHERE conname = 'ck_idempotency_keys_commit_flushed' ORDER BY 1"
)


def _partitions(conn: sa.Connection) -> list[str]:
    return sorted(
        conn.execute(
            sa.text(
                "SELECT c.relname FROM pg_inherits AS i JOIN pg_class AS c ON c.oid = i.inhrelid "
                "WHERE i.inhparent = 'idempotency_keys'::regclass"
            )
        ).scalars()
    )


def _commit_setting(store: t.Any, scope: Scope, token: str, *, citus: bool, setting: str) -> str:
    """``synchronous_commit`` in a transaction that completes ``scope``'s record, after the
    write, with ``setting`` before it, where Citus is loaded (its ``citus.version`` setting,
    a placeholder on this server) or not."""
    connection = store.begin()
    try:
        if citus:
            connection.exec_driver_sql("SET LOCAL citus.version = '13.2-1'")
        connection.exec_driver_sql(f"SET LOCAL synchronous_commit = {setting}")
        assert store.complete(scope, token, RESPONSE, connection=connection)
        return str(connection.exec_driver_sql("SHOW synchronous_commit").scalar_one())
    finally:
        connection.rollback()
        connection.close()


def test_upgrade_from_0012_makes_record_writes_commit_flushed_on_citus_only(
    fresh_pg_database: t.Callable[[], str],
) -> None:
    """Revision 0013 adds a check to every partition, new ones too: a transaction that writes
    a record where Citus is loaded commits flushed (``synchronous_commit`` raised from
    ``off`` to ``local``, never lowered), elsewhere it commits as configured; a record written
    under 0012 still answers; the downgrade takes the check from a detached partition too."""
    url = fresh_pg_database()
    upgrade(url, "0012")
    store = create_store(url)
    try:
        before = Scope("tenant", "POST /p", "before-0013")
        first = store.claim(before, FP, ttl=600, lease=30)
        assert first.claimed
        with statements_before_0014(store):
            assert store.complete(before, first.token, RESPONSE)
        upgrade(url)
        with store.engine.begin() as conn:
            partitions = _partitions(conn)
            assert list(conn.execute(_FLUSH_CHECKS).scalars()) == sorted([TABLE_NAME, *partitions])
            last = partitions[-2]  # the newest day's (DEFAULT sorts last)
            conn.exec_driver_sql(f"DROP TABLE {last}")
        assert store.maintain(ahead=7).created == (last,)
        with store.engine.connect() as conn:
            assert last in conn.execute(_FLUSH_CHECKS).scalars().all()
        replay = store.claim(before, FP, ttl=600, lease=30)
        assert not replay.claimed and replay.record.response == RESPONSE
        scope = Scope("tenant", "POST /p", "after-0013")
        token = store.claim(scope, FP, ttl=600, lease=30).token
        # Without Citus first: a placeholder setting, once made, stays in the session.
        assert _commit_setting(store, scope, token, citus=False, setting="off") == "off"
        assert _commit_setting(store, scope, token, citus=True, setting="off") == "local"
        assert _commit_setting(store, scope, token, citus=True, setting="on") == "on"
        assert _commit_setting(store, scope, token, citus=True, setting="remote_apply") == (
            "remote_apply"
        )
        with store.engine.begin() as conn:
            conn.exec_driver_sql(f"ALTER TABLE {TABLE_NAME} DETACH PARTITION {last}")
        downgrade(url, "0012")
        with store.engine.connect() as conn:
            assert conn.execute(_FLUSH_CHECKS).all() == []
        assert "idempotency_commit_flushed" not in _functions(store.engine)
    finally:
        store.engine.dispose()


def test_runs_beside_an_application_history(fresh_pg_database: t.Callable[[], str]) -> None:
    url = fresh_pg_database()
    engine = create_engine(url)
    try:
        with engine.begin() as conn:
            conn.execute(
                sa.text("CREATE TABLE alembic_version (version_num varchar(32) PRIMARY KEY)")
            )
            conn.execute(sa.text("INSERT INTO alembic_version VALUES ('app_0042')"))
        upgrade(url)
        with engine.connect() as conn:
            assert conn.execute(sa.text("SELECT version_num FROM alembic_version")).all() == [
                ("app_0042",)
            ]
    finally:
        engine.dispose()


def test_partition_granularity_is_configurable(
    fresh_pg_database: t.Callable[[], str], monkeypatch: pytest.MonkeyPatch
) -> None:
    url = fresh_pg_database()
    monkeypatch.setenv("IDEMPOTENCY_PARTITION_GRANULARITY", "week")
    monkeypatch.setenv("IDEMPOTENCY_PARTITIONS_AHEAD", "2")
    upgrade(url)
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            bounds = (
                conn.execute(
                    sa.text(
                        "SELECT pg_get_expr(c.relpartbound, c.oid) FROM pg_inherits i "
                        "JOIN pg_class c ON c.oid = i.inhrelid "
                        "WHERE i.inhparent = 'idempotency_keys'::regclass AND c.relname <> "
                        "'idempotency_keys_default' ORDER BY c.relname"
                    )
                )
                .scalars()
                .all()
            )
        assert len(bounds) == 4, bounds  # last week, this week, two ahead
        assert all("00:00:00+00" in bound for bound in bounds)
        with engine.connect() as conn:
            widths = (
                conn.execute(
                    sa.text(
                        "SELECT DISTINCT upper - lower FROM (SELECT "
                        "substring(b FROM 'TO \\(''([^'']+)') ::timestamptz AS upper, "
                        "substring(b FROM 'FROM \\(''([^'']+)') ::timestamptz AS lower FROM "
                        "unnest(CAST(:bounds AS text[])) AS b) AS x"
                    ),
                    {"bounds": bounds},
                )
                .scalars()
                .all()
            )
        assert [str(w) for w in widths] == ["7 days, 0:00:00"]
    finally:
        engine.dispose()


def table_names(url: str) -> set[str]:
    engine = create_engine(url)
    try:
        return set(sa.inspect(engine).get_table_names())
    finally:
        engine.dispose()


@pytest.fixture
def no_database_url(monkeypatch: pytest.MonkeyPatch) -> None:
    """No ``DATABASE_URL``, whatever the suite's server: it must not be what is migrated."""
    monkeypatch.delenv("DATABASE_URL", raising=False)


@pytest.mark.usefixtures("no_database_url")
def test_without_a_url_the_flask_sqlalchemy_database_is_migrated(empty_url: str) -> None:
    """In an application context, upgrade() and downgrade() without a URL migrate the
    database of the application's Flask-SQLAlchemy (they asked for DATABASE_URL)."""
    app = Flask("orm")
    # Spelled with its driver, as an application configures it (psycopg2 on PostgreSQL).
    app.config["SQLALCHEMY_DATABASE_URI"] = normalize_url(empty_url).render_as_string(False)
    db = SQLAlchemy(app)
    with app.app_context():
        try:
            upgrade()
            assert {TABLE_NAME, VERSION_TABLE} <= table_names(empty_url)
            downgrade()
            assert TABLE_NAME not in table_names(empty_url)
        finally:
            db.engine.dispose()


@pytest.mark.usefixtures("no_database_url")
def test_without_a_url_the_store_database_comes_first(empty_url: str, tmp_path: t.Any) -> None:
    """With the extension on a database of its own, that one is migrated, not the
    application's Flask-SQLAlchemy database."""
    orm_url = f"sqlite:///{tmp_path}/orm.sqlite3"
    app = Flask("own-database")
    app.config.update(SQLALCHEMY_DATABASE_URI=orm_url, IDEMPOTENCY_DATABASE_URL=empty_url)
    db = SQLAlchemy(app)
    Idempotency(app)
    with app.app_context():
        try:
            upgrade()
            assert TABLE_NAME in table_names(empty_url)
            assert TABLE_NAME not in table_names(orm_url)
            downgrade()
            assert TABLE_NAME not in table_names(empty_url)
        finally:
            db.engine.dispose()
            app.extensions["idempotency"].store.engine.dispose()


@pytest.mark.usefixtures("no_database_url")
def test_without_any_database_the_error_says_what_to_pass() -> None:
    """Outside an application context, or in one without a database, the error names the
    ``url`` argument, the application context and ``DATABASE_URL``."""
    with pytest.raises(SystemExit, match=r"pass url=.*app context.*DATABASE_URL"):
        upgrade()
    with Flask("bare").app_context(), pytest.raises(SystemExit, match="pass url="):
        downgrade()


def _expires_indexes(conn: sa.Connection) -> dict[str, str]:
    """Each table of idempotency_keys (the table, a partition) with an index on expires_at."""
    rows = conn.execute(
        sa.text(
            "SELECT tablename, indexname FROM pg_indexes "
            "WHERE tablename LIKE 'idempotency_keys%' AND indexdef LIKE '%(expires_at)'"
        )
    )
    return {table: index for table, index in rows}


def test_upgrade_from_0007_moves_the_request_path_to_kept_plans(
    fresh_pg_database: t.Callable[[], str],
) -> None:
    """Revision 0014, from 0007 with records in it: a record completed under 0007 still
    replays (durable; atomic by the lookup before the transaction and by the claim in it), one
    still in progress is still completed by the claim that holds it, through
    idempotency_complete(); a new atomic key is completed through
    idempotency_complete_reserved(); only DEFAULT keeps an index on expires_at, and a partition
    made after the upgrade has none; the downgrade puts the index back on every partition and
    removes the functions."""
    url = fresh_pg_database()
    upgrade(url, "0007")
    store = create_store(url)
    engine = store.engine
    try:
        done = Scope("tenant", "POST /p", "completed-under-0007")
        running = Scope("tenant", "POST /p", "running-under-0007")
        with statements_before_0014(store):
            first = store.claim(done, FP, ttl=600, lease=30)
            assert first.claimed and store.complete(done, first.token, RESPONSE)
        held = store.claim(running, FP, ttl=600, lease=30)
        assert held.claimed
        upgrade(url)
        with engine.connect() as conn:
            indexes = _expires_indexes(conn)
        assert indexes == {f"{TABLE_NAME}_default": "ix_idempotency_keys_default_expires_at"}
        assert _functions(engine) == FUNCTIONS
        replay = store.claim(done, FP, ttl=600, lease=30)
        assert not replay.claimed and replay.record.response == RESPONSE
        connection = store.begin()
        try:
            before = store.completed_before_claim(done, connection)
            assert before is not None and before.response == RESPONSE, "before the transaction"
            atomic = store.claim_atomic(connection, done, FP, ttl=600)
            assert atomic is not None and not atomic.claimed, "in the transaction"
            assert atomic.record.response == RESPONSE
        finally:
            connection.rollback()
            connection.close()
        connection = store.begin()
        try:
            new = Scope("tenant", "POST /p", "atomic-after-0014")
            claimed = store.claim_atomic(connection, new, FP, ttl=600)
            assert claimed is not None and claimed.reservation is not None
            assert claimed.reservation.complete(RESPONSE)
            connection.commit()
        finally:
            connection.close()
        assert store.claim(new, FP, ttl=600, lease=30).record.response == RESPONSE
        assert store.complete(running, held.token, RESPONSE)
        assert not store.complete(running, held.token, RESPONSE), "completed once"
        assert store.claim(running, FP, ttl=600, lease=30).record.response == RESPONSE
        with engine.begin() as conn:
            last = _partitions(conn)[-2]  # the newest day's (DEFAULT sorts last)
            conn.exec_driver_sql(f"DROP TABLE {last}")
        assert store.maintain(ahead=7).created == (last,)
        with engine.connect() as conn:
            assert last not in _expires_indexes(conn)
        downgrade(url, "0013")
        with engine.connect() as conn:
            indexes = _expires_indexes(conn)
            assert set(indexes) == {TABLE_NAME, *_partitions(conn)}
        assert not _functions(engine) & {
            "idempotency_complete",
            "idempotency_complete_reserved",
            "idempotency_find_completed",
        }
    finally:
        engine.dispose()
