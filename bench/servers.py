"""The apps under gunicorn (sync workers, loopback), as users deploy them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.support.pgcluster import free_port

from . import load
from .apps import FLUSH_PATH, HEALTH_PATH
from .db import children, process_cpu

ROOT = Path(__file__).resolve().parent.parent


class Gunicorn:
    """One gunicorn master serving one of the :mod:`bench.apps` factories."""

    def __init__(self, factory: str, database_url: str, workers: int, log_path: Path) -> None:
        self.factory = factory
        self.database_url = database_url
        self.workers = workers
        self.log_path = log_path
        self.port = free_port()
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        env = dict(os.environ, BENCH_DATABASE_URL=self.database_url, PYTHONPATH=str(ROOT))
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "gunicorn",
                "--workers",
                str(self.workers),
                "--worker-class",
                "sync",
                "--bind",
                f"{load.HOST}:{self.port}",
                "--backlog",
                "2048",
                "--timeout",
                "60",
                "--graceful-timeout",
                "5",
                "--log-level",
                "warning",
                "--error-logfile",
                str(self.log_path),
                f"bench.apps:{self.factory}()",
            ],
            cwd=ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Until every worker is up and answering."""
        assert self.process is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"gunicorn {self.factory} exited:\n{self.log_tail()}")
            if len(self.worker_pids()) == self.workers:
                try:
                    if load.get_json(self.port, HEALTH_PATH):
                        return
                except OSError:
                    pass
            time.sleep(0.1)
        raise RuntimeError(f"gunicorn {self.factory} did not answer:\n{self.log_tail()}")

    def worker_pids(self) -> list[int]:
        assert self.process is not None
        return children(self.process.pid)

    def cpu(self) -> dict[int, float]:
        """CPU seconds per worker process."""
        found = {}
        for pid in self.worker_pids():
            cpu = process_cpu(pid)
            if cpu is not None:
                found[pid] = cpu
        return found

    def flush_statistics(self) -> None:
        """Make every worker's database sessions publish their pending statistics (see
        :func:`bench.apps._add_bench_routes`): one request per worker, all at once."""
        for _ in range(3):
            answers = load.get_json(self.port, FLUSH_PATH, count=self.workers)
            if len({answer["pid"] for answer in answers}) == self.workers:
                return
        raise RuntimeError(f"could not reach all {self.workers} workers of {self.factory}")

    def log_tail(self) -> str:
        try:
            return self.log_path.read_text()[-3000:]
        except OSError:
            return ""

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
