"""``python -m bench growth``: the claim stays flat as the table grows, and a day expires by
dropping its partition instead of deleting its rows.

The table is filled in SQL (``INSERT ... SELECT`` over ``generate_series``, one statement per
daily partition) with records spread evenly over the last 7 days, as a week of traffic with
the default 24-hour TTL leaves it. At each size the bench times claims through the store, as
the extension makes them: a new key (lookup in every partition, then insert) and an existing
live key (lookup only, the replay path). Then one extra past day holding ``drop_rows`` expired
records is expired twice over: a ``DELETE`` of its rows (timed, then rolled back) and the
partition drop that ``idempotency_drop_expired_partitions()`` performs (lock, expiry check,
``DROP TABLE``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import os
import secrets
import sys
import time
import typing as t

import sqlalchemy as sa

from flask_idem import Scope
from flask_idem.ops.migrate import upgrade
from flask_idem.store import create_store

from .apps import database_url
from .db import Probe, Server
from .load import percentile
from .runner import machine

DAYS = 7
TENANTS = 100
ENDPOINT = "POST /payments"

# Rows of one day: keys unique per (day, n); created_at evenly spread over the day (the current
# day only up to now); expired rows are completed, live ones too (replayable).
_FILL = """
INSERT INTO idempotency_keys (
    tenant, endpoint, key, fingerprint, state, claim_token, lease_expires_at,
    response_status, response_headers, response_body, created_at, completed_at, expires_at)
SELECT 'tenant-' || (n % :tenants), :endpoint, 'g' || :tag || '-' || n,
       sha256(('fp' || n)::bytea), 'completed', NULL, NULL,
       201, '[["Content-Type", "application/json"]]'::jsonb,
       convert_to('{"id": "pay_' || n || '", "amount": 4200, "status": "succeeded"}', 'UTF8'),
       c.created, c.created, c.created + make_interval(secs => :ttl)
  FROM generate_series(:first, :last) AS n
 CROSS JOIN LATERAL (
       SELECT :start + (:span * ((n - :first)::float8 / :count)) * interval '1 second'
       AS created) AS c
