"""One contract for every store primitive, run on PostgreSQL and SQLite."""

from __future__ import annotations

import datetime as dt
import hashlib
import io
import typing as t

import psycopg2
import psycopg2.extensions
import psycopg2.extras
import pytest
import sqlalchemy as sa

from flask_idem import Scope, State, StoredResponse, StoreUnavailable, create_store
from flask_idem.store import SQLStore, create_engine, normalize_url

from .conftest import count_statements, shift

FP = hashlib.sha256(b"request").digest()
OTHER_FP = hashlib.sha256(b"other request").digest()
RESPONSE = StoredResponse(
    201, (("Content-Type", "application/json"), ("Location", "/v1/payments/pay_1")), b'{"id":1}'
)


def test_first_claim_owns_the_key(store: SQLStore, scope: Scope) -> None:
    result = store.claim(scope, FP, ttl=3600, lease=30)
    assert result.claimed
    record = result.record
    assert record.state is State.IN_PROGRESS
    assert record.fingerprint == FP
    assert len(result.token) == 32
    assert 29 <= record.lease_remaining <= 30
    assert 3599 <= (record.expires_at - record.created_at).total_seconds() <= 3600
    assert record.response is None


def test_second_claim_returns_the_existing_record(store: SQLStore, scope: Scope) -> None:
    first = store.claim(scope, FP, ttl=3600, lease=30)
    second = store.claim(scope, OTHER_FP, ttl=3600, lease=30)
    assert not second.claimed
    assert second.record.fingerprint == FP
    assert second.record.created_at == first.record.created_at
    assert 29 <= second.record.lease_remaining <= 30
    with pytest.raises(ValueError):
        second.token  # noqa: B018


def test_complete_stores_the_snapshot_for_replay(store: SQLStore, scope: Scope) -> None:
    token = store.claim(scope, FP, ttl=3600, lease=30).token
    assert store.complete(scope, token, RESPONSE)
    replay = store.claim(scope, FP, ttl=3600, lease=30)
    assert not replay.claimed
    assert replay.record.state is State.COMPLETED
    assert replay.record.response == RESPONSE
    assert replay.record.completed_at is not None
    assert not store.complete(scope, token, RESPONSE), "a completed record is final"


def test_complete_keeps_binary_bodies_and_repeated_headers(store: SQLStore, scope: Scope) -> None:
    body = bytes(range(256))
    response = StoredResponse(200, (("Link", "<a>"), ("Link", "<b>")), body)
    token = store.claim(scope, FP, ttl=60, lease=30).token
    assert store.complete(scope, token, response)
    record = store.get(scope)
    assert record is not None and record.response == response


def test_complete_without_response_marks_the_key_unstored(store: SQLStore, scope: Scope) -> None:
    token = store.claim(scope, FP, ttl=3600, lease=30).token
    assert store.complete(scope, token, None)
    record = store.claim(scope, FP, ttl=3600, lease=30).record
    assert record.state is State.UNSTORED
    assert record.response is None


def test_release_frees_the_key(store: SQLStore, scope: Scope) -> None:
    token = store.claim(scope, FP, ttl=3600, lease=30).token
    assert not store.release(scope, "0" * 32), "a wrong token releases nothing"
    assert store.release(scope, token)
    assert store.get(scope) is None
    assert store.claim(scope, OTHER_FP, ttl=3600, lease=30).claimed


def test_mark_unknown_blocks_retries(store: SQLStore, scope: Scope) -> None:
    token = store.claim(scope, FP, ttl=3600, lease=30).token
    assert store.mark_unknown(scope, token)
    result = store.claim(scope, FP, ttl=3600, lease=30)
    assert not result.claimed
    assert result.record.state is State.UNKNOWN
    assert not store.release(scope, token), "an unknown outcome is never released by its owner"


def test_renew_extends_the_lease(store: SQLStore, scope: Scope) -> None:
    token = store.claim(scope, FP, ttl=3600, lease=5).token
    assert store.renew(scope, token, lease=120)
    record = store.get(scope)
    assert record is not None and record.lease_remaining > 100
    assert not store.renew(scope, "0" * 32, lease=120)


def test_take_over_needs_an_expired_lease(store: SQLStore, scope: Scope) -> None:
    token = store.claim(scope, FP, ttl=3600, lease=30).token
    assert store.take_over(scope, token, lease=30) is None
    shift(store, scope, 31, "lease_expires_at")
    record = store.get(scope)
    assert record is not None and record.lease_expired
    takeover = store.take_over(scope, token, lease=30)
    assert takeover is not None and takeover.claimed
    assert takeover.token != token
    assert takeover.record.lease_remaining > 25
    assert store.take_over(scope, token, lease=30) is None, "only one takeover per lease"


