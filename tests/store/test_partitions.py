"""PostgreSQL partitions: dedup across them, and upkeep that never loses a live record."""

from __future__ import annotations

import hashlib
import typing as t

import pytest
import sqlalchemy as sa

from flask_idem import Scope, State, StoredResponse
from flask_idem.core.key_digest import unkeyed
from flask_idem.store import SQLStore
from tests.support.helpers import bound_parameters, count_statements, partition_names, run_sql

FP = hashlib.sha256(b"request").digest()
RESPONSE = StoredResponse(201, (("Content-Type", "application/json"),), b"{}")


@pytest.fixture(autouse=True)
def _restore_partitions(pg_store: SQLStore) -> object:
    """Run each test on the partitions a fresh migration has (yesterday to 7 days ahead), and
    leave them so (other test files run upkeep too)."""
    run_sql(pg_store, "SELECT idempotency_create_partitions(7, false, 1)")
    yield
    run_sql(pg_store, "SELECT idempotency_create_partitions(7, false, 1)")


def _partition_of(store: SQLStore, scope: Scope) -> str:
    rows = run_sql(
        store,
        "SELECT tableoid::regclass::text FROM idempotency_keys WHERE key = :key",
        key=unkeyed(scope.tenant, scope.key),
    )
    assert len(rows) == 1
    return str(rows[0][0])


def _day(offset: int) -> str:
    return f"to_char((now() AT TIME ZONE 'UTC')::date + {offset}, 'YYYYMMDD')"


def _name(store: SQLStore, offset: int) -> str:
    return "idempotency_keys_p" + str(run_sql(store, f"SELECT {_day(offset)}")[0][0])


def _move_to_day(store: SQLStore, scope: Scope, offset: int, hour: int = 12) -> None:
    run_sql(
        store,
        "UPDATE idempotency_keys SET created_at = "
        f"(date_trunc('day', now() AT TIME ZONE 'UTC') + make_interval(days => {offset}, "
        f"hours => {hour})) AT TIME ZONE 'UTC' WHERE key = :key",
        key=unkeyed(scope.tenant, scope.key),
    )


def test_table_is_declaratively_partitioned(pg_store: SQLStore) -> None:
    strategy = run_sql(
        pg_store,
        "SELECT partstrat FROM pg_partitioned_table WHERE partrelid = 'idempotency_keys'::regclass",
    )
    assert strategy == [("r",)]
    partitions = partition_names(pg_store)
    assert "idempotency_keys_default" in partitions
    for offset in range(-1, 8):
        assert _name(pg_store, offset) in partitions


def test_claims_land_in_todays_partition_and_never_in_default(
    pg_store: SQLStore, scope: Scope
) -> None:
    for n in range(20):
        pg_store.claim(Scope("t", "e", f"k{n}"), FP, ttl=60, lease=30)
    pg_store.claim(scope, FP, ttl=60, lease=30)
    assert _partition_of(pg_store, scope) == _name(pg_store, 0)
    assert run_sql(pg_store, "SELECT count(*) FROM idempotency_keys_default") == [(0,)]


def test_live_record_in_yesterdays_partition_blocks_todays_claim(
    pg_store: SQLStore, scope: Scope
) -> None:
    token = pg_store.claim(scope, FP, ttl=3 * 86400, lease=30).token
    assert pg_store.complete(scope, token, RESPONSE)
    _move_to_day(pg_store, scope, -1)
    assert _partition_of(pg_store, scope) == _name(pg_store, -1)
    again = pg_store.claim(scope, FP, ttl=3 * 86400, lease=30)
    assert not again.claimed
    assert again.record.state is State.COMPLETED and again.record.response == RESPONSE


def test_expired_record_in_yesterdays_partition_does_not_block(
    pg_store: SQLStore, scope: Scope
) -> None:
    pg_store.claim(scope, FP, ttl=60, lease=30)
    _move_to_day(pg_store, scope, -1)
    # Expired: past its TTL, and its owner's lease ran out more than a TTL ago too.
    run_sql(
        pg_store,
        "UPDATE idempotency_keys SET expires_at = now() - interval '1 second', "
        "lease_expires_at = created_at",
    )
    assert pg_store.claim(scope, FP, ttl=60, lease=30).claimed


