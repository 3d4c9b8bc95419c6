"""The store on a real Citus cluster: a coordinator and two workers (``citus_server``).

The application connects to the coordinator, as docs/citus.md prescribes; the schema is
migrated there and distributed with ``flask idem citus``. Without Citus these tests skip with
one line saying why, and fail under ``FLASK_IDEM_REQUIRE_CITUS=1`` (CI).
"""

from __future__ import annotations

import base64
import concurrent.futures
import contextlib
import dataclasses
import functools
import itertools
import threading
import time
import typing as t

import flask
import pytest
import sqlalchemy as sa

from flask_idem import Idempotency, Scope
from flask_idem.core.errors import StoreUnavailable
from flask_idem.core.idempotency_keys import key_hash
from flask_idem.core.key_digest import unkeyed
from flask_idem.ops.migrate import upgrade
from flask_idem.store import SQLStore, create_store
from flask_idem.testing import empty_store
from flask_idem.testing.contract import FP, RESPONSE, StoreContract
from tests.support import atomic_app
from tests.support.citus_cluster import CitusCluster
from tests.support.helpers import Counter, shift, wait_until

Factory = t.Callable[..., tuple[flask.Flask, Idempotency, Counter]]

pytestmark = pytest.mark.postgresql


@dataclasses.dataclass(frozen=True)
class Distributed:
    """The migrated, distributed coordinator database and what ``flask idem citus`` said."""

    url: str
    first_run: str
    second_run: str


def _cli(url: str, *args: str) -> t.Any:
    app = flask.Flask("citus-cli")
    app.config["IDEMPOTENCY_DATABASE_URL"] = url
    Idempotency(app)
    try:
        return app.test_cli_runner().invoke(args=["idem", *args])
    finally:
        app.extensions["idempotency"].store.engine.dispose()


def _distribute(citus_server: CitusCluster, database: str) -> Distributed:
    url = citus_server.create_database(database)
    upgrade(url)
    first, second = (_cli(url, "citus") for _ in range(2))
    assert first.exit_code == 0 and second.exit_code == 0, first.output + second.output
    return Distributed(url, first.output, second.output)


@pytest.fixture(scope="module")
def distributed(citus_server: CitusCluster) -> Distributed:
    return _distribute(citus_server, "flask_idem_citus")


@pytest.fixture(scope="module")
def moving(citus_server: CitusCluster) -> Distributed:
    """A database of its own, where only ``idempotency_keys`` is in its colocation group: every
    table moved with it has a primary key, which a move by logical replication needs."""
    return _distribute(citus_server, "flask_idem_citus_moves")


def _sql(url: str, statement: str, **parameters: t.Any) -> list[t.Any]:
    engine = create_store(url).engine
    try:
        with engine.begin() as conn:
            result = conn.execute(sa.text(statement), parameters)
            return list(result) if result.returns_rows else []
    finally:
        engine.dispose()


def _shard_of(url: str, tenant: str) -> int:
    """The shard of the DEFAULT partition that holds ``tenant``'s rows."""
    statement = "SELECT get_shard_id_for_distribution_column('idempotency_keys_default', :t)"
    return int(_sql(url, statement, t=tenant)[0][0])


@pytest.fixture
def store(distributed: Distributed) -> t.Iterator[SQLStore]:
    """An empty store on the coordinator (also the store of conftest's ``app_factory``)."""
    store = create_store(distributed.url)
    empty_store(store)
    yield store
    empty_store(store)
    store.engine.dispose()


def test_flask_idem_citus_distributes_once(distributed: Distributed) -> None:
    assert "done: distribute idempotency_keys by tenant" in distributed.first_run
    assert "done: delegate each claim" in distributed.first_run
    assert "nothing to do" in distributed.second_run
    tables = dict(
        _sql(
            distributed.url,
            "SELECT table_name::text, distribution_column FROM citus_tables "
            "WHERE table_name::text LIKE 'idempotency_keys%'",
        )
    )
    assert tables["idempotency_keys"] == "tenant"
    assert tables["idempotency_keys_default"] == "tenant"
    assert set(tables.values()) == {"tenant"}, "every partition is distributed by tenant"


def test_check_refuses_a_key_rotation_on_citus(distributed: Distributed) -> None:
    """A rotation's locks are the coordinator's; a one-entry claim locks on the worker: the
    deploy check says so instead of letting two rotation steps claim one key twice."""
    secret = base64.b64encode(b"s" * 32).decode()

    def check(secrets: str) -> t.Any:
        app = flask.Flask("citus-check")
        app.config["IDEMPOTENCY_DATABASE_URL"] = distributed.url
        app.config["IDEMPOTENCY_KEY_SECRETS"] = secrets
        Idempotency(app)
        try:
            return app.test_cli_runner().invoke(args=["idem", "check"])
        finally:
            app.extensions["idempotency"].store.engine.dispose()

    rotating = check(f"sha256,ks1:{secret}")
    assert rotating.exit_code == 1, rotating.output
    assert (
        "error   key secrets: IDEMPOTENCY_KEY_SECRETS lists 2 entries on Citus" in rotating.output
    )
    settled = check(f"ks1:{secret}")
    assert "key secrets" not in settled.output, settled.output