"""


@dataclasses.dataclass(frozen=True)
class GrowthOptions:
    """Sizes in millions of records; claims timed per size and kind."""

    sizes: tuple[float, ...] = (1, 5, 10)
    samples: int = 400
    drop_rows: int = 1_000_000
    ttl: float = 86400


def _day_start(days_ago: int, now: dt.datetime) -> dt.datetime:
    midnight = now.replace(hour=0, minute=0, second=0, microsecond=0)
    return midnight - dt.timedelta(days=days_ago)


class Growth:
    def __init__(self, url: str, options: GrowthOptions) -> None:
        self.url = url
        self.options = options
        self.engine = sa.create_engine(database_url(url))
        self.store = create_store(url)
        self.rows = 0
        self.began = time.monotonic()

    def log(self, message: str) -> None:
        print(f"{time.monotonic() - self.began:6.1f}s {message}", file=sys.stderr, flush=True)

    def db_now(self) -> dt.datetime:
        with self.engine.connect() as conn:
            return t.cast(dt.datetime, conn.execute(sa.text("SELECT now()")).scalar_one())

    def prepare(self) -> None:
        """Partitions for the last 7 days plus one more past day for the expiry demo."""
        with self.engine.begin() as conn:
            conn.execute(
                sa.text("SELECT idempotency_create_partitions(:ahead, false, :behind)"),
                {"ahead": 1, "behind": DAYS},
            )

    def fill_to(self, total: int) -> float:
        """Add records, spread evenly over the 7 days, until the table holds ``total``."""
        missing = total - self.rows
        if missing <= 0:
            return 0.0
        now = self.db_now()
        started = time.monotonic()
        per_day = missing // DAYS
        tag = secrets.token_hex(3)
        for days_ago in range(DAYS - 1, -1, -1):
            count = per_day + (missing % DAYS if days_ago == 0 else 0)
            start = _day_start(days_ago, now)
            # Today's records only up to now, so that none is dated in the future.
            span = (now - start).total_seconds() if days_ago == 0 else 86400.0
            self._insert(f"{tag}{days_ago}", start, span, count)
        self.rows = total
        self.settle()
        return time.monotonic() - started

    def settle(self) -> None:
        """Statistics for the planner, and the bulk load written out, so that the timed
        claims' commits do not queue behind the load's write-back."""
        with self.engine.connect() as conn:
            autocommit = conn.execution_options(isolation_level="AUTOCOMMIT")
            autocommit.exec_driver_sql("ANALYZE idempotency_keys")
            with contextlib.suppress(sa.exc.DBAPIError):  # needs pg_checkpoint on a shared server
                autocommit.exec_driver_sql("CHECKPOINT")

    def _insert(self, tag: str, start: dt.datetime, span: float, count: int) -> None:
        with self.engine.begin() as conn:
            conn.execute(
                sa.text(_FILL),
                {
                    "tenants": TENANTS,
                    "endpoint": ENDPOINT,
                    "tag": tag,
                    "ttl": self.options.ttl,
                    "first": 1,
                    "last": count,
                    "count": count,
                    "start": start,
                    "span": span,
                },
            )

    def live_scopes(self, count: int) -> list[tuple[Scope, bytes]]:
        """Existing records a retry would find (still live: created in the last 24 hours)."""
        with self.engine.connect() as conn:
            rows = conn.execute(
                sa.text(
                    "SELECT tenant, endpoint, key, fingerprint FROM idempotency_keys"
                    " TABLESAMPLE SYSTEM (1) WHERE expires_at > now() LIMIT :n"
                ),
                {"n": count},
            ).all()
        return [(Scope(r.tenant, r.endpoint, r.key), bytes(r.fingerprint)) for r in rows]

    def time_claims(self) -> dict[str, dict[str, float]]:
        """Claim latency through the store (one round trip each), new and existing keys."""
        samples = self.options.samples
        existing = self.live_scopes(samples)
        tag = secrets.token_hex(4)
        fingerprint = b"\x00" * 32
        results = {}
        for kind in ("new key", "existing key"):
            latencies = []
            for i in range(samples):
                if kind == "new key":
                    scope, digest = Scope("tenant-new", ENDPOINT, f"new-{tag}-{i}"), fingerprint
                else:
                    scope, digest = existing[i % len(existing)]
                begun = time.perf_counter()
                claim = self.store.claim(scope, digest, ttl=self.options.ttl, lease=30)
                latencies.append((time.perf_counter() - begun) * 1000)
                if claim.claimed != (kind == "new key"):
                    raise RuntimeError(f"unexpected claim result for {kind}")
            ordered = sorted(latencies[samples // 10 :])  # the first tenth warms caches
            results[kind] = {
                "p50": percentile(ordered, 0.5),
                "p95": percentile(ordered, 0.95),
                "p99": percentile(ordered, 0.99),
                "mean": sum(ordered) / len(ordered),
            }
        return results

    def table_size(self) -> str:
        with self.engine.connect() as conn:
            return str(
                conn.execute(
                    sa.text(
                        "SELECT pg_size_pretty(sum(pg_total_relation_size(inhrelid)))"
                        " FROM pg_inherits WHERE inhparent = 'idempotency_keys'::regclass"
                    )
                ).scalar_one()
            )

    def expiry(self) -> dict[str, t.Any]:
        """One past day of ``drop_rows`` expired records: DELETE (rolled back) vs drop."""
        now = self.db_now()
        start = _day_start(DAYS, now)
        partition = f"idempotency_keys_p{start:%Y%m%d}"
        self._insert("x", start, 86400.0, self.options.drop_rows)
        bounds = {"lo": start, "hi": start + dt.timedelta(days=1)}
        self.settle()
        with self.engine.connect() as conn:
            transaction = conn.begin()
            begun = time.perf_counter()
            deleted = conn.execute(
                sa.text(
                    "DELETE FROM idempotency_keys WHERE created_at >= :lo AND created_at < :hi"
                    " AND expires_at <= now()"
                ),
                bounds,
            ).rowcount
            delete_seconds = time.perf_counter() - begun
            transaction.rollback()
        with self.engine.connect() as conn:
            transaction = conn.begin()
            begun = time.perf_counter()
            conn.exec_driver_sql(f"LOCK TABLE {partition} IN ACCESS EXCLUSIVE MODE")
            live = conn.exec_driver_sql(
                f"SELECT EXISTS (SELECT 1 FROM {partition} WHERE expires_at > now())"
            ).scalar_one()
            if live:
                raise RuntimeError(f"{partition} still holds live records")
            conn.exec_driver_sql(f"DROP TABLE {partition}")
            transaction.commit()
            drop_seconds = time.perf_counter() - begun
        return {
            "partition": partition,
            "rows": deleted,
            "delete_seconds": delete_seconds,
            "drop_seconds": drop_seconds,
        }


def run(options: GrowthOptions) -> dict[str, t.Any]:
    """Fill, time, report; returns the results document."""
    started = dt.datetime.now(dt.timezone.utc)
    with contextlib.ExitStack() as stack:
        server = stack.enter_context(Server.open(f"growth-{os.getpid()}"))
        control = stack.enter_context(server.database("control"))
        url = stack.enter_context(server.database("growth"))
        upgrade(url)
        probe = Probe(control)
        stack.callback(probe.dispose)
        if server.cluster is not None:
            # Bulk loading on our own cluster: fewer forced checkpoints; commits stay durable.
            with probe.engine.connect() as conn:
                conn.exec_driver_sql("ALTER SYSTEM SET max_wal_size = '8GB'")
                conn.exec_driver_sql("SELECT pg_reload_conf()")
        growth = Growth(url, options)
        stack.callback(growth.engine.dispose)
        stack.callback(growth.store.engine.dispose)
        growth.prepare()
        steps = []
        for millions in options.sizes:
            total = int(millions * 1_000_000)
            growth.log(f"filling to {total:,} records")
            fill_seconds = growth.fill_to(total)
            growth.log(f"filled in {fill_seconds:.1f} s; timing claims")
            claims = growth.time_claims()
            steps.append(
                {
                    "records": total,
                    "fill_seconds": fill_seconds,
                    "table_size": growth.table_size(),
                    "claims": claims,
                }
            )
            growth.log(
                f"{total:>11,} records: new key p50 {claims['new key']['p50']:.2f} ms, "
                f"existing key p50 {claims['existing key']['p50']:.2f} ms"
            )
        growth.log(f"expiring one day of {options.drop_rows:,} records")
        expiry = growth.expiry()
        settings = probe.settings()
    return {
        "kind": "growth",
        "started": started.isoformat(timespec="seconds"),
        "seconds": round((dt.datetime.now(dt.timezone.utc) - started).total_seconds(), 1),
        "options": dataclasses.asdict(options) | {"mode": "growth"},
        "machine": machine(),
        "postgresql": settings,
        "steps": steps,
        "expiry": expiry,
    }


def format_text(document: dict[str, t.Any]) -> str:
    pg = document["postgresql"]
    out = [
        f"flask_idem growth: claim latency through the store (one round trip), "
        f"{document['options']['samples']} claims per size and kind; PostgreSQL "
        f"{pg.get('server_version')} (fsync={pg.get('fsync')}, synchronous_commit="
        f"{pg.get('synchronous_commit')})",
        "",
        "| records (7 daily partitions) | table size | new key p50 / p99 ms "
        "| existing key p50 / p99 ms |",
        "| ---: | ---: | ---: | ---: |",
    ]
    for step in document["steps"]:
        new, old = step["claims"]["new key"], step["claims"]["existing key"]
        out.append(
            f"| {step['records']:,} | {step['table_size']} | {new['p50']:.2f} / {new['p99']:.2f} "
            f"| {old['p50']:.2f} / {old['p99']:.2f} |"
        )
    expiry = document["expiry"]
    out += [
        "",
        f"Expiring one day of {expiry['rows']:,} records ({expiry['partition']}): "
        f"DELETE {expiry['delete_seconds']:.2f} s (then rolled back) vs dropping the partition "
        f"{expiry['drop_seconds'] * 1000:.0f} ms (lock, expiry check, DROP TABLE, commit).",
    ]
    return "\n".join(out)
