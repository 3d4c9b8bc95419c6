"""A throwaway Redis server (Debian's ``redis-server``, installed when missing) for the broker
tests: the Celery and RQ recipes of docs/jobs.md run against it.

It listens on a free loopback port, keeps no data on disk (no RDB snapshot, no AOF) and lives
in a directory of its own under the worktree's ``.pg/``. When ``redis-server`` is missing and
the session runs as root (CI, containers), ``apt-get install -y redis-server`` installs it, as
:mod:`tests.support.pgbouncer` does with PgBouncer. When that cannot be done the broker tests skip
with one line saying why, or fail under ``FLASK_IDEM_REQUIRE_REDIS=1`` (``.ci/run``), where a skip
would hide a regression.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from . import debian, pgcluster

BINARY_CANDIDATES = ("redis-server", "/usr/bin/redis-server", "/usr/sbin/redis-server")
REQUIRE_VARIABLE = "FLASK_IDEM_REQUIRE_REDIS"
#: How a skip begins.
DID_NOT_RUN = "Broker tests did not run"


def required() -> bool:
    """Whether a missing Redis fails the run instead of skipping its tests (CI)."""
    return os.environ.get(REQUIRE_VARIABLE, "") not in ("", "0")


def binary() -> str | None:
    for candidate in BINARY_CANDIDATES:
        found = shutil.which(candidate)
        if found:
            return found
    return None


def ensure_binary() -> str:
    """``redis-server``, installed from the distribution when missing.

    :raises debian.NotInstallable: it is missing and cannot be installed (says why).
    """
    found = binary()
    if found is not None:
        return found
    debian.apt_install("redis-server")
    found = binary()
    if found is None:
        raise debian.NotInstallable("redis-server still missing after apt-get install")
    return found


def _new_directory() -> Path:
    """A directory of its own under the worktree's ``.pg/`` (gitignored, ``make clean``)."""
    pgcluster.PG_DIR.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix="redis-", dir=pgcluster.PG_DIR))


@dataclasses.dataclass
class RedisServer:
    """One ``redis-server`` process on a free loopback port."""

    directory: Path = dataclasses.field(default_factory=_new_directory)
    port: int = 0
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def log_file(self) -> Path:
        return self.directory / "redis.log"

    def start(self) -> None:
        executable = ensure_binary()
        self.port = pgcluster.free_port()
        command = [
            executable,
            "--bind",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--dir",
            str(self.directory),
            "--logfile",
            str(self.log_file),
            "--save",
            "",
            "--appendonly",
            "no",
            "--daemonize",
            "no",
        ]
        self.process = subprocess.Popen(
            command, cwd=self.directory, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        deadline = time.monotonic() + 30
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"redis-server exited:\n{self._log_tail()}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1) as sock:
                    sock.sendall(b"PING\r\n")
                    if sock.recv(64).startswith(b"+PONG"):
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"redis-server did not answer:\n{self._log_tail()}")
            time.sleep(0.05)

    def _log_tail(self) -> str:
        return self.log_file.read_text()[-2000:] if self.log_file.exists() else ""

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        shutil.rmtree(self.directory, ignore_errors=True)