def test_maintain_creates_partitions_ahead(pg_store: SQLStore) -> None:
    report = pg_store.maintain(ahead=10, dry_run=True)
    assert report.created == (_name(pg_store, 8), _name(pg_store, 9), _name(pg_store, 10))
    assert _name(pg_store, 10) not in partition_names(pg_store), "a dry run changes nothing"
    report = pg_store.maintain(ahead=10)
    assert report.created == (_name(pg_store, 8), _name(pg_store, 9), _name(pg_store, 10))
    assert _name(pg_store, 10) in partition_names(pg_store)
    assert pg_store.maintain(ahead=10).created == (), "maintenance is idempotent"


def test_maintain_leaves_rows_in_default_and_their_owner_keeps_its_claim(
    pg_store: SQLStore, scope: Scope
) -> None:
    """Upkeep catching up never moves a live record from under its owner."""
    claim = pg_store.claim(scope, FP, ttl=60 * 86400, lease=30)
    _move_to_day(pg_store, scope, 20)
    assert _partition_of(pg_store, scope) == "idempotency_keys_default"
    report = pg_store.maintain(ahead=21)
    assert _name(pg_store, 20) not in report.created, "its range waits until DEFAULT is clear"
    assert _name(pg_store, 21) in report.created, "other ranges get their partitions"
    assert _partition_of(pg_store, scope) == "idempotency_keys_default"
    assert pg_store.renew(scope, claim.token, lease=30)
    assert pg_store.complete(scope, claim.token, RESPONSE)
    record = pg_store.get(scope)
    assert record is not None and record.state is State.COMPLETED
    # Once the row has expired and been purged, the range gets its partition.
    run_sql(
        pg_store,
        "UPDATE idempotency_keys SET expires_at = now() - interval '1 second' WHERE key = :k",
        k=unkeyed(scope.tenant, scope.key),
    )
    report = pg_store.maintain(ahead=21)
    assert report.purged == 1 and _name(pg_store, 20) in report.created


def test_maintain_drops_only_fully_expired_partitions(pg_store: SQLStore) -> None:
    run_sql(pg_store, "SELECT idempotency_create_partitions(0, false, 5)")
    expired, live = Scope("t", "e", "expired"), Scope("t", "e", "live")
    for s in (expired, live):
        pg_store.claim(s, FP, ttl=30 * 86400, lease=30)
    _move_to_day(pg_store, expired, -4)
    _move_to_day(pg_store, live, -3)
    run_sql(
        pg_store,
        "UPDATE idempotency_keys SET expires_at = now() - interval '1 hour', "
        "lease_expires_at = created_at WHERE key = :key",
        key=unkeyed("t", "expired"),
    )
    report = pg_store.maintain(ahead=7, dry_run=True)
    assert _name(pg_store, -4) in report.dropped
    assert _name(pg_store, -4) in partition_names(pg_store)
    report = pg_store.maintain(ahead=7)
    partitions = partition_names(pg_store)
    assert _name(pg_store, -4) in report.dropped and _name(pg_store, -4) not in partitions
    assert _name(pg_store, -5) in report.dropped, "an empty past partition goes too"
    assert _name(pg_store, -3) not in report.dropped and _name(pg_store, -3) in partitions
    assert _name(pg_store, 0) in partitions, "today's partition still receives claims"
    assert pg_store.get(live) is not None


def test_maintain_purges_expired_rows_from_default(pg_store: SQLStore, scope: Scope) -> None:
    pg_store.claim(scope, FP, ttl=60, lease=30)
    _move_to_day(pg_store, scope, 40)
    # Expired: past its TTL, and its owner's lease ran out more than a TTL ago too.
    run_sql(
        pg_store,
        "UPDATE idempotency_keys SET expires_at = now() - interval '1 second', "
        "lease_expires_at = created_at",
    )
    assert pg_store.maintain(ahead=7).purged == 1
    assert run_sql(pg_store, "SELECT count(*) FROM idempotency_keys") == [(0,)]