class TestStoreThroughTheCoordinator(StoreContract):
    """The exported store contract, every statement planned by Citus (``store`` above)."""


def _expired_in_default(url: str, tenants: int) -> None:
    """Rows 40 days old (no partition holds them: they are in DEFAULT), long expired."""
    _sql(
        url,
        "INSERT INTO idempotency_keys (tenant, endpoint, key, fingerprint, state, claim_token, "
        "lease_expires_at, created_at, completed_at, expires_at) "
        "SELECT 't' || g, 'POST /p', 'old-' || g, '\\x00', 'completed', 'token', "
        "now() - interval '40 days', now() - interval '40 days', now() - interval '40 days', "
        "now() - interval '39 days' FROM generate_series(1, :n) AS g",
        n=tenants,
    )


def test_maintain_creates_drops_and_purges_default(
    distributed: Distributed, store: SQLStore
) -> None:
    url = distributed.url
    _expired_in_default(url, tenants=5)
    live = Scope("t-live", "POST /p", "live")
    store.claim(live, FP, ttl=600, lease=30)
    last = _sql(
        url,
        "SELECT max(c.relname) FROM pg_inherits AS i JOIN pg_class AS c ON c.oid = i.inhrelid "
        "WHERE i.inhparent = 'idempotency_keys'::regclass AND c.relname ~ '^idempotency_keys_p'",
    )[0][0]
    _sql(url, f"DROP TABLE {last}")
    _sql(
        url,
        "CREATE TABLE idempotency_keys_p20200101 PARTITION OF idempotency_keys "
        "FOR VALUES FROM ('2020-01-01 00:00+00') TO ('2020-01-02 00:00+00')",
    )
    result = _cli(url, "maintain")
    assert result.exit_code == 0, result.output
    assert "purged 5 expired rows" in result.output
    assert f"created 1 partition: {last}" in result.output
    assert "dropped 1 partition: idempotency_keys_p20200101" in result.output
    assert _sql(url, "SELECT count(*) FROM idempotency_keys_default") == [(0,)]
    assert store.get(live) is not None
    colocated = _sql(
        url,
        "SELECT count(DISTINCT colocation_id), bool_and(distribution_column = 'tenant') "
        "FROM citus_tables WHERE table_name::text LIKE 'idempotency_keys%'",
    )
    assert colocated == [(1, True)], "the new partition is distributed and colocated"
    assert (
        _sql(url, f"SELECT count(*) FROM pg_dist_shard WHERE logicalrelid::text = '{last}'")[0][0]
        > 0
    )


def test_a_failed_store_statement_shows_the_databases_message(distributed: Distributed) -> None:
    _sql(distributed.url, "ALTER FUNCTION idempotency_drop_expired_partitions(boolean) RENAME TO x")
    try:
        result = _cli(distributed.url, "maintain")
    finally:
        _sql(
            distributed.url,
            "ALTER FUNCTION x(boolean) RENAME TO idempotency_drop_expired_partitions",
        )
    assert result.exit_code == 1
    assert "idempotency_drop_expired_partitions(boolean) does not exist" in result.output


def _storm(
    client_for: t.Callable[[], t.Any],
    path: str,
    keys: int,
    per_key: int,
    tenant: str = "tenant",
    prefix: str = "storm",
) -> list[t.Any]:
    """``per_key`` concurrent first attempts of each of ``keys`` keys, each retried on 409
    (an atomic duplicate is refused at once while the first attempt runs) and on 503 (the
    store was unavailable: a retry with the same key is safe), for up to a minute."""

    def attempt(n: int) -> t.Any:
        client = client_for()
        key = f"{prefix}-{n % keys}"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            response = client.post(
                path,
                json={"amount": 100, "reference": key},
                headers={"Idempotency-Key": key, "X-Tenant": f"{tenant}-{n % keys}"},
            )
            if response.status_code not in (409, 503):
                return key, response.status_code, response.get_data()
            time.sleep(0.01)
        raise AssertionError(f"{key} still 409 or 503 after a minute")

    with concurrent.futures.ThreadPoolExecutor(per_key) as pool:
        return list(pool.map(attempt, range(keys * per_key)))


def test_same_key_storm_runs_each_key_once(app_factory: Factory) -> None:
    app, _, counter = app_factory(tenant=None)
    answers = _storm(app.test_client, "/payments", keys=3, per_key=8)
    assert counter.calls == 3
    by_key: dict[str, set[t.Any]] = {}
    for key, status, body in answers:
        assert status == 201
        by_key.setdefault(key, set()).add(body)
    assert all(len(bodies) == 1 for bodies in by_key.values()), "every retry replays the first"


