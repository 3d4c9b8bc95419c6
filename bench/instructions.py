"""``python -m bench instructions``: the app's CPU instructions per request, counted by valgrind.

Request rates and CPU times move with the machine: on a shared VM the hypervisor's steal made
two full runs of one commit disagree by 20%, and a flask_idem change worth 2% of a request is
lost in that. An instruction count is the same on every run: each app of :mod:`bench.apps`
runs in a child process under ``valgrind --tool=callgrind`` (Flask's test client, one request
at a time, against a throwaway PostgreSQL), once with ``--requests`` requests after a warm-up
and once with the warm-up alone; the difference over the requests is what one request costs
the app's process (every thread of it; the database's own work is not counted, see
``python -m bench profile`` for that). Valgrind runs the process about 50 times slower, so
work driven by the clock (the deadline watchdog's thread looks every 50 ms while calls are
armed) counts more here than it costs at full speed.

Needs valgrind (``apt-get install valgrind``); about 90 s per app and scenario, two at a time.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import os
import re
import secrets
import shutil
import subprocess
import sys
import typing as t
import uuid

import sqlalchemy as sa

from flask_idem.ops.migrate import upgrade
from tests.support import pgcluster

from . import apps
from .load import BODY
from .profile import FACTORIES

#: The requests every counted run makes first (pools filled, code paths warm).
WARM_UP = 30
_COLLECTED = re.compile(rb"Collected : (\d+)")


@dataclasses.dataclass(frozen=True)
class Counted:
    app: str
    scenario: str
    instructions: int


def child(app_name: str, scenario: str, url: str, requests: int) -> None:
    """What runs under valgrind: the warm-up, then ``requests`` requests (``python -m bench
    instructions --child``)."""
    client = FACTORIES[app_name](url).test_client()
    prefix = f"{scenario}-{secrets.token_hex(6)}"
    headers = {"Content-Type": "application/json"}
    for n in range(WARM_UP + requests):
        key = prefix if scenario == "S2" else f"{prefix}-{n}"
        answer = client.post("/payments", data=BODY, headers=headers | {"Idempotency-Key": key})
        assert answer.status_code == 201, answer.get_data()
    sys.stdout.flush()
    os._exit(0)  # no interpreter shutdown, which would be counted with the run


def _collected(app_name: str, scenario: str, url: str, requests: int) -> int:
    command = [
        shutil.which("valgrind") or "valgrind",
        "--tool=callgrind",
        "--callgrind-out-file=/dev/null",
        sys.executable,
        "-m",
        "bench",
        "instructions",
        "--child",
        app_name,
        scenario,
        url,
        str(requests),
    ]
    environment = os.environ | {"PYTHONHASHSEED": "0"}
    done = subprocess.run(command, capture_output=True, env=environment, check=False)
    found = _COLLECTED.search(done.stderr)
    if done.returncode != 0 or found is None:
        raise RuntimeError(f"valgrind run of {app_name} failed: {done.stderr[-2000:]!r}")
    return int(found.group(1))


def count(app_name: str, scenario: str, url: str, requests: int) -> Counted:
    """Instructions per request of one app and scenario (runs with and without requests)."""
    with_requests = _collected(app_name, scenario, url, requests)
    warm_up_only = _collected(app_name, scenario, url, 0)
    return Counted(app_name, scenario, (with_requests - warm_up_only) // requests)


def run(requests: int = 100, only: t.Sequence[str] = ()) -> list[Counted]:
    if shutil.which("valgrind") is None:
        raise SystemExit("python -m bench instructions needs valgrind (apt-get install valgrind)")
    cluster = pgcluster.Cluster(pgcluster.PG_DIR / f"instructions-{os.getpid()}")
    names = list(only or FACTORIES)
    with contextlib.ExitStack() as stack:
        cluster.start()
        stack.callback(cluster.stop)
        admin = sa.create_engine(apps.database_url(cluster.url), isolation_level="AUTOCOMMIT")
        stack.callback(admin.dispose)
        urls = {}
        for app_name in names:
            database = f"instructions_{app_name.replace('-', '_')}_{uuid.uuid4().hex[:6]}"
            with admin.connect() as conn:
                conn.exec_driver_sql(f'CREATE DATABASE "{database}"')
            url = sa.make_url(apps.database_url(cluster.url)).set(database=database)
            urls[app_name] = url.render_as_string(hide_password=False)
            apps.create_schema(urls[app_name])
            if app_name.startswith("idem") or app_name.endswith("partitioned"):
                upgrade(urls[app_name])
        jobs = [(name, scenario) for scenario in ("S1", "S2") for name in names]
        with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
            counted = list(
                pool.map(lambda job: count(job[0], job[1], urls[job[0]], requests), jobs)
            )
    print(format_text(counted))
    return counted


def format_text(counted: t.Sequence[Counted]) -> str:
    """A table per scenario: instructions per request, and per request over bare's."""
    lines = []
    for scenario in ("S1", "S2"):
        rows = [c for c in counted if c.scenario == scenario]
        if not rows:
            continue
        bare = next((c.instructions for c in rows if c.app == "bare"), None)
        lines.append(f"{scenario}: app instructions per request (valgrind), x bare")
        for row in rows:
            ratio = f"{row.instructions / bare:5.2f}" if bare else "    -"
            lines.append(f"  {row.app:32s} {row.instructions:>11,}  {ratio}")
    return "\n".join(lines)


def child_main(argv: t.Sequence[str]) -> None:
    app_name, scenario, url, requests = argv
    child(app_name, scenario, url, int(requests))