def test_upkeep_under_concurrent_claims_loses_nothing(pg_store: SQLStore) -> None:
    """Creating and dropping partitions while claims run: no claim fails, none is lost."""
    import threading

    stop = threading.Event()
    failures: list[BaseException] = []
    claimed: list[Scope] = []

    def claimant(worker: int) -> None:
        n = 0
        while not stop.is_set():
            scope = Scope("t", "e", f"w{worker}-{n}")
            try:
                assert pg_store.claim(scope, FP, ttl=600, lease=30).claimed
                claimed.append(scope)
            except BaseException as exc:  # noqa: BLE001 - every failure is reported below
                failures.append(exc)
            n += 1

    threads = [threading.Thread(target=claimant, args=(w,)) for w in range(6)]
    for thread in threads:
        thread.start()
    try:
        for _ in range(5):
            run_sql(pg_store, "SELECT idempotency_create_partitions(0, false, 5)")
            report = pg_store.maintain(ahead=9)
            assert _name(pg_store, -3) in report.dropped
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=30)
    assert [repr(f.__cause__)[:300] for f in failures] == []
    assert len(claimed) > 50
    assert all(pg_store.get(scope) is not None for scope in claimed[::10])
    assert run_sql(pg_store, "SELECT count(*) FROM idempotency_keys_default") == [(0,)]


# -- the claim's horizon (migration 0006) ---------------------------------------------------

_CLAIMS = {
    "durable": "SELECT * FROM idempotency_claim('t', 'e', :key, :fp, 'tok', 600, 30)",
    "atomic": "SELECT * FROM idempotency_claim_atomic('t', 'e', :key, :fp, 'tok', 600, 0)",
    "reserve": "SELECT * FROM idempotency_claim_reserve('t', 'e', :key, :fp, 'tok', 600, 0)",
}


def _scans_per_partition(conn: sa.Connection) -> dict[str, int]:
    """Scans of each partition (its table and its indexes) in this transaction so far."""
    rows = conn.execute(
        sa.text(
            "SELECT c.relname, pg_stat_get_xact_numscans(c.oid) + coalesce(("
            " SELECT sum(pg_stat_get_xact_numscans(i.indexrelid)) FROM pg_index AS i"
            " WHERE i.indrelid = c.oid), 0)"
            " FROM pg_inherits AS inh JOIN pg_class AS c ON c.oid = inh.inhrelid"
            " WHERE inh.inhparent = 'idempotency_keys'::regclass"
        )
    )
    return {str(name): int(scans) for name, scans in rows}


@pytest.mark.parametrize("claim", sorted(_CLAIMS))
def test_a_claim_probes_no_partition_starting_a_day_or_more_ahead(
    pg_store: SQLStore, claim: str
) -> None:
    """The lookup skips the partitions kept ready ahead (0006), and still
    probes the past, today, tomorrow and DEFAULT, where a record of the scope can be."""
    with pg_store.engine.begin() as conn:
        before = _scans_per_partition(conn)
        row = conn.execute(sa.text(_CLAIMS[claim]), {"key": unkeyed("t", "new"), "fp": FP}).one()
        assert row.claimed
        probed = {
            name for name, scans in _scans_per_partition(conn).items() if scans > before[name]
        }
        conn.rollback()
    assert {_name(pg_store, -1), _name(pg_store, 0), _name(pg_store, 1)} <= probed
    assert "idempotency_keys_default" in probed
    assert probed.isdisjoint({_name(pg_store, offset) for offset in range(2, 8)})


def _date_ahead(store: SQLStore, scope: Scope, ahead: str) -> None:
    """Date the record ``ahead`` of the database clock: what a clock stepped back leaves."""
    run_sql(
        store,
        f"UPDATE idempotency_keys SET created_at = now() + interval '{ahead}' WHERE key = :key",
        key=unkeyed(scope.tenant, scope.key),
    )


def test_a_record_dated_up_to_a_day_ahead_still_blocks_a_claim(
    pg_store: SQLStore, scope: Scope
) -> None:
    """A clock stepped back by less than a day: the record made before the step still counts,
    from tomorrow's partition (and from DEFAULT, where tomorrow has no partition)."""
    token = pg_store.claim(scope, FP, ttl=3 * 86400, lease=30).token
    assert pg_store.complete(scope, token, RESPONSE)
    _date_ahead(pg_store, scope, "23 hours 59 minutes")
    assert _partition_of(pg_store, scope) in (_name(pg_store, 0), _name(pg_store, 1))
    again = pg_store.claim(scope, FP, ttl=3 * 86400, lease=30)
    assert not again.claimed and again.record.response == RESPONSE
    _date_ahead(pg_store, scope, "0 seconds")  # back to today, then tomorrow unpartitioned
    run_sql(pg_store, f"DROP TABLE {_name(pg_store, 1)}")  # the fixture makes it again
    _date_ahead(pg_store, scope, "23 hours 59 minutes")
    assert _partition_of(pg_store, scope) in (_name(pg_store, 0), "idempotency_keys_default")
    assert not pg_store.claim(scope, FP, ttl=3 * 86400, lease=30).claimed