def test_same_key_storm_in_atomic_mode_writes_one_row_per_key(
    distributed: Distributed, store: SQLStore
) -> None:
    app = atomic_app.create_app(distributed.url)
    try:
        _sql(distributed.url, f"TRUNCATE {atomic_app.orders.name}")
        answers = _storm(app.test_client, "/orders", keys=3, per_key=8)
        assert {status for _, status, _ in answers} == {201}
        rows = _sql(
            distributed.url,
            f"SELECT reference, count(*) FROM {atomic_app.orders.name} GROUP BY reference",
        )
        assert sorted(rows) == [(f"storm-{n}", 1) for n in range(3)]
    finally:
        app.extensions["idempotency"].store.engine.dispose()


def test_operator_reads_across_tenants(distributed: Distributed, store: SQLStore) -> None:
    for tenant in ("alpha", "beta", "gamma"):
        scope = Scope(tenant, "POST /p", "stuck-key")
        store.claim(scope, FP, ttl=600, lease=30)
        store.mark_unknown(scope, store.get(scope).claim_token)  # type: ignore[union-attr]
    result = _cli(distributed.url, "stuck", "--json")
    assert result.exit_code == 0, result.output
    assert result.output.count('"tenant"') == 3
    hashed = key_hash(Scope("beta", "POST /p", "stuck-key"))
    shown = _cli(distributed.url, "show", hashed, "--tenant", "beta")
    assert shown.exit_code == 0, shown.output
    assert "unknown" in shown.output
    # By key without an endpoint: the tenant's endpoints read off the primary key (a
    # recursive CTE, routed whole to the tenant's shard), then one probe per endpoint.
    store.claim(Scope("beta", "POST /q", "stuck-key"), FP, ttl=600, lease=30)
    found = store.find("beta", "stuck-key")
    assert sorted(record.scope.endpoint for record in found) == ["POST /p", "POST /q"]
    assert store.find("delta", "stuck-key") == []


def _claim_and_write(node: SQLStore, scope: Scope, start: threading.Barrier) -> bool:
    """An atomic request's transaction through ``node``: the claim, one business row, the
    record; whether it ran (a duplicate gets no claim: busy, or the record completed)."""
    connection = node.begin()
    try:
        start.wait()
        claimed = node.claim_atomic(connection, scope, FP, ttl=600)
        if claimed is None or not claimed.claimed:
            return False
        connection.execute(
            sa.text(f"INSERT INTO {_EFFECTS} VALUES (:tenant, :key)"),
            {"tenant": scope.tenant, "key": scope.key},
        )
        time.sleep(0.05)  # the claim is held while the other node's claim of the key runs
        assert claimed.reservation is not None and claimed.reservation.complete(None)
        connection.commit()
        return True
    finally:
        connection.close()


_EFFECTS = "citus_two_node_effects"


def test_atomic_claims_of_one_key_through_two_nodes_run_it_once(
    citus_server: CitusCluster, distributed: Distributed, store: SQLStore
) -> None:
    """Citus lets workers with synced metadata serve queries: two atomic claims of one key at
    once, through the coordinator and a worker (or both workers), run the key once, whether
    the tenant's shard is on the worker claiming or on the other one."""
    url = distributed.url
    database = sa.make_url(url).database
    assert database is not None
    _sql(url, f"DROP TABLE IF EXISTS {_EFFECTS}")
    _sql(url, f"CREATE TABLE {_EFFECTS} (tenant varchar(255) NOT NULL, key text NOT NULL)")
    _sql(
        url,
        f"SELECT create_distributed_table('{_EFFECTS}', 'tenant', "
        "colocate_with => 'idempotency_keys')",
    )
    workers = [create_store(citus_server.url(node, database)) for node in citus_server.workers]
    pairs = [(store, workers[0]), (store, workers[1]), (workers[0], workers[1])]
    keys = 30
    runs: list[int] = []
    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            for n in range(keys):
                scope = Scope(f"two-nodes-{n}", "POST /p", f"key-{n}")
                start = threading.Barrier(2)
                nodes = pairs[n % 3]
                ran = pool.map(_claim_and_write, nodes, [scope] * 2, [start] * 2)
                runs.append(sum(ran))
    finally:
        for worker in workers:
            worker.engine.dispose()
    assert runs == [1] * keys, "runs per key (coordinator+worker, coordinator+worker, 2 workers)"
    effects = _sql(url, f"SELECT key, count(*) FROM {_EFFECTS} GROUP BY key")
    assert sorted(effects) == sorted((f"key-{n}", 1) for n in range(keys))
    records = _sql(
        url,
        "SELECT key, count(*) FROM idempotency_keys WHERE tenant LIKE 'two-nodes-%' GROUP BY key",
    )
    # The table holds each key as stored: its digest.
    expected = [(unkeyed(f"two-nodes-{n}", f"key-{n}"), 1) for n in range(keys)]
    assert sorted(records) == sorted(expected)


def _prepared_transactions(url: str) -> int:
    """Two-phase commits the coordinator has recorded (until its 2PC recovery clears them)."""
    return int(_sql(url, "SELECT count(*) FROM pg_dist_transaction")[0][0])


