"""gunicorn settings for the sample app with several workers and correct metrics.

``gunicorn -c python:sample_app.gunicorn_conf -w 4 -b 127.0.0.1:8000 'sample_app:create_app()'``

Each worker is its own process with its own counters, so a scrape answered by one worker would
see a quarter of the truth. prometheus_client's multiprocess mode keeps every worker's values
in files under ``PROMETHEUS_MULTIPROC_DIR``; ``/metrics`` adds them up. The directory must be
set before anything imports prometheus_client (here: in the master, when this file loads; the
``sample_app`` package gunicorn imports first does not import it),
must hold no values of an earlier run when the server starts (``on_starting``), and a dead
worker must be marked as such (``child_exit``) so its live gauges go; its counters stay, so
totals never go down when gunicorn replaces a worker.

A directory the environment names is never removed, nor anything in it but prometheus_client's
own files: it may be shared, or hold other files. Without one this file makes its own, and
removes it when the server exits (``on_exit``).
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import typing as t
from pathlib import Path

#: The files prometheus_client's multiprocess mode writes: ``counter_<pid>.db``,
#: ``gauge_livesum_<pid>.db`` and so on.
METRIC_FILE = re.compile(r"(counter|histogram|summary|gauge_[a-z]+)_.+\.db")

#: The directory this file made (and so may remove), or None when the environment named one.
created: str | None = None
if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
    created = tempfile.mkdtemp(prefix="sample-app-metrics-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = created


def on_starting(server: t.Any) -> None:
    """Start without an earlier run's values (they would be added up too)."""
    directory = Path(os.environ["PROMETHEUS_MULTIPROC_DIR"])
    directory.mkdir(parents=True, exist_ok=True)
    for path in directory.iterdir():
        if METRIC_FILE.fullmatch(path.name) and path.is_file():
            path.unlink(missing_ok=True)


def child_exit(server: t.Any, worker: t.Any) -> None:
    """A worker died or was replaced: drop its live-gauge files (its counters stay)."""
    from flask_idem.ops.metrics import child_exit as forget

    forget(worker.pid)


def on_exit(server: t.Any) -> None:
    """Remove the directory this file made; one the environment named stays."""
    if created is not None:
        shutil.rmtree(created, ignore_errors=True)
