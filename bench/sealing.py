"""``python -m bench sealing`` (``make bench BENCH_MODE=sealing``): what compression and
encryption of stored responses cost, on and off.

Three measurements, each for the four variants ``off`` (plain), ``zlib`` (the default
threshold), ``aes`` (AES-256-GCM, no compression) and ``zlib+aes``:

codec
    microseconds to seal and to open one snapshot (the CPU added to a completion and to a
    replay), and its stored size, for JSON payment bodies of 256 B to 64 KiB; plus zlib levels
    1, 6 and 9 (why level 6);
store
    p50 / p99 milliseconds of a new key (claim + complete, two durable commits) and of a replay
    (claim finding the record) through the real store, on SQLite and PostgreSQL;
size
    bytes per row on disk, indexes and TOAST included, for 1, 4 and 16 KiB bodies: rows are
    sealed exactly as the store seals them and bulk-inserted into an emptied table.

PostgreSQL is a durable throwaway cluster (or ``DATABASE_URL``), as for ``make bench``.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import datetime as dt
import json
import os
import random
import secrets
import statistics
import tempfile
import time
import typing as t
import zlib
from pathlib import Path

import sqlalchemy as sa

from flask_idem.core.record import Scope, StoredResponse
from flask_idem.core.sealing import Sealer, parse_keys
from flask_idem.ops.migrate import upgrade
from flask_idem.store import SQLStore, create_store

from .db import Server
from .load import percentile
from .runner import machine

VARIANTS = ("off", "zlib", "aes", "zlib+aes")
CODEC_SIZES = (256, 1024, 4096, 16384, 65536)
STORE_SIZES = (1024, 16384)
ROW_SIZES = (1024, 4096, 16384)
HEADERS = (("Content-Type", "application/json"), ("Location", "/v1/payments/pay_0123456789"))
ENDPOINT = "POST /v1/payments"


@dataclasses.dataclass(frozen=True)
class SealingOptions:
    codec_iterations: int = 2000
    store_operations: int = 300
    rows: int = 2000

    @classmethod
    def quick(cls) -> SealingOptions:
        return cls(codec_iterations=200, store_operations=40, rows=200)


def payment_body(size: int, seed: int = 0) -> bytes:
    """A JSON payment answer of about ``size`` bytes: ids and amounts vary, field names and
    enums repeat, as in real API responses (compressible, but not trivially)."""
    rng = random.Random(seed)
    items: list[dict[str, t.Any]] = []
    document: dict[str, t.Any] = {
        "id": f"pay_{rng.getrandbits(96):024x}",
        "object": "payment",
        "status": "succeeded",
        "amount": rng.randrange(100, 10**6),
        "currency": "eur",
        "customer": f"cus_{rng.getrandbits(64):016x}",
        "card": {"brand": "visa", "last4": f"{rng.randrange(10**4):04d}", "exp": "12/29"},
        "items": items,
    }
    compact = (",", ":")
    length = len(json.dumps(document, separators=compact))
    while length < size:
        item = {
            "sku": f"SKU-{rng.getrandbits(32):08X}",
            "name": rng.choice(("Coffee beans", "Espresso cup", "Filter papers", "Grinder")),
            "quantity": rng.randrange(1, 9),
            "unit_amount": rng.randrange(100, 10**5),
            "tax_rate": rng.choice(("txr_standard", "txr_reduced")),
        }
        # One more item adds itself and a comma (none for the first).
        length += len(json.dumps(item, separators=compact)) + (1 if items else 0)
        items.append(item)
    return json.dumps(document, separators=(",", ":")).encode()


def sealers() -> dict[str, Sealer]:
    keys = parse_keys({"bench": base64.b64encode(os.urandom(32)).decode()})
    return {
        "off": Sealer(compress_min=None),
        "zlib": Sealer(),
        "aes": Sealer(keys, compress_min=None),
        "zlib+aes": Sealer(keys),
    }


def _micros(function: t.Callable[[], t.Any], iterations: int) -> float:
    """Median of five batches, microseconds per call."""
    batches = []
    for _ in range(5):
        started = time.perf_counter()
        for _ in range(iterations):
            function()
        batches.append((time.perf_counter() - started) / iterations * 1e6)
    return statistics.median(batches)


def measure_codec(options: SealingOptions) -> dict[str, t.Any]:
    scope = Scope("tenant", ENDPOINT, "4f8c2a1e-6b0d-4c7e-9a51-2f3d8c7b1e90")
    created = dt.datetime.now(dt.timezone.utc)
    rows = []
    for size in CODEC_SIZES:
        response = StoredResponse(201, HEADERS, payment_body(size))
        iterations = max(20, options.codec_iterations * 1024 // max(size, 1024))
        for name, sealer in sealers().items():
            columns = sealer.seal(response, scope, created)
            assert sealer.open(scope, created, 201, *columns) == response
            stored = len(columns[1]) + (len(json.dumps(columns[0])) if columns[0] else 0)
            rows.append(
                {
                    "body": size,
                    "variant": name,
                    "stored_bytes": stored,
                    "seal_us": round(
                        _micros(lambda s=sealer, r=response: s.seal(r, scope, created), iterations),
                        1,
                    ),
                    "open_us": round(
                        _micros(
                            lambda s=sealer, c=columns: s.open(scope, created, 201, *c),
                            iterations,
                        ),
                        1,
                    ),
                }
            )
    levels = []
    for size in (4096, 65536):
        body = payment_body(size)
        for level in (1, 6, 9):
            iterations = max(20, options.codec_iterations * 1024 // size)
            levels.append(
                {
                    "body": size,
                    "level": level,
                    "compressed_bytes": len(zlib.compress(body, level)),
                    "compress_us": round(
                        _micros(lambda b=body, lv=level: zlib.compress(b, lv), iterations), 1
                    ),
                }
            )
    return {"codec": rows, "zlib_levels": levels}


def _timed(function: t.Callable[[], t.Any]) -> float:
    started = time.perf_counter()
    function()
    return (time.perf_counter() - started) * 1000


def _new_key(store: SQLStore, scope: Scope, response: StoredResponse) -> None:
    claim = store.claim(scope, b"f" * 32, ttl=3600, lease=30)
    assert store.complete(scope, claim.token, response, created_at=claim.record.created_at)


def _replayed(store: SQLStore, scope: Scope, response: StoredResponse) -> None:
    claim = store.claim(scope, b"f" * 32, ttl=3600, lease=30)
    assert not claim.claimed and claim.record.response == response


def measure_store(store: SQLStore, options: SealingOptions) -> list[dict[str, t.Any]]:
    """New key (claim + complete) and replay (claim of a completed key), per variant.

    The variants take turns operation by operation, so that drift of a shared machine (another
    process, a checkpoint) falls on all of them alike.
    """
    results = []
    variants = sealers()
    for size in STORE_SIZES:
        response = StoredResponse(201, HEADERS, payment_body(size, seed=size))
        run = secrets.token_hex(4)
        count = options.store_operations + 10
        scopes = {
            name: [Scope(f"bench-{name}-{size}-{run}", ENDPOINT, f"k{n}") for n in range(count)]
            for name in variants
        }
        timings: dict[str, dict[str, list[float]]] = {
            name: {"new": [], "replay": []} for name in variants
        }
        for phase, operation in (("new", _new_key), ("replay", _replayed)):
            for n in range(count):
                for name, sealer in variants.items():
                    store.sealer = sealer  # swapped between operations (use_sealer refuses)
                    scope = scopes[name][n]
                    elapsed = _timed(lambda s=scope, o=operation, r=response: o(store, s, r))
                    if n >= 10:  # the first ten warm the pool and caches
                        timings[name][phase].append(elapsed)
        for name in variants:
            new, replay = sorted(timings[name]["new"]), sorted(timings[name]["replay"])
            results.append(
                {
                    "dialect": store.dialect,
                    "body": size,
                    "variant": name,
                    "new_p50": round(percentile(new, 0.5), 3),
                    "new_p99": round(percentile(new, 0.99), 3),
                    "replay_p50": round(percentile(replay, 0.5), 3),
                    "replay_p99": round(percentile(replay, 0.99), 3),
                }
            )
    return results


_INSERT = sa.text(
    "INSERT INTO idempotency_keys (tenant, endpoint, key, fingerprint, state, "
    "response_status, response_headers, response_body, created_at, completed_at, expires_at) "
    "VALUES (:tenant, :endpoint, :key, :fingerprint, 'completed', 201, :headers, :body, "
    ":created_at, :created_at, :expires_at)"
).bindparams(
    sa.bindparam("headers", type_=sa.JSON(none_as_null=True)),
    sa.bindparam("body", type_=sa.LargeBinary),
    sa.bindparam("fingerprint", type_=sa.LargeBinary),
)


def _empty(store: SQLStore) -> None:
    with store.engine.begin() as conn:
        if store.dialect == "postgresql":
            conn.exec_driver_sql("TRUNCATE idempotency_keys")
        else:
            conn.exec_driver_sql("DELETE FROM idempotency_keys")
    if store.dialect == "sqlite":
        # Outside SQLAlchemy: the store's engine opens every transaction BEGIN IMMEDIATE, and
        # VACUUM refuses to run inside one.
        raw = store.engine.raw_connection()
        try:
            t.cast(t.Any, raw.driver_connection).execute("VACUUM")
        finally:
            raw.close()


def _table_bytes(store: SQLStore) -> int:
    with store.engine.connect() as conn:
        if store.dialect == "postgresql":
            return int(
                conn.exec_driver_sql(
                    "SELECT sum(pg_total_relation_size(relid)) "
                    "FROM pg_partition_tree('idempotency_keys')"
                ).scalar_one()
            )
        # Pages of the table and its indexes (dbstat is compiled into the usual builds; the
        # file size is the fallback).
        try:
            return int(
                conn.exec_driver_sql(
                    "SELECT sum(pgsize) FROM dbstat WHERE name LIKE '%idempotency_keys%'"
                ).scalar_one()
            )
        except sa.exc.OperationalError:
            page_size = conn.exec_driver_sql("PRAGMA page_size").scalar_one()
            pages = conn.exec_driver_sql("PRAGMA page_count").scalar_one()
            return int(page_size) * int(pages)


def measure_size(store: SQLStore, options: SealingOptions) -> list[dict[str, t.Any]]:
    """Bytes per stored row, per body size and variant (and for a row without a body)."""
    results = []
    now = dt.datetime.now(dt.timezone.utc)
    for size in ROW_SIZES:
        for name, sealer in sealers().items():
            _empty(store)
            baseline = _table_bytes(store)
            rows = []
            for n in range(options.rows):
                scope = Scope(f"tenant-{n % 100}", ENDPOINT, f"{secrets.token_hex(16)}")
                response = StoredResponse(201, HEADERS, payment_body(size, seed=n))
                created = now - dt.timedelta(microseconds=n)
                headers, body = sealer.seal(response, scope, created)
                rows.append(
                    {
                        "tenant": scope.tenant,
                        "endpoint": scope.endpoint,
                        "key": scope.key,
                        "fingerprint": secrets.token_bytes(32),
                        "headers": headers,
                        "body": body,
                        "created_at": created,
                        "expires_at": created + dt.timedelta(days=1),
                    }
                )
            with store.engine.begin() as conn:
                conn.execute(_INSERT, rows)
            total = _table_bytes(store) - baseline
            results.append(
                {
                    "dialect": store.dialect,
                    "body": size,
                    "variant": name,
                    "bytes_per_row": round(total / options.rows),
                }
            )
    _empty(store)
    return results


def run(options: SealingOptions) -> dict[str, t.Any]:
    started = dt.datetime.now(dt.timezone.utc)
    document: dict[str, t.Any] = {
        "kind": "sealing",
        "started": started.isoformat(),
        "options": dataclasses.asdict(options),
        "machine": machine(),
        **measure_codec(options),
        "store": [],
        "size": [],
    }
    with contextlib.ExitStack() as stack:
        folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-sealing-")))
        sqlite_url = f"sqlite:///{folder / 'sealing.sqlite3'}"
        server = stack.enter_context(Server.open(f"bench-sealing-{os.getpid()}"))
        pg_url = stack.enter_context(server.database("sealing"))
        for url in (sqlite_url, pg_url):
            upgrade(url)
            store = create_store(url)
            try:
                document["store"] += measure_store(store, options)
                document["size"] += measure_size(store, options)
            finally:
                store.engine.dispose()
    return document


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" ---: " for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def format_text(document: dict[str, t.Any]) -> str:
    """Markdown tables (README's Performance and Sizing sections are pasted from them)."""
    parts = []
    codec = {(r["body"], r["variant"]): r for r in document["codec"]}
    sizes = sorted({r["body"] for r in document["codec"]})
    parts.append("Codec: stored bytes, seal us / open us per snapshot")
    parts.append(
        _table(
            ["body", *VARIANTS],
            [
                [f"{size:,} B"]
                + [
                    f"{codec[size, v]['stored_bytes']:,} B, "
                    f"{codec[size, v]['seal_us']:g} / {codec[size, v]['open_us']:g}"
                    for v in VARIANTS
                ]
                for size in sizes
            ],
        )
    )
    parts.append("\nzlib levels: compressed bytes, compress us")
    parts.append(
        _table(
            ["body", "level", "bytes", "us"],
            [
                [
                    f"{r['body']:,} B",
                    str(r["level"]),
                    f"{r['compressed_bytes']:,}",
                    f"{r['compress_us']:g}",
                ]
                for r in document["zlib_levels"]
            ],
        )
    )
    store = {(r["dialect"], r["body"], r["variant"]): r for r in document["store"]}
    parts.append("\nStore: new key (claim + complete) and replay, p50 / p99 ms")
    parts.append(
        _table(
            [
                "dialect",
                "body",
                *[f"{v} new" for v in VARIANTS],
                *[f"{v} replay" for v in VARIANTS],
            ],
            [
                [dialect, f"{size:,} B"]
                + [
                    f"{store[dialect, size, v]['new_p50']:.2f} / "
                    f"{store[dialect, size, v]['new_p99']:.2f}"
                    for v in VARIANTS
                ]
                + [
                    f"{store[dialect, size, v]['replay_p50']:.2f} / "
                    f"{store[dialect, size, v]['replay_p99']:.2f}"
                    for v in VARIANTS
                ]
                for dialect, size in sorted({(d, b) for d, b, _ in store})
            ],
        )
    )
    size = {(r["dialect"], r["body"], r["variant"]): r for r in document["size"]}
    parts.append("\nBytes per row on disk (indexes and TOAST included)")
    parts.append(
        _table(
            ["dialect", "body", *VARIANTS],
            [
                [dialect, f"{body:,} B"]
                + [f"{size[dialect, body, v]['bytes_per_row']:,}" for v in VARIANTS]
                for dialect, body in sorted({(d, b) for d, b, _ in size})
            ],
        )
    )
    return "\n".join(parts)