@pytest.mark.parametrize(
    ("business", "two_phase"),
    [("local", True), ("colocated", True), ("other_tenant", True)],
)
def test_how_an_atomic_request_commits(
    distributed: Distributed, store: SQLStore, business: str, two_phase: bool
) -> None:
    """The record and the business row commit together, with Citus' two-phase commit.

    The atomic claim writes on the tenant's worker (its lock query deletes nothing, so that a
    shard move waits for it), so Citus prepares the worker's transaction whether the business
    row is local on the coordinator, colocated with the record, or on another worker.
    """
    url = distributed.url
    table = f"citus_business_{business}"
    _sql(url, f"DROP TABLE IF EXISTS {table}")
    _sql(url, f"CREATE TABLE {table} (tenant varchar(255) NOT NULL, reference text)")
    if business != "local":
        _sql(
            url,
            f"SELECT create_distributed_table('{table}', 'tenant', "
            "colocate_with => 'idempotency_keys')",
        )
    tenant = "tenant-commit"
    row_tenant = tenant
    if business == "other_tenant":
        row_tenant = _tenant_on_another_worker(url, tenant)
    before = _prepared_transactions(url)
    connection = store.begin()
    try:
        claimed = store.claim_atomic(connection, Scope(tenant, "POST /p", business), FP, ttl=600)
        assert claimed is not None and claimed.reservation is not None
        connection.execute(
            sa.text(f"INSERT INTO {table} VALUES (:tenant, 'order')"), {"tenant": row_tenant}
        )
        assert claimed.reservation.complete(None)
        connection.commit()
    finally:
        connection.close()
    assert (_prepared_transactions(url) > before) is two_phase
    assert store.get(Scope(tenant, "POST /p", business)) is not None


def _tenant_on_another_worker(url: str, tenant: str) -> str:
    """A tenant whose shard is on another worker than ``tenant``'s."""

    def node(value: str) -> int:
        return int(
            _sql(
                url,
                "SELECT nodeport FROM pg_dist_shard_placement WHERE shardid = "
                "get_shard_id_for_distribution_column('idempotency_keys_default', :v)",
                v=value,
            )[0][0]
        )

    home = node(tenant)
    return next(f"other-{n}" for n in range(100) if node(f"other-{n}") != home)


def _storm_during_move(
    distributed: Distributed,
    citus_server: CitusCluster,
    client_for: t.Callable[[], t.Any],
    path: str,
    tenant: str,
) -> tuple[int, list[t.Any]]:
    """Rounds of same-key storms of two tenants (``tenant``-0 and -1) while
    ``citus_move_shard_placement`` moves their shard groups to the other worker; the rounds
    run and every answer."""
    tenants = [f"{tenant}-{n}" for n in range(2)]
    placements = _sql(
        distributed.url,
        "SELECT DISTINCT shardid, nodeport FROM pg_dist_shard_placement WHERE shardid IN ("
        "SELECT get_shard_id_for_distribution_column('idempotency_keys_default', t) "
        "FROM unnest(CAST(:tenants AS text[])) AS t)",
        tenants=tenants,
    )
    ports = [worker.port for worker in citus_server.workers]
    database = sa.make_url(distributed.url).database
    assert database is not None
    # Without the store's statement timeout: a move copies every colocated shard.
    moves = [
        f"SELECT citus_move_shard_placement({int(shard)}, '127.0.0.1', {int(port)}, "
        f"'127.0.0.1', {next(p for p in ports if p != port)}, "
        "shard_transfer_mode => 'block_writes')"
        for shard, port in placements
    ]
    with concurrent.futures.ThreadPoolExecutor(1) as mover:
        moved = mover.submit(
            lambda: [citus_server.run(citus_server.coordinator, move, database) for move in moves]
        )
        # Rounds of new keys until the move is over: every round after the first starts while
        # the move runs.
        answers: list[t.Any] = []
        rounds = 0
        while not moved.done() or rounds == 0:
            answers += _storm(client_for, path, 2, 4, tenant=tenant, prefix=f"round-{rounds}")
            rounds += 1
        moved.result()
    after = _sql(
        distributed.url,
        "SELECT DISTINCT shardid, nodeport FROM pg_dist_shard_placement "
        "WHERE shardid = ANY(CAST(:shards AS bigint[]))",
        shards=[shard for shard, _ in placements],
    )
    assert all(dict(after)[shard] != port for shard, port in placements), "every shard moved"
    assert rounds > 1, "the move ended before the first round of claims did"
    return rounds, answers


def test_a_shard_move_during_a_storm_runs_each_key_once(
    distributed: Distributed, citus_server: CitusCluster, app_factory: Factory
) -> None:
    """``citus_move_shard_placement`` of the tenants' shard groups while their keys storm."""
    app, _, counter = app_factory(tenant=None)
    rounds, answers = _storm_during_move(
        distributed, citus_server, app.test_client, "/payments", tenant="moving"
    )
    assert counter.calls == 2 * rounds, "no key ran twice, none was lost"
    assert {status for _, status, _ in answers} == {201}