def test_stale_owner_is_fenced_after_take_over(store: SQLStore, scope: Scope) -> None:
    stale = store.claim(scope, FP, ttl=3600, lease=30).token
    shift(store, scope, 31, "lease_expires_at")
    takeover = store.take_over(scope, stale, lease=30)
    assert takeover is not None
    assert not store.complete(scope, stale, RESPONSE)
    assert not store.release(scope, stale)
    assert not store.renew(scope, stale, lease=30)
    assert not store.mark_unknown(scope, stale)
    assert store.complete(scope, takeover.token, RESPONSE)
    record = store.get(scope)
    assert record is not None and record.state is State.COMPLETED


def test_expired_record_never_blocks(store: SQLStore, scope: Scope) -> None:
    token = store.claim(scope, FP, ttl=60, lease=30).token
    store.complete(scope, token, RESPONSE)
    shift(store, scope, 61)
    assert store.get(scope) is None
    fresh = store.claim(scope, OTHER_FP, ttl=60, lease=30)
    assert fresh.claimed, "a claim over an expired record in the same partition works"
    assert fresh.record.fingerprint == OTHER_FP
    record = store.get(scope)
    assert record is not None and record.state is State.IN_PROGRESS


def test_live_record_blocks_until_its_expiry(store: SQLStore, scope: Scope) -> None:
    store.claim(scope, FP, ttl=60, lease=30)
    shift(store, scope, 59)
    assert not store.claim(scope, FP, ttl=60, lease=30).claimed


def test_tenants_and_endpoints_never_collide(store: SQLStore) -> None:
    scopes = [
        Scope(tenant, endpoint, "same-key")
        for tenant in ("alpha", "beta")
        for endpoint in ("POST /v1/payments", "POST /v1/refunds")
    ]
    tokens = [store.claim(s, FP, ttl=60, lease=30) for s in scopes]
    assert all(result.claimed for result in tokens)
    assert store.complete(scopes[0], tokens[0].token, RESPONSE)
    for other, result in zip(scopes[1:], tokens[1:], strict=True):
        record = store.get(other)
        assert record is not None and record.state is State.IN_PROGRESS
        assert not store.complete(other, tokens[0].token, RESPONSE), "tokens are scope-bound"
        assert store.release(other, result.token)


def test_get_sees_only_the_live_record(store: SQLStore, scope: Scope) -> None:
    assert store.get(scope) is None
    store.claim(scope, FP, ttl=60, lease=30)
    record = store.get(scope)
    assert record is not None and record.scope == scope


def test_complete_joins_the_business_transaction(store: SQLStore, scope: Scope) -> None:
    token = store.claim(scope, FP, ttl=60, lease=30).token
    connection = store.begin()
    try:
        assert store.complete(scope, token, RESPONSE, connection=connection)
        connection.rollback()
    finally:
        connection.close()
    record = store.get(scope)
    assert record is not None and record.state is State.IN_PROGRESS, "rolled back together"

    connection = store.begin()
    try:
        assert store.complete(scope, token, RESPONSE, connection=connection)
        connection.commit()
    finally:
        connection.close()
    record = store.get(scope)
    assert record is not None and record.state is State.COMPLETED


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


def test_stuck_lists_expired_leases_and_unknown_outcomes_oldest_first(store: SQLStore) -> None:
    alive, dead, unknown, done = (Scope("t", "e", name) for name in ("alive", "dead", "unk", "ok"))
    store.claim(alive, FP, ttl=600, lease=30)
    dead_token = store.claim(dead, FP, ttl=600, lease=30).token
    store.mark_unknown(unknown, store.claim(unknown, FP, ttl=600, lease=30).token)
    store.complete(done, store.claim(done, FP, ttl=600, lease=30).token, RESPONSE)
    shift(store, dead, 31, "lease_expires_at")
    shift(store, unknown, 5, "created_at")
    assert [record.scope for record in store.stuck()] == [unknown, dead]
    assert not store.resolve(alive, RESPONSE, token=None), "a live owner is never overruled"
    assert not store.resolve(done, None, token=None)
    assert not store.resolve(dead, RESPONSE, token="another"), "fenced by the token seen"
    assert store.resolve(dead, RESPONSE, token=dead_token)
    replay = store.claim(dead, FP, ttl=600, lease=30)
    assert not replay.claimed and replay.record.response == RESPONSE
    assert not store.complete(dead, dead_token, RESPONSE)
    assert store.resolve(unknown, None, token=store.stuck()[0].claim_token)
    assert store.claim(unknown, FP, ttl=600, lease=30).claimed
    assert store.stuck() == []


def test_find_and_evict(store: SQLStore) -> None:
    payments, refunds = Scope("t", "POST /p", "k"), Scope("t", "POST /r", "k")
    for scope in (payments, refunds):
        store.claim(scope, FP, ttl=600, lease=30)
    assert [r.scope for r in store.find("t", "k")] == [payments, refunds]
    assert [r.scope for r in store.find("t", "k", endpoint="POST /r")] == [refunds]
    assert store.find("other", "k") == []
    assert store.evict(payments)
    assert not store.evict(payments)
    assert store.claim(payments, FP, ttl=600, lease=30).claimed


