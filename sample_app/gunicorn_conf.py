"""gunicorn settings for the sample app with several workers and correct metrics.

``gunicorn -c python:sample_app.gunicorn_conf -w 4 -b 127.0.0.1:8000 'sample_app:create_app()'``

Each worker is its own process with its own counters, so a scrape answered by one worker would
see a quarter of the truth. prometheus_client's multiprocess mode keeps every worker's values
in files under ``PROMETHEUS_MULTIPROC_DIR``; ``/metrics`` adds them up. The directory must be
set before any worker imports prometheus_client (here: in the master, when this file loads),
must be empty when the server starts (``on_starting``), and a dead worker must be marked as
such (``child_exit``) so its live gauges go; its counters stay, so totals never go down when
gunicorn replaces a worker.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import typing as t

# A directory of its own unless the environment names one (a deployment: a tmpfs path).
os.environ.setdefault("PROMETHEUS_MULTIPROC_DIR", tempfile.mkdtemp(prefix="sample-app-metrics-"))


def on_starting(server: t.Any) -> None:
    """Start from an empty directory: files of an earlier run would be added up too."""
    directory = os.environ["PROMETHEUS_MULTIPROC_DIR"]
    shutil.rmtree(directory, ignore_errors=True)
    os.makedirs(directory, exist_ok=True)


def child_exit(server: t.Any, worker: t.Any) -> None:
    """A worker died or was replaced: drop its live-gauge files (its counters stay)."""
    from flask_idem.metrics import child_exit as forget

    forget(worker.pid)