def test_a_record_dated_more_than_a_day_ahead_is_past_the_horizon(
    pg_store: SQLStore, scope: Scope
) -> None:
    """The documented limit of the bound (migration 0006): a record dated more than a day after
    the claim's clock was not made by a claim on this clock, and is not looked for."""
    pg_store.claim(scope, FP, ttl=3 * 86400, lease=30)
    _date_ahead(pg_store, scope, "1 day 1 minute")
    assert pg_store.claim(scope, FP, ttl=3 * 86400, lease=30).claimed


def test_a_record_claimed_long_ago_and_live_from_its_end_blocks_from_default(
    pg_store: SQLStore, scope: Scope
) -> None:
    """Nothing is narrowed in the past: a request claimed 40 days ago (its partition gone, so in
    DEFAULT) that completed an hour ago is live for its TTL from its end, and blocks."""
    token = pg_store.claim(scope, FP, ttl=86400, lease=30).token
    assert pg_store.complete(scope, token, RESPONSE)
    run_sql(
        pg_store,
        "UPDATE idempotency_keys SET created_at = now() - interval '40 days', "
        "expires_at = now() - interval '39 days', completed_at = now() - interval '1 hour' "
        "WHERE key = :key",
        key=unkeyed(scope.tenant, scope.key),
    )
    assert _partition_of(pg_store, scope) == "idempotency_keys_default"
    again = pg_store.claim(scope, FP, ttl=86400, lease=30)
    assert not again.claimed and again.record.response == RESPONSE


#: The tenant's records per endpoint in the lookup test: a table the planner would rather
#: scan than probe at a few thousand rows.
ROWS_PER_ENDPOINT = 20_000


def _rows_read(plan: dict[str, t.Any]) -> int:
    """Rows the plan's scans of idempotency_keys partitions returned or filtered out."""
    read = 0
    if plan.get("Relation Name", "").startswith("idempotency_keys"):
        loops = plan.get("Actual Loops", 1)
        read += plan["Actual Rows"] * loops + plan.get("Rows Removed by Filter", 0)
    return read + sum(_rows_read(child) for child in plan.get("Plans", []))


def test_a_lookup_by_key_without_its_endpoint_probes_the_primary_key(pg_store: SQLStore) -> None:
    """``find`` without an endpoint (the inspection endpoint, ``flask idem show``) reads the
    tenant's endpoints off the primary key and probes it per endpoint: it reads a few index
    entries, not the tenant's records (no (tenant, key) index since migration 0012), and finds
    the key's record on every endpoint, in every partition, DEFAULT included."""
    endpoints = [f"POST /v1/e{n}" for n in range(3)]
    for endpoint in endpoints:
        pg_store.claim(Scope("t", endpoint, "k7"), FP, ttl=600, lease=30)
        # The tenant's other records, as claims write them (their keys: any other digests).
        run_sql(
            pg_store,
            "INSERT INTO idempotency_keys (tenant, endpoint, key, fingerprint, state,"
            " claim_token, lease_expires_at, created_at, expires_at)"
            " SELECT tenant, endpoint, '$sha256$' || md5(n::text) || md5(endpoint || n), "
            " fingerprint, state, claim_token, lease_expires_at, created_at, expires_at"
            " FROM idempotency_keys, generate_series(1, :rows) AS n"
            " WHERE tenant = 't' AND endpoint = :endpoint",
            endpoint=endpoint,
            rows=ROWS_PER_ENDPOINT,
        )
    run_sql(pg_store, "ANALYZE idempotency_keys")
    with count_statements(pg_store.engine) as seen, bound_parameters(pg_store.engine) as bound:
        found = pg_store.find("t", "k7")
    assert sorted(record.scope.endpoint for record in found) == endpoints
    statement = seen[-1]
    raw = pg_store.engine.raw_connection()
    try:
        cursor = raw.cursor()
        cursor.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + statement, bound[-1])
        plan = cursor.fetchone()[0][0]["Plan"]
    finally:
        raw.close()
    assert _rows_read(plan) < 100, f"read {_rows_read(plan)} rows of {3 * ROWS_PER_ENDPOINT}"
