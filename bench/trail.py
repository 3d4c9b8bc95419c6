"""``python -m bench trail`` (``make bench BENCH_MODE=trail``): the audit trail on and off.

Through the store, on a durable throwaway PostgreSQL (or ``DATABASE_URL``) and SQLite: a new
key (claim + complete, each its own durable commit, as a request without a business
transaction does) and a replay, with ``IDEMPOTENCY_AUDIT`` off and on taking turns operation by
operation, so both see the same machine. Reports p50 / p99 milliseconds, statements per
operation, and the audit table's bytes per row.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import os
import secrets
import statistics
import tempfile
import time
import typing as t
from pathlib import Path

from flask_idem import Scope, StoredResponse
from flask_idem.ops.migrate import upgrade
from flask_idem.store import SQLStore, create_store
from tests.support.helpers import count_statements

from .db import Server
from .runner import machine

ENDPOINT = "POST /v1/payments"
BODY = b'{"id":"pay_1","object":"payment","amount":4200,"currency":"eur"}'


@dataclasses.dataclass(frozen=True)
class TrailOptions:
    operations: int = 600

    @classmethod
    def quick(cls) -> TrailOptions:
        return cls(operations=100)


def _new_key(store: SQLStore) -> float:
    scope = Scope("alpha", ENDPOINT, secrets.token_hex(16))
    started = time.perf_counter()
    claim = store.claim(scope, secrets.token_bytes(32), ttl=86400, lease=30)
    store.complete(
        scope, claim.token, StoredResponse(201, (), BODY), created_at=claim.record.created_at
    )
    return time.perf_counter() - started


def _replay(store: SQLStore, scope: Scope) -> float:
    started = time.perf_counter()
    store.claim(scope, b"\x00" * 32, ttl=86400, lease=30)
    return time.perf_counter() - started


def _quantiles(samples: list[float]) -> tuple[float, float]:
    ordered = sorted(samples)
    p99 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]
    return round(statistics.median(ordered) * 1000, 3), round(p99 * 1000, 3)


def _audit_bytes_per_row(store: SQLStore) -> float | None:
    with store.engine.connect() as conn:
        rows = conn.exec_driver_sql("SELECT count(*) FROM idempotency_audit").scalar_one()
        if store.dialect != "postgresql" or not rows:
            return None
        size = conn.exec_driver_sql(
            "SELECT sum(pg_total_relation_size(relid)) FROM pg_partition_tree('idempotency_audit')"
        ).scalar_one()
    return round(int(size) / int(rows))


def measure(url: str, options: TrailOptions) -> list[dict[str, t.Any]]:
    off, on = create_store(url), create_store(url)
    on.use_audit(True)
    try:
        stores = {"off": off, "on": on}
        replayed = {}
        for name, store in stores.items():
            scope = Scope("alpha", ENDPOINT, f"replay-{name}")
            claim = store.claim(scope, b"\x00" * 32, ttl=86400, lease=30)
            store.complete(scope, claim.token, StoredResponse(201, (), BODY))
            replayed[name] = scope
        samples: dict[tuple[str, str], list[float]] = {}
        for _ in range(options.operations):
            for name, store in stores.items():  # taking turns: the same machine for both
                samples.setdefault((name, "new"), []).append(_new_key(store))
                samples.setdefault((name, "replay"), []).append(_replay(store, replayed[name]))
        results = []
        for name, store in stores.items():
            with count_statements(store.engine) as new:
                _new_key(store)
            with count_statements(store.engine) as replay:
                _replay(store, replayed[name])
            for kind, statements in (("new", new), ("replay", replay)):
                p50, p99 = _quantiles(samples[(name, kind)])
                results.append(
                    {
                        "dialect": store.dialect,
                        "audit": name,
                        "operation": kind,
                        "p50_ms": p50,
                        "p99_ms": p99,
                        "statements": len(statements),
                    }
                )
        bytes_per_row = _audit_bytes_per_row(on)
        if bytes_per_row is not None:
            results.append({"dialect": on.dialect, "audit_bytes_per_row": bytes_per_row})
        return results
    finally:
        off.engine.dispose()
        on.engine.dispose()


def run(options: TrailOptions) -> dict[str, t.Any]:
    document: dict[str, t.Any] = {
        "kind": "trail",
        "started": dt.datetime.now(dt.timezone.utc).isoformat(),
        "options": dataclasses.asdict(options),
        "machine": machine(),
        "results": [],
    }
    with contextlib.ExitStack() as stack:
        folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-trail-")))
        server = stack.enter_context(Server.open(f"bench-trail-{os.getpid()}"))
        for url in (
            f"sqlite:///{folder / 'trail.sqlite3'}",
            stack.enter_context(server.database("trail")),
        ):
            upgrade(url)
            document["results"] += measure(url, options)
    return document


def format_text(document: dict[str, t.Any]) -> str:
    lines = [
        "| database | operation | audit off: p50 / p99 ms, statements | audit on |",
        "| --- | --- | ---: | ---: |",
    ]
    timed = {
        (r["dialect"], r["operation"], r["audit"]): r for r in document["results"] if "audit" in r
    }
    for dialect in ("postgresql", "sqlite"):
        for operation in ("new", "replay"):
            cells = []
            for audit in ("off", "on"):
                r = timed.get((dialect, operation, audit))
                cells.append(
                    "-" if r is None else f"{r['p50_ms']} / {r['p99_ms']}, {r['statements']}"
                )
            lines.append(f"| {dialect} | {operation} | {cells[0]} | {cells[1]} |")
    for r in document["results"]:
        if "audit_bytes_per_row" in r:
            lines.append(f"\naudit rows on {r['dialect']}: {r['audit_bytes_per_row']} bytes each")
    return "\n".join(lines)