def test_writes_use_the_created_at_hint(store: SQLStore, scope: Scope) -> None:
    claim = store.claim(scope, FP, ttl=600, lease=30)
    elsewhere = claim.record.created_at.replace(year=2000)
    assert not store.complete(scope, claim.token, RESPONSE, created_at=elsewhere)
    assert not store.renew(scope, claim.token, lease=30, created_at=elsewhere)
    assert store.renew(scope, claim.token, lease=30, created_at=claim.record.created_at)
    assert store.complete(scope, claim.token, RESPONSE, created_at=claim.record.created_at)


def test_a_request_running_past_its_ttl_keeps_the_key(store: SQLStore, scope: Scope) -> None:
    """The TTL never frees a key whose first request still holds its lease."""
    claim = store.claim(scope, FP, ttl=2, lease=30)
    shift(store, scope, 10, "created_at", "expires_at")
    assert store.renew(
        scope, claim.token, lease=30, created_at=claim.record.created_at - _seconds(10)
    )
    again = store.claim(scope, FP, ttl=2, lease=30)
    assert not again.claimed and again.record.claim_token == claim.token
    assert store.get(scope) is not None
    assert store.maintain(ahead=7).purged == 0
    assert store.get(scope) is not None, "upkeep never removes a record under a held lease"
    # The TTL also counts from the end of the lease: 1 s after it the key is still taken.
    shift(store, scope, 31, "lease_expires_at")
    assert not store.claim(scope, FP, ttl=2, lease=30).claimed, "a TTL after the lease's end"
    shift(store, scope, 2, "lease_expires_at")
    assert store.claim(scope, FP, ttl=2, lease=30).claimed, "past TTL and lease: forgotten"


def _seconds(n: float) -> dt.timedelta:
    return dt.timedelta(seconds=n)


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


def _copy_and_large_object(connection: t.Any) -> tuple[str, int, bytes]:
    """COPY both ways and a large object on a raw psycopg2 connection (then rolled back)."""
    with connection.cursor() as cursor:
        out = io.StringIO()
        cursor.copy_expert("COPY (SELECT 42) TO STDOUT", out)
        cursor.execute("CREATE TEMP TABLE idem_copy (x int)")
        cursor.copy_from(io.StringIO("1\n2\n"), "idem_copy")
        cursor.execute("SELECT count(*) FROM idem_copy")
        (copied,) = cursor.fetchone()
    written = connection.lobject(0, "wb")
    written.write(b"large")
    oid = written.oid
    written.close()
    read = connection.lobject(oid, "rb").read()
    connection.rollback()
    return out.getvalue().strip(), copied, read


@pytest.mark.postgresql
def test_the_applications_own_connections_keep_copy_and_large_objects(
    pg_store: SQLStore, pg_url: str, scope: Scope
) -> None:
    """flask_idem's deadline is no process-wide psycopg2 state (no "green" mode): COPY and
    large objects keep working on every other connection once a store exists and ran."""
    assert pg_store.claim(scope, FP, ttl=60, lease=30).claimed
    assert psycopg2.extensions.get_wait_callback() is None
    expected = ("42", 2, b"large")

    plain = psycopg2.connect(pg_url)
    try:
        assert _copy_and_large_object(plain) == expected
    finally:
        plain.close()

    own = sa.create_engine(normalize_url(pg_url))  # the application's own engine
    migrations = create_engine(pg_url, statement_timeout=None)  # flask_idem's, no deadline
    try:
        for engine in (own, migrations, pg_store.engine):
            with engine.connect() as conn:
                assert _copy_and_large_object(conn.connection.dbapi_connection) == expected
    finally:
        own.dispose()
        migrations.dispose()
    assert pg_store.get(scope) is not None, "the store still works"


@pytest.mark.postgresql
def test_store_connections_keep_every_cursor_kind(pg_store: SQLStore) -> None:
    """The deadline wraps cursor classes of the application's choice and named cursors."""
    with pg_store.engine.connect() as conn:
        raw = conn.connection.dbapi_connection
        with raw.cursor(cursor_factory=psycopg2.extras.RealDictCursor) as cursor:
            assert isinstance(cursor, psycopg2.extras.RealDictCursor)
            assert type(cursor).execute is not psycopg2.extras.RealDictCursor.execute, "bounded"
            cursor.execute("SELECT 1 AS one")
            assert cursor.fetchone() == {"one": 1}
        named = raw.cursor("idem_named")
        assert type(named).fetchmany is not psycopg2.extensions.cursor.fetchmany, "bounded"
        named.itersize = 2
        named.execute("SELECT generate_series(1, 5)")
        assert [row[0] for row in named] == [1, 2, 3, 4, 5]
        named.close()
        streamed = conn.execution_options(stream_results=True).exec_driver_sql(
            "SELECT generate_series(1, 3)"
        )
        assert [row[0] for row in streamed] == [1, 2, 3]
        conn.rollback()