def test_a_shard_move_during_an_atomic_storm_through_two_nodes_runs_each_key_once(
    distributed: Distributed,
    citus_server: CitusCluster,
    store: SQLStore,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The same move while atomic requests of the moving tenants arrive through the
    coordinator and a worker (each key through both), their orders in a table colocated with
    the records; each view holds its claim a little, so that duplicates meet it."""
    monkeypatch.setenv("ATOMIC_APP_SLEEP", "0.05")
    url = distributed.url
    database = sa.make_url(url).database
    assert database is not None
    orders = atomic_app.orders.name
    _sql(url, f"DROP TABLE IF EXISTS {orders}")
    _sql(
        url,
        f"CREATE TABLE {orders} (id bigserial, tenant varchar(64) NOT NULL, "
        "reference varchar(64) NOT NULL)",
    )
    _sql(
        url,
        f"SELECT create_distributed_table('{orders}', 'tenant', "
        "colocate_with => 'idempotency_keys')",
    )
    apps = [
        atomic_app.create_app(url),
        atomic_app.create_app(citus_server.url(citus_server.workers[0], database)),
    ]
    # The storm's attempts alternate between its two keys: each key gets both nodes.
    turns = itertools.cycle([apps[0], apps[0], apps[1], apps[1]])
    try:
        rounds, answers = _storm_during_move(
            distributed,
            citus_server,
            lambda: next(turns).test_client(),
            "/orders",
            tenant="moving-atomic",
        )
        rows = _sql(url, f"SELECT reference, count(*) FROM {orders} GROUP BY reference")
    finally:
        for app in apps:
            app.extensions["idempotency"].store.engine.dispose()
        _sql(url, f"DROP TABLE {orders}")
    assert {status for _, status, _ in answers} == {201}
    assert sorted(rows) == sorted((f"round-{r}-{n}", 1) for r in range(rounds) for n in range(2)), (
        "one order per key: none ran twice, none was lost"
    )


def _claim_schedule(nodes: int, spread: int) -> t.Iterator[tuple[int, int]]:
    """(key, node) of each claim to send, in order: every key once through each node, its
    claims ``spread`` places apart (key ``k``'s claim through its n-th node is at place
    ``k + n * spread``), so that some claims of a key are sent while others of it wait."""
    for place in itertools.count():
        for n in range(nodes):
            key = place - n * spread
            if key >= 0:
                yield key, (key + n) % nodes


def _claimer(
    nodes: list[SQLStore],
    tenant: str,
    schedule: t.Iterator[tuple[int, int]],
    lock: threading.Lock,
    stop: threading.Event,
) -> list[tuple[str, bool, float]]:
    """Durable claims taken from ``schedule`` until ``stop`` is set: each key, whether the
    claim won it, and when it returned. A claim the store could not make (503: the write
    block outlasted its bounds) is made again, as a client retries with the same key."""
    results: list[tuple[str, bool, float]] = []
    while not stop.is_set():
        with lock:
            key, node = next(schedule)
        scope = Scope(tenant, "POST /p", f"key-{key}")
        while True:
            try:
                claimed = nodes[node].claim(scope, FP, ttl=600, lease=30).claimed
            except StoreUnavailable:
                time.sleep(0.01)
                continue
            results.append((scope.key, claimed, time.monotonic()))
            break
    return results


@pytest.mark.parametrize("mode", ["block_writes", "force_logical"])
def test_durable_claims_through_every_node_during_shard_moves_claim_each_key_once(
    moving: Distributed, citus_server: CitusCluster, mode: str
) -> None:
    """Durable claims of the same keys sent at once to the coordinator and to both workers
    (Citus lets workers with synced metadata serve queries, and each delegates the claim to
    the tenant's worker), while ``citus_move_shard_placement`` moves the tenant's shard group
    back and forth (copying with writes blocked, or by logical replication, which blocks them
    for the final catch-up and the switch): every key has one winner and one record.

    24 threads take the claims from one queue in which a key's claims through the three
    nodes are 8 places apart: when a move blocks writes, some claims of a key wait out the
    block on the tenant's old worker while others of it are sent after the switch, the race
    that ran keys twice before the durable claim pinned its scope on the shard."""
    url = moving.url
    database = sa.make_url(url).database
    assert database is not None
    tenant = f"durable-moving-{mode}"
    shard = _shard_of(url, tenant)
    ports = [worker.port for worker in citus_server.workers]
    nodes = [create_store(url)] + [
        create_store(citus_server.url(node, database)) for node in citus_server.workers
    ]
    claimers, moves = 24, 4
    schedule = _claim_schedule(len(nodes), spread=claimers // len(nodes))
    lock = threading.Lock()
    stop = threading.Event()

    def move_back_and_forth() -> list[tuple[float, float]]:
        spans = []
        for _ in range(moves):
            source = int(
                _sql(
                    url, "SELECT nodeport FROM pg_dist_shard_placement WHERE shardid = :s", s=shard
                )[0][0]
            )
            target = next(port for port in ports if port != source)
            began = time.monotonic()
            citus_server.run(
                citus_server.coordinator,
                f"SELECT citus_move_shard_placement({shard}, '127.0.0.1', {source}, "
                f"'127.0.0.1', {target}, shard_transfer_mode => '{mode}')",
                database,
            )
            spans.append((began, time.monotonic()))
            time.sleep(0.2)  # claims run unblocked between moves
        return spans

    try:
        with concurrent.futures.ThreadPoolExecutor(1 + claimers) as pool:
            streams = [
                pool.submit(_claimer, nodes, tenant, schedule, lock, stop) for _ in range(claimers)
            ]
            mover = pool.submit(move_back_and_forth)
            try:
                spans = mover.result(timeout=120)
            finally:
                stop.set()
            results = [result for stream in streams for result in stream.result()]
    finally:
        for node in nodes:
            node.engine.dispose()
    winners: dict[str, int] = {}
    for key, claimed, _ in results:
        stored = unkeyed(tenant, key)  # the table holds each key as stored: its digest
        winners[stored] = winners.get(stored, 0) + claimed
    records = dict(
        _sql(
            url,
            "SELECT key, count(*) FROM idempotency_keys WHERE tenant = :t GROUP BY key",
            t=tenant,
        )
    )
    assert len(spans) == moves
    returned = sorted(when for _, _, when in results)
    assert returned[0] < spans[0][1] and returned[-1] > spans[-1][0], "claims ran across the moves"
    twice = sorted(key for key, count in records.items() if count != 1)
    assert not twice, f"{len(twice)} of {len(records)} keys have more than one record"
    assert [key for key, count in winners.items() if count != 1] == [], "one winner per key"
    assert records.keys() == winners.keys()


class _Hold:
    """Where each held write waits, its transaction open and its row written, until the move
    blocks writes (``release``); the kinds that got there."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.written: list[str] = []
        self._lock = threading.Lock()

    def __call__(self, kind: str) -> None:
        with self._lock:
            self.written.append(kind)
        assert self.release.wait(120), "the held write was never released"


def _holding(store: SQLStore, hold: t.Callable[[], None]) -> SQLStore:
    """``store`` with each primitive in a transaction that commits once ``hold()`` returns:
    an autocommitted statement cannot be held open, a transaction around the same statement
    can (every statement through ``connect``: no driver shortcut)."""
    store.use_fast_path(False)

    @contextlib.contextmanager
    def connect() -> t.Iterator[sa.Connection]:
        with store.engine.connect() as connection, connection.begin():
            yield connection
            hold()

    store.connect = connect  # type: ignore[method-assign]
    return store


@dataclasses.dataclass(frozen=True)
class _Write:
    """A write of one record, made before its transaction is held (``prepare``, through the
    coordinator), made in the held transaction (``write``), and found after the move
    (``kept``). ``on_worker``: through the tenant's worker (where a delegated claim runs)."""

    prepare: t.Callable[[SQLStore, Scope], t.Any]
    write: t.Callable[[SQLStore, Scope, t.Any, t.Callable[[], None]], None]
    kept: t.Callable[[SQLStore, Scope, t.Any], bool]
    on_worker: bool = False


def _claimed(store: SQLStore, scope: Scope) -> str:
    return store.claim(scope, FP, ttl=600, lease=30).token


def _unknown(store: SQLStore, scope: Scope) -> str:
    token = _claimed(store, scope)
    assert store.mark_unknown(scope, token)
    return token


def _lapsed(store: SQLStore, scope: Scope) -> str:
    token = _claimed(store, scope)
    shift(store, scope, 31, "lease_expires_at")
    return token


def _claim(store: SQLStore, scope: Scope, _: None, hold: t.Callable[[], None]) -> None:
    assert _holding(store, hold).claim(scope, FP, ttl=600, lease=30).claimed


def _atomic(store: SQLStore, scope: Scope, _: None, hold: t.Callable[[], None]) -> None:
    connection = store.begin()
    try:
        claimed = store.claim_atomic(connection, scope, FP, ttl=600)
        assert claimed is not None and claimed.reservation is not None
        assert claimed.reservation.complete(RESPONSE)
        hold()
        connection.commit()
    finally:
        connection.close()


def _complete(store: SQLStore, scope: Scope, token: str, hold: t.Callable[[], None]) -> None:
    connection = store.begin()
    try:
        assert store.complete(scope, token, RESPONSE, connection=connection)
        hold()
        connection.commit()
    finally:
        connection.close()


def _renew(store: SQLStore, scope: Scope, token: str, hold: t.Callable[[], None]) -> None:
    assert _holding(store, hold).renew(scope, token, lease=600)


def _mark_unknown(store: SQLStore, scope: Scope, token: str, hold: t.Callable[[], None]) -> None:
    assert _holding(store, hold).mark_unknown(scope, token)


def _take_over(store: SQLStore, scope: Scope, token: str, hold: t.Callable[[], None]) -> None:
    assert _holding(store, hold).take_over(scope, token, lease=600) is not None


def _resolve(store: SQLStore, scope: Scope, token: str, hold: t.Callable[[], None]) -> None:
    assert _holding(store, hold).resolve(scope, RESPONSE, token=token)


def _reopen(store: SQLStore, scope: Scope, token: str, hold: t.Callable[[], None]) -> None:
    assert _holding(store, hold).reopen(scope, token=token)


def _in_state(state: str) -> t.Callable[[SQLStore, Scope, t.Any], bool]:
    def kept(store: SQLStore, scope: Scope, _: t.Any) -> bool:
        record = store.get(scope)
        return record is not None and record.state.value == state

    return kept


def _renewed(store: SQLStore, scope: Scope, _: str) -> bool:
    record = store.get(scope)
    assert record is not None and record.lease_expires_at is not None
    return (record.lease_expires_at - record.now).total_seconds() > 300


def _taken_over(store: SQLStore, scope: Scope, token: str) -> bool:
    record = store.get(scope)
    return record is not None and record.claim_token != token


def _nothing(_store: SQLStore, _scope: Scope) -> None:
    return None


#: Every kind of write of a record, by the path it takes to the tenant's worker.
_WRITES = {
    "durable claim on the tenant's worker": _Write(
        _nothing, _claim, _in_state("in_progress"), on_worker=True
    ),
    "durable claim run on the coordinator": _Write(_nothing, _claim, _in_state("in_progress")),
    "atomic claim and its record on the tenant's worker": _Write(
        _nothing, _atomic, _in_state("completed"), on_worker=True
    ),
    "completion in the view's transaction": _Write(_claimed, _complete, _in_state("completed")),
    "lease renewal": _Write(_claimed, _renew, _renewed),
    "unknown outcome": _Write(_claimed, _mark_unknown, _in_state("unknown")),
    "take-over": _Write(_lapsed, _take_over, _taken_over),
    "operator's resolve": _Write(_unknown, _resolve, _in_state("completed")),
    "operator's reopen": _Write(_unknown, _reopen, _in_state("reopened")),
}


def _move_blocks_writes(citus_server: CitusCluster, database: str, source: int) -> bool:
    """Whether the move waits for a write's lock: its own on the coordinator, or its
    ``lock_shard_metadata`` on the source worker."""
    waiting = (
        (citus_server.coordinator, "citus_move_shard_placement"),
        (next(w for w in citus_server.workers if w.port == source), "lock_shard_metadata"),
    )
    return any(
        citus_server.run(
            node,
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
            f"AND position('{query}' in query) > 0",
            database,
        )[0][0]
        for node, query in waiting
    )


#: Rounds each write must have been held into a move's block.
_HELD_ROUNDS = 3


def _replicating(citus_server: CitusCluster, worker: t.Any, database: str) -> bool:
    """Whether a move's replication slot on ``worker`` streams (the copy is over)."""
    return bool(
        citus_server.run(
            worker,
            "SELECT count(*) FROM pg_replication_slots WHERE active AND "
            "position('citus_shard_move_slot' in slot_name) > 0",
            database,
        )[0][0]
    )


def _move_with_writes_held(
    citus_server: CitusCluster, url: str, store: SQLStore, shard: int, scopes: dict[str, Scope]
) -> dict[str, bool]:
    """Move ``shard``'s group to the other worker by logical replication with every write of
    ``_WRITES`` held into the move's block: made once the move copies, in a transaction left
    open until the move blocks writes, then committed. For each write held, whether it is in
    the table after the move (a write made after the block began waited it out: none)."""
    database = sa.make_url(url).database
    assert database is not None
    source = int(
        _sql(url, "SELECT nodeport FROM pg_dist_shard_placement WHERE shardid = :s", s=shard)[0][0]
    )
    worker = next(w for w in citus_server.workers if w.port == source)
    target = next(w.port for w in citus_server.workers if w.port != source)
    prepared = {kind: write.prepare(store, scopes[kind]) for kind, write in _WRITES.items()}
    hold = _Hold()
    # Stores without the store's deadline: a held transaction outlives it.
    stores = {
        kind: create_store(
            sa.create_engine(
                citus_server.url(worker, database) if write.on_worker else url,
                poolclass=sa.pool.NullPool,
            )
        )
        for kind, write in _WRITES.items()
    }
    move = (
        f"SELECT citus_move_shard_placement({shard}, '127.0.0.1', {source}, '127.0.0.1', "
        f"{target}, shard_transfer_mode => 'force_logical')"
    )
    try:
        with concurrent.futures.ThreadPoolExecutor(1 + len(_WRITES)) as pool:
            moved = pool.submit(citus_server.run, citus_server.coordinator, move, database)
            # Not before: creating the replication slot waits for every open transaction.
            wait_until(
                lambda: _replicating(citus_server, worker, database), "replication", timeout=60
            )
            writes = [
                pool.submit(
                    write.write,
                    stores[kind],
                    scopes[kind],
                    prepared[kind],
                    functools.partial(hold, kind),
                )
                for kind, write in _WRITES.items()
            ]
            wait_until(
                lambda: moved.done() or _move_blocks_writes(citus_server, database, source),
                "the move to block writes",
                timeout=60,
            )
            held = set() if moved.done() else set(hold.written)
            hold.release.set()
            for write in writes:
                write.result(timeout=120)
            moved.result(timeout=120)
    finally:
        hold.release.set()
        for held_store in stores.values():
            held_store.engine.dispose()
    return {
        kind: write.kept(store, scopes[kind], prepared[kind])
        for kind, write in _WRITES.items()
        if kind in held
    }


@pytest.fixture(scope="module")
def writes_held_into_moves(citus_server: CitusCluster) -> dict[str, list[bool]]:
    """For each write of ``_WRITES``, whether it was in the table after each move it was held
    into, on a database migrated to 0011 and distributed, then upgraded (as a deployment is):
    one tenant's shard group moves back and forth until every write was held into
    ``_HELD_ROUNDS`` moves' blocks (in ``2 * _HELD_ROUNDS + 1`` moves at most)."""
    url = citus_server.create_database("flask_idem_citus_held")
    upgrade(url, "0011")
    assert _cli(url, "citus").exit_code == 0
    upgrade(url)
    tenant = "held-writes"
    shard = _shard_of(url, tenant)
    store = create_store(url)
    kept: dict[str, list[bool]] = {kind: [] for kind in _WRITES}
    try:
        for round_ in range(2 * _HELD_ROUNDS + 1):
            if min(len(outcomes) for outcomes in kept.values()) >= _HELD_ROUNDS:
                break
            scopes = {kind: Scope(tenant, "POST /p", f"{kind} {round_}") for kind in _WRITES}
            for kind, found in _move_with_writes_held(
                citus_server, url, store, shard, scopes
            ).items():
                kept[kind].append(found)
    finally:
        store.engine.dispose()
    return kept


@pytest.mark.parametrize("kind", list(_WRITES))
def test_a_write_committed_as_a_move_blocks_writes_survives_the_move(
    writes_held_into_moves: dict[str, list[bool]], kind: str
) -> None:
    """A move by logical replication reads the source's WAL position once it has blocked
    writes and switches when its subscriptions have applied that much: a write committed
    asynchronously (the suite's nodes run with ``synchronous_commit = off``) just before was
    not written yet, and stayed on the old placement (a claim answered "claimed" lost its
    record, a completion its response). Every write of a record commits flushed on Citus
    (migration 0013): each is in the table after every move it was held into."""
    outcomes = writes_held_into_moves[kind]
    assert len(outcomes) >= _HELD_ROUNDS, f"held into {len(outcomes)} moves' blocks"
    assert all(outcomes), f"in the table after {sum(outcomes)} of {len(outcomes)} moves"


def test_force_delegation_of_the_atomic_claim_makes_citus_refuse_it(
    citus_server: CitusCluster,
) -> None:
    """Why docs/citus.md says never to distribute the atomic claim with ``force_delegation``:
    Citus then refuses the claim itself, inside the business transaction."""
    url = _distribute(citus_server, "flask_idem_citus_forced").url
    _sql(
        url,
        "SELECT create_distributed_function(:f, 'p_tenant', colocate_with => 'idempotency_keys', "
        "force_delegation => true)",
        f="idempotency_claim_reserve(text,text,text,bytea,text,double precision,double precision)",
    )
    store = create_store(url)
    try:
        with store.engine.connect() as connection, connection.begin():
            with pytest.raises(Exception) as refused:
                store.claim_atomic(connection, Scope("forced", "POST /p", "k"), FP, ttl=600)
    finally:
        store.engine.dispose()
    chain = [refused.value, refused.value.__cause__, refused.value.__context__]
    assert any("forced function pushdown" in str(error) for error in chain), chain


def test_a_single_node_cluster_claims_once_after_shards_are_allowed_on_the_coordinator(
    citus_server: CitusCluster,
) -> None:
    """A single-node Citus (the coordinator alone, holding the shards): ``flask idem citus``
    fails with the database's message until the coordinator may hold shards, then
    distributes, and concurrent claims of one key have one winner and one record."""
    database, coordinator = "flask_idem_citus_single", citus_server.coordinator
    citus_server.run(coordinator, f'CREATE DATABASE "{database}"')
    citus_server.run(coordinator, "CREATE EXTENSION citus", database)
    host = f"'127.0.0.1', {coordinator.port}"
    citus_server.run(coordinator, f"SELECT citus_set_coordinator_host({host})", database)
    url = citus_server.url(coordinator, database)
    upgrade(url)
    refused = _cli(url, "citus")
    assert refused.exit_code != 0 and "exceeds number of worker nodes" in refused.output
    citus_server.run(
        coordinator, f"SELECT citus_set_node_property({host}, 'shouldhaveshards', true)", database
    )
    distributed = _cli(url, "citus")
    assert distributed.exit_code == 0, distributed.output
    store = create_store(url)
    scope = Scope("single", "POST /p", "one-key")
    try:
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            claims = list(
                pool.map(lambda _: store.claim(scope, FP, ttl=600, lease=30).claimed, range(16))
            )
    finally:
        store.engine.dispose()
    records = _sql(url, "SELECT count(*) FROM idempotency_keys WHERE tenant = 'single'")
    assert claims.count(True) == 1 and records == [(1,)], (claims, records)
