"""A primary and a streaming standby on loopback, for failover tests.

The primary is a throwaway cluster (:class:`~tests.support.pgcluster.Cluster`, WAL for a replica,
durable commits); the standby is ``pg_basebackup -R`` of it on its own port, streaming from
it. With ``synchronous=True`` the primary waits for the standby's flush at every commit
(``synchronous_standby_names = '*'``), so a commit the client saw is on the standby when the
primary dies; without it the standby may lag, and :meth:`Replicated.hold_streaming` makes it
lag on purpose (its walsender stopped with ``SIGSTOP``, then killed) to show what an asynchronous
failover loses.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
import typing as t
from pathlib import Path

import sqlalchemy as sa

from . import pgcluster

#: Settings of both servers. Commits are written to the kernel at once (``synchronous_commit``),
#: which is all an immediate stop needs: the machine itself never crashes in a test.
COMMON = {
    "fsync": "off",
    "synchronous_commit": "on",
    "max_connections": "60",
    "wal_level": "replica",
    "max_wal_senders": "4",
    "hot_standby": "on",
}


class Replicated:
    """A primary, then a standby made from it; :meth:`fail_over` kills one and promotes the
    other."""

    def __init__(self, directory: Path, *, synchronous: bool) -> None:
        self.directory = directory
        self.primary = pgcluster.Cluster(directory / "primary")
        self.standby = pgcluster.Cluster(directory / "standby")
        self.synchronous = synchronous
        #: The walsender :meth:`hold_streaming` stopped.
        self._held: int | None = None

    def start(self) -> None:
        settings = dict(COMMON)
        if self.synchronous:
            settings["synchronous_standby_names"] = "'*'"
        self.primary.start(settings=settings)
        self._make_standby()

    def _make_standby(self) -> None:
        standby = self.standby
        standby.stop()
        standby.directory.mkdir(parents=True)
        # Where the primary's files went, for the same reason (see Cluster.start).
        if self.primary.server_dir is not None:
            standby.server_dir = Path(tempfile.mkdtemp(prefix="flask-idem-pg-"))
        standby.home.chmod(0o755)
        user = pgcluster._server_user()
        if user is not None:
            shutil.chown(standby.home, user)
        basebackup = pgcluster.find_binary("pg_basebackup")
        assert basebackup is not None, "pg_basebackup is missing"
        pgcluster._run_as_server_user(
            [basebackup, "-D", str(standby.datadir), "-h", "127.0.0.1"]
            + ["-p", str(self.primary.port), "-U", "postgres", "-R", "-X", "stream", "-c", "fast"],
            stdout=subprocess.DEVNULL,
        )
        standby.port = pgcluster.free_port()
        # Not the primary's synchronous_standby_names: once promoted, the standby has no
        # standby of its own to wait for.
        options = [
            "-c listen_addresses=127.0.0.1",
            f"-c port={standby.port}",
            "-c unix_socket_directories=''",
            *(f"-c {name}={value}" for name, value in COMMON.items()),
        ]
        standby._options = " ".join(options)
        standby.start_server()
        self.wait_streaming()

    def wait_streaming(self, timeout: float = 30) -> None:
        """Until the primary sees its standby streaming (and, when synchronous, as ``sync``)."""
        wanted = "sync" if self.synchronous else "async"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            rows = self._primary_sql("SELECT state, sync_state FROM pg_stat_replication")
            if any(row == ("streaming", wanted) for row in rows):
                return
            time.sleep(0.1)
        raise RuntimeError(f"the standby is not streaming ({wanted}): {rows}")

    def _primary_sql(self, statement: str) -> list[tuple[t.Any, ...]]:
        return _sql(self.primary.url, statement)

    def url(self, database: str, driver: str = "postgresql+psycopg2") -> str:
        """A libpq multi-host URL: both servers, the one that accepts writes is used."""
        hosts = f"host=127.0.0.1:{self.primary.port}&host=127.0.0.1:{self.standby.port}"
        return f"{driver}://postgres@/{database}?{hosts}&target_session_attrs=read-write"

    def stop_primary(self) -> None:
        """``pg_ctl stop -m immediate``: the primary dies as in a crash, committed WAL stays."""
        if self._held is not None:
            os.kill(self._held, signal.SIGKILL)
        self.primary.stop_server("immediate")

    def promote_standby(self) -> None:
        """``pg_ctl promote``, waiting until the standby accepts writes."""
        pg_ctl = pgcluster.find_binary("pg_ctl")
        assert pg_ctl is not None
        pgcluster._run_as_server_user(
            [pg_ctl, "-D", str(self.standby.datadir), "-w", "-t", "60", "promote"],
            stdout=subprocess.DEVNULL,
        )

    def wait_caught_up(self, timeout: float = 30) -> None:
        """Until the standby has replayed everything the primary has written so far."""
        deadline = time.monotonic() + timeout
        query = "SELECT bool_and(replay_lsn >= pg_current_wal_lsn()) FROM pg_stat_replication"
        while not self._primary_sql(query)[0][0]:
            assert time.monotonic() < deadline, "the standby does not catch up"
            time.sleep(0.05)

    def hold_streaming(self) -> None:
        """Stop the primary's walsender (``SIGSTOP``): what the primary commits from now on
        stays on the primary, as on an asynchronous standby that lags. :meth:`stop_primary`
        then kills it first, so that nothing it holds reaches the standby."""
        ((pid,),) = self._primary_sql("SELECT pid FROM pg_stat_replication")
        os.kill(pid, signal.SIGSTOP)
        self._held = pid

    def stop(self) -> None:
        self.standby.stop()
        self.primary.stop()
        shutil.rmtree(self.directory, ignore_errors=True)


def _sql(url: str, statement: str) -> list[tuple[t.Any, ...]]:
    engine = sa.create_engine(url.replace("postgresql://", "postgresql+psycopg2://", 1))
    try:
        with engine.connect() as conn:
            return [tuple(row) for row in conn.exec_driver_sql(statement)]
    finally:
        engine.dispose()
