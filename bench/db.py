"""The bench's PostgreSQL: a durable throwaway cluster (or ``DATABASE_URL``), fresh databases,
and the counters that say what each request cost the server.

Each app gets its own database, so ``pg_stat_database`` and ``pg_stat_statements`` (filtered
by database) attribute every statement and transaction to exactly one app; the bench reads
them from a third, control database so that its own queries are never counted.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import typing as t
import uuid
from pathlib import Path

import sqlalchemy as sa

from tests.support import pgcluster

from .apps import database_url

CLK_TCK = os.sysconf("SC_CLK_TCK")


@dataclasses.dataclass
class Server:
    """A PostgreSQL server the bench may create databases on."""

    url: str
    cluster: pgcluster.Cluster | None = None

    @classmethod
    @contextlib.contextmanager
    def open(cls, name: str) -> t.Iterator[Server]:
        """``DATABASE_URL`` when set, else a durable cluster under ``.pg/NAME``: fsync and
        synchronous commit on, as in production, since commits are part of the cost."""
        given = os.environ.get("DATABASE_URL")
        if given:
            yield cls(given)
            return
        if not pgcluster.have_server_binaries():
            raise SystemExit(pgcluster.NO_SERVER)
        cluster = pgcluster.Cluster(pgcluster.PG_DIR / name)
        try:
            # Planning time per request is one of the bench's figures (pg_stat_statements).
            cluster.start(durable=True, settings={"pg_stat_statements.track_planning": "on"})
            yield cls(cluster.url, cluster)
        finally:
            cluster.stop()

    @contextlib.contextmanager
    def database(self, label: str) -> t.Iterator[str]:
        """A fresh database, dropped afterwards on a shared server (a throwaway cluster is
        removed whole: dropping would cost a checkpoint of everything the bench wrote)."""
        name = f"flask_idem_bench_{label}_{uuid.uuid4().hex[:8]}"
        admin = sa.create_engine(database_url(self.url), isolation_level="AUTOCOMMIT")
        try:
            with admin.connect() as conn:
                conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
            yield (
                sa.make_url(database_url(self.url))
                .set(database=name)
                .render_as_string(hide_password=False)
            )
        finally:
            if self.cluster is None:
                with admin.connect() as conn:
                    conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
            admin.dispose()


def process_cpu(pid: int) -> float | None:
    """User + system CPU seconds of a process, from ``/proc`` (None when it is gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def machine_cpu() -> tuple[int, int] | None:
    """The machine's CPU time so far, from ``/proc/stat``: (stolen, total) in clock ticks.

    *Stolen* is time the hypervisor ran something else while this VM had work: on a shared VM
    it comes in bursts of seconds, slows every process alike and shows in no process's CPU.
    """
    try:
        first = Path("/proc/stat").read_text().split("\n", 1)[0].split()
    except OSError:
        return None
    ticks = [int(value) for value in first[1:]]
    # user nice system idle iowait irq softirq steal guest guest_nice; guests are in user.
    return (ticks[7], sum(ticks[:8])) if first[0] == "cpu" and len(ticks) >= 8 else None


def stolen_share(before: tuple[int, int] | None, after: tuple[int, int] | None) -> float | None:
    """The share of the machine's CPU time stolen between two :func:`machine_cpu` readings."""
    if before is None or after is None or after[1] <= before[1]:
        return None
    return (after[0] - before[0]) / (after[1] - before[1])


def children(parent: int) -> list[int]:
    """Direct children of a process (a gunicorn master's workers)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        if int(stat[stat.rindex(")") + 2 :].split()[1]) == parent:
            found.append(int(entry.name))
    return found


class Probe:
    """Reads the server's counters from the control database."""

    def __init__(self, control_url: str) -> None:
        self.engine = sa.create_engine(database_url(control_url), isolation_level="AUTOCOMMIT")
        self.statements_available = self._enable_statements()

    def _enable_statements(self) -> bool:
        try:
            with self.engine.connect() as conn:
                conn.exec_driver_sql("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
                conn.exec_driver_sql("SELECT pg_stat_statements_reset()")
                conn.exec_driver_sql("SELECT count(*) FROM pg_stat_statements")
        except sa.exc.DBAPIError:
            # Not in shared_preload_libraries, or not allowed: statements are reported as n/a.
            return False
        return True

    def scalar(self, sql: str, **params: t.Any) -> t.Any:
        with self.engine.connect() as conn:
            return conn.execute(sa.text(sql), params).scalar()

    def settings(self) -> dict[str, str]:
        names = ("server_version", "fsync", "synchronous_commit", "wal_sync_method")
        with self.engine.connect() as conn:
            return {name: str(conn.exec_driver_sql(f"SHOW {name}").scalar()) for name in names}

    def reset_statements(self) -> None:
        if self.statements_available:
            with self.engine.connect() as conn:
                conn.exec_driver_sql("SELECT pg_stat_statements_reset()")

    def statements(self, database: str) -> tuple[int | None, list[tuple[str, int]]]:
        """Top-level statements run in ``database`` since the last reset (BEGIN and COMMIT
        included: each is a round trip), and the busiest ones."""
        if not self.statements_available:
            return None, []
        with self.engine.connect() as conn:
            rows = conn.execute(
                sa.text(
                    "SELECT s.query, s.calls FROM pg_stat_statements AS s"
                    " JOIN pg_database AS d ON d.oid = s.dbid"
                    " WHERE d.datname = :name AND s.toplevel ORDER BY s.calls DESC"
                ),
                {"name": database},
            ).all()
        return sum(int(r.calls) for r in rows), [(str(r.query), int(r.calls)) for r in rows[:8]]

    def plan_ms(self, database: str) -> float | None:
        """Milliseconds the server spent planning top-level statements in ``database`` since
        the last reset (None when ``pg_stat_statements.track_planning`` is off: a
        ``DATABASE_URL`` server may not track it)."""
        if not self.statements_available:
            return None
        with self.engine.connect() as conn:
            tracked = conn.exec_driver_sql(
                "SELECT current_setting('pg_stat_statements.track_planning', true)"
            ).scalar()
            if tracked != "on":
                return None
            total = conn.execute(
                sa.text(
                    "SELECT coalesce(sum(s.total_plan_time), 0) FROM pg_stat_statements AS s"
                    " JOIN pg_database AS d ON d.oid = s.dbid"
                    " WHERE d.datname = :name AND s.toplevel"
                ),
                {"name": database},
            ).scalar()
        return float(total)

    def wal_position(self) -> int:
        """The server's WAL insert position in bytes: the difference over a run is the WAL
        it wrote (cluster-wide, as :meth:`next_xid`: exact on the bench's own cluster, where
        one app runs at a time)."""
        return int(self.scalar("SELECT pg_wal_lsn_diff(pg_current_wal_insert_lsn(), '0/0')"))

    def next_xid(self) -> int:
        """The next transaction id, without consuming one.

        Only a transaction that writes gets an id, and each such commit writes a commit record
        and waits for the WAL flush (with ``synchronous_commit``): the durable commits. The
        counter is cluster-wide, which is exact on the bench's own cluster, where nothing else
        writes (autovacuum may add a few).
        """
        return int(self.scalar("SELECT pg_snapshot_xmax(pg_current_snapshot())::text::bigint"))

    def xact_commit(self, database: str) -> int:
        """``pg_stat_database.xact_commit``: every transaction that ended in a commit, also
        read-only ones (an autocommit SELECT is one)."""
        with self.engine.connect() as conn:
            conn.exec_driver_sql("SELECT pg_stat_clear_snapshot()")
            return int(
                conn.execute(
                    sa.text("SELECT xact_commit FROM pg_stat_database WHERE datname = :name"),
                    {"name": database},
                ).scalar_one()
            )

    def backend_cpu(self, database: str) -> dict[int, float]:
        """CPU seconds of the server processes serving ``database`` (empty when the server is
        not on this machine)."""
        with self.engine.connect() as conn:
            pids = conn.execute(
                sa.text("SELECT pid FROM pg_stat_activity WHERE datname = :name"),
                {"name": database},
            ).scalars()
            found = {}
            for pid in pids:
                cpu = process_cpu(int(pid))
                if cpu is not None and _is_postgres(int(pid)):
                    found[int(pid)] = cpu
            return found

    def dispose(self) -> None:
        self.engine.dispose()


def _is_postgres(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/comm").read_text().startswith("postgres")
    except OSError:
        return False


def cpu_delta(before: dict[int, float], after: dict[int, float]) -> float:
    """CPU used between two snapshots by processes seen in the second (new ones from 0)."""
    return sum(cpu - before.get(pid, 0.0) for pid, cpu in after.items())
