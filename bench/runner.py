"""The A/B bench: every app, the same load, interleaved rounds, the server's own counters.

The apps (:mod:`bench.apps`): ``bare`` (the floor), ``idem`` (flask_idem, durable claim),
``idem-atomic`` (flask_idem, ``atomic=True``), ``handwritten`` (a minimal layer written by
hand, the reference), the one-commit hand-written layer ``handwritten-atomic`` (the floor of
atomic mode), and both hand-written layers again on flask_idem's partitioned schema
(``handwritten-partitioned``, ``handwritten-atomic-partitioned``): what its SQL costs without
its Python. Scenarios (each at every concurrency, each round running the apps in
order, the next round in reverse order so that slow drift of the machine favours none):

S1  every request carries a new key: the full claim, business transaction and completion;
S2  every request carries the same, completed key: a replay (the bare app does the work);
S3  storms: ``storm_size`` requests with one key sent at once; rows created per key are
    counted in the database and the answers' statuses reported.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import datetime as dt
import os
import platform
import secrets
import subprocess
import sys
import tempfile
import time
import typing as t
from pathlib import Path

import sqlalchemy as sa

from flask_idem.ops.migrate import upgrade

from . import load
from .apps import create_schema, database_url
from .db import Probe, Server, cpu_delta, machine_cpu, stolen_share
from .servers import Gunicorn

APPS = (
    "bare",
    "idem",
    "idem-atomic",
    "handwritten",
    "handwritten-atomic",
    "handwritten-partitioned",
    "handwritten-atomic-partitioned",
)
FACTORIES = {
    "bare": "bare",
    "idem": "protected",
    "idem-atomic": "protected_atomic",
    "handwritten": "handwritten",
    "handwritten-atomic": "handwritten_atomic",
    "handwritten-partitioned": "handwritten_partitioned",
    "handwritten-atomic-partitioned": "handwritten_atomic_partitioned",
}
#: flask_idem's apps.
IDEM_APPS = ("idem", "idem-atomic")
#: Apps whose databases need flask_idem's schema.
SCHEMA_APPS = (*IDEM_APPS, "handwritten-partitioned", "handwritten-atomic-partitioned")
#: Apps that must create one payment per key (every app but the floor).
PROTECTED_APPS = APPS[1:]
SCENARIOS = ("S1", "S2")
SCENARIO_NAMES = {"S1": "S1 new key", "S2": "S2 replay", "S3": "S3 storm"}


@dataclasses.dataclass(frozen=True)
class Options:
    """How much to measure; ``quick()`` fits in a minute on two cores."""

    rounds: int = 5
    seconds: float = 8.0
    max_requests: int = 40_000
    concurrencies: tuple[int, ...] = (1, 8)
    workers: int = 4
    storms: int = 10
    storm_size: int = 50
    warmup: int = 400
    client: str = "auto"
    mode: str = "full"

    @classmethod
    def quick(cls, **overrides: t.Any) -> Options:
        values: dict[str, t.Any] = dict(
            rounds=2, seconds=1.0, max_requests=3_000, storms=3, warmup=100, mode="quick"
        )
        values.update(overrides)
        return cls(**values)

    @property
    def resolved_client(self) -> str:
        if self.client == "auto":
            return "wrk" if load.wrk_path() else "python"
        return self.client


@dataclasses.dataclass
class Run:
    """One measured run of one app: the load generator's view and the server's counters."""

    round: int
    scenario: str
    concurrency: int
    app: str
    client: str
    requests: int
    #: Requests the server handled (from pg_stat_statements), the per-request denominator.
    served: int
    seconds: float
    rps: float
    p50: float
    p95: float
    p99: float
    mean: float
    statuses: dict[str, int]
    errors: int
    #: Per request: top-level SQL statements (BEGIN and COMMIT included), transactions that
    #: committed (pg_stat_database, read-only ones too), durable commits (write transactions).
    statements: float | None = None
    xact_commits: float | None = None
    durable_commits: float | None = None
    #: Per request: WAL bytes written (cluster-wide), the server's planning time in
    #: microseconds (pg_stat_statements total_plan_time; None where planning is not tracked).
    wal_bytes: float | None = None
    plan_us: float | None = None
    #: Per request, milliseconds: gunicorn workers, PostgreSQL backends, the load generator.
    app_cpu_ms: float | None = None
    db_cpu_ms: float | None = None
    client_cpu_ms: float | None = None
    #: The share of the machine's CPU time the hypervisor stole during the run (0 to 1).
    steal: float | None = None
    top_statements: list[tuple[str, int]] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Storms:
    """All storms against one app."""

    app: str
    size: int
    storms: int
    statuses: dict[str, int]
    errors: int
    #: Payment rows per storm key (protected: must be 1 each) and stored idempotency records
    #: (flask_idem's table, or the hand-written layer's).
    rows: list[int]
    records: list[int]
    distinct_bodies: list[int]
    statements: float | None
    durable_commits: float | None

    @property
    def server_errors(self) -> int:
        return self.errors + sum(n for s, n in self.statuses.items() if s.startswith("5"))


class Bench:
    """Owns the servers and counters for one bench run."""

    def __init__(self, options: Options, databases: dict[str, str], probe: Probe) -> None:
        self.options = options
        self.client = options.resolved_client
        self.databases = databases
        self.names = {app: sa.make_url(url).database or "" for app, url in databases.items()}
        self.probe = probe
        self.logdir = Path(tempfile.mkdtemp(prefix="flask-idem-bench-"))
        self.servers = {
            app: Gunicorn(FACTORIES[app], databases[app], options.workers, self.logdir / app)
            for app in APPS
        }
        self.replay_key = f"s2-{secrets.token_hex(6)}"
        self.marks: dict[str, int] = {}
        self.pending: dict[str, concurrent.futures.Future[None]] = {}
        self.executor = concurrent.futures.ThreadPoolExecutor(len(APPS))
        self.runs: list[Run] = []
        self.began = time.monotonic()

    def start(self) -> None:
        for server in self.servers.values():
            server.start()
        for server in self.servers.values():
            server.wait_ready()

    def stop(self) -> None:
        self.executor.shutdown(wait=True)
        for server in self.servers.values():
            server.stop()

    def log(self, message: str) -> None:
        print(f"{time.monotonic() - self.began:6.1f}s {message}", file=sys.stderr, flush=True)

    def warm_up(self) -> None:
        """Open every worker's pool connections and fill caches, then publish statistics so
        that the first measured run starts from exact counters."""
        for app, server in self.servers.items():
            prefix = f"warm-{app}-{secrets.token_hex(4)}"
            load.python_load(
                server.port,
                lambda n, p=prefix: f"{p}-{n}",  # type: ignore[misc]
                concurrency=8,
                max_requests=self.options.warmup,
                max_seconds=30,
            )
            load.python_load(
                server.port,
                lambda _: self.replay_key,
                concurrency=1,
                max_requests=self.options.warmup // 4,
                max_seconds=30,
            )
        for app in APPS:
            self.pending[app] = self.executor.submit(self._flush, app, None, 0)

    def _flush(self, app: str, run: Run | None, before: int) -> None:
        self.servers[app].flush_statistics()
        mark = self.probe.xact_commit(self.names[app])
        if run is not None and run.served:
            run.xact_commits = (mark - before) / run.served
        self.marks[app] = mark

    def _drive(self, app: str, scenario: str, concurrency: int, tag: str) -> load.LoadResult:
        port = self.servers[app].port
        budget = dict(
            concurrency=concurrency,
            max_requests=self.options.max_requests,
            max_seconds=self.options.seconds,
        )
        if self.client == "wrk":
            if scenario == "S1":
                return load.wrk_load(port, "new", tag, **budget)  # type: ignore[arg-type]
            return load.wrk_load(port, "same", self.replay_key, **budget)  # type: ignore[arg-type]
        if scenario == "S1":
            return load.python_load(port, lambda n: f"{tag}-{n}", **budget)  # type: ignore[arg-type]
        return load.python_load(port, lambda _: self.replay_key, **budget)  # type: ignore[arg-type]

    def measure(self, round_: int, scenario: str, concurrency: int, app: str) -> Run:
        """One run with its counters; the statistics flush that closes it runs in the
        background, during the other app's next run (it only sleeps in this app's workers)."""
        if app in self.pending:
            self.pending.pop(app).result()
        server = self.servers[app]
        database = self.names[app]
        before_xact = self.marks[app]
        self.probe.reset_statements()
        xid = self.probe.next_xid()
        wal = self.probe.wal_position()
        app_cpu = server.cpu()
        db_cpu = self.probe.backend_cpu(database)
        machine = machine_cpu()
        tag = f"s1-{app}-r{round_}-c{concurrency}-{secrets.token_hex(4)}"
        result = self._drive(app, scenario, concurrency, tag)
        stolen = stolen_share(machine, machine_cpu())
        app_cpu_used = cpu_delta(app_cpu, server.cpu())
        db_cpu_used = cpu_delta(db_cpu, self.probe.backend_cpu(database))
        xids = self.probe.next_xid() - xid
        wal_written = self.probe.wal_position() - wal
        statements, top = self.probe.statements(database)
        plan_ms = self.probe.plan_ms(database)
        n = max(1, _served(app, top) or result.requests)
        run = Run(
            round=round_,
            scenario=scenario,
            concurrency=concurrency,
            app=app,
            client=result.client,
            requests=result.requests,
            served=n,
            seconds=result.seconds,
            rps=result.rps,
            p50=result.p50,
            p95=result.p95,
            p99=result.p99,
            mean=result.mean,
            statuses=result.statuses,
            errors=result.errors,
            statements=None if statements is None else statements / n,
            durable_commits=xids / n,
            wal_bytes=wal_written / n,
            plan_us=None if plan_ms is None else plan_ms / n * 1000,
            app_cpu_ms=app_cpu_used / n * 1000,
            db_cpu_ms=(db_cpu_used / n * 1000) if db_cpu else None,
            client_cpu_ms=result.client_cpu / n * 1000,
            steal=stolen,
            top_statements=top,
        )
        self.pending[app] = self.executor.submit(self._flush, app, run, before_xact)
        self.runs.append(run)
        self.log(
            f"  round {round_} {SCENARIO_NAMES[scenario]:<11} c={concurrency:<2} {app:<11} "
            f"{run.rps:8.1f} req/s  p99 {run.p99:7.2f} ms  {_statuses(run.statuses)}"
        )
        return run

    def rounds(self) -> None:
        for round_ in range(1, self.options.rounds + 1):
            order = APPS if round_ % 2 else tuple(reversed(APPS))
            for concurrency in self.options.concurrencies:
                for scenario in SCENARIOS:
                    for app in order:
                        self.measure(round_, scenario, concurrency, app)
        for future in self.pending.values():
            future.result()

    def storms(self) -> list[Storms]:
        found = []
        for app in APPS:
            port = self.servers[app].port
            self.probe.reset_statements()
            xid = self.probe.next_xid()
            results = [
                load.storm(port, f"s3-{app}-{i}-{secrets.token_hex(4)}", self.options.storm_size)
                for i in range(self.options.storms)
            ]
            xids = self.probe.next_xid() - xid
            statements, _ = self.probe.statements(self.names[app])
            rows, records = self._count_rows(app, [r.key for r in results])
            statuses: dict[str, int] = {}
            for result in results:
                for status, count in result.statuses.items():
                    statuses[status] = statuses.get(status, 0) + count
            total = max(1, sum(statuses.values()))
            storms = Storms(
                app=app,
                size=self.options.storm_size,
                storms=len(results),
                statuses=dict(sorted(statuses.items())),
                errors=sum(r.errors for r in results),
                rows=rows,
                records=records,
                distinct_bodies=[r.distinct_bodies for r in results],
                statements=None if statements is None else statements / total,
                durable_commits=xids / total,
            )
            self.log(
                f"  storms {app:<11} rows per key {rows}  {_statuses(storms.statuses)}"
                f"  errors {storms.errors}"
            )
            found.append(storms)
        return found

    def _count_rows(self, app: str, keys: list[str]) -> tuple[list[int], list[int]]:
        engine = sa.create_engine(database_url(self.databases[app]))
        try:
            with engine.connect() as conn:
                rows = [
                    int(
                        conn.execute(
                            sa.text(
                                "SELECT count(*) FROM bench_payments WHERE idempotency_key = :k"
                            ),
                            {"k": key},
                        ).scalar_one()
                    )
                    for key in keys
                ]
                records = [0] * len(keys)
                table = _RECORDS.get(app)
                if table is not None:
                    records = [
                        int(
                            conn.execute(
                                sa.text(f"SELECT count(*) FROM {table} WHERE key = :k"),
                                {"k": key},
                            ).scalar_one()
                        )
                        for key in keys
                    ]
        finally:
            engine.dispose()
        return rows, records


#: One statement per request that reached the app, so that per-request figures divide by what
#: the server did: wrk stops with requests in flight that it never counts.
_MARKERS = {
    "bare": "INSERT INTO bench_payments",
    "idem": "idempotency_claim(",
    "idem-atomic": "idempotency_claim_reserve(",
    "handwritten": "INSERT INTO bench_handwritten_keys",
    "handwritten-atomic": "SELECT fingerprint, state, status, body, headers FROM bench_hand",
    "handwritten-partitioned": "idempotency_claim(",
    "handwritten-atomic-partitioned": "idempotency_claim_reserve(",
}
#: Where each protected app keeps its records (counted after the storms).
_RECORDS = {
    "idem": "idempotency_keys",
    "idem-atomic": "idempotency_keys",
    "handwritten": "bench_handwritten_keys",
    "handwritten-atomic": "bench_handwritten_keys",
    "handwritten-partitioned": "idempotency_keys",
    "handwritten-atomic-partitioned": "idempotency_keys",
}


def _served(app: str, top: list[tuple[str, int]]) -> int | None:
    calls = [count for query, count in top if _MARKERS[app] in query]
    return calls[0] if calls else None


def _statuses(statuses: dict[str, int]) -> str:
    return " ".join(f"{status}:{count}" for status, count in sorted(statuses.items()))


def machine() -> dict[str, t.Any]:
    """What the numbers were measured on."""
    info: dict[str, t.Any] = {
        "nproc": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
    }
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        for line in lscpu.splitlines():
            name, _, value = line.partition(":")
            if name.strip() in ("Model name", "CPU(s)", "Hypervisor vendor"):
                info[name.strip()] = value.strip()
    with contextlib.suppress(OSError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                info["memory_gb"] = round(int(line.split()[1]) / 1024 / 1024, 1)
    return info


def run(options: Options) -> dict[str, t.Any]:
    """The whole A/B bench; returns the results document (see :mod:`bench.report`)."""
    started = dt.datetime.now(dt.timezone.utc)
    with contextlib.ExitStack() as stack:
        server = stack.enter_context(Server.open(f"bench-{os.getpid()}"))
        control = stack.enter_context(server.database("control"))
        databases = {
            app: stack.enter_context(server.database(app.replace("-", "_"))) for app in APPS
        }
        for url in databases.values():
            create_schema(url)
        for app in SCHEMA_APPS:
            upgrade(databases[app])
        probe = Probe(control)
        stack.callback(probe.dispose)
        bench = Bench(options, databases, probe)
        stack.callback(bench.stop)
        print(
            f"bench ({options.mode}): {options.workers} gunicorn sync workers per app, "
            f"client {bench.client}, {options.rounds} rounds of {options.seconds:g} s, "
            f"logs in {bench.logdir}",
            file=sys.stderr,
        )
        bench.start()
        bench.log("servers ready; warming up")
        bench.warm_up()
        bench.rounds()
        storms = bench.storms()
        settings = probe.settings()
        return {
            "started": started.isoformat(timespec="seconds"),
            "seconds": round((dt.datetime.now(dt.timezone.utc) - started).total_seconds(), 1),
            "options": dataclasses.asdict(options) | {"client": bench.client},
            "machine": machine(),
            "postgresql": settings | {"statements_available": probe.statements_available},
            "runs": [dataclasses.asdict(r) for r in bench.runs],
            "storms": [dataclasses.asdict(s) for s in storms],
        }
    raise AssertionError("unreachable")
