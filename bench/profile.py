"""``python -m bench profile``: where one request's time goes, app and database, per app.

Each app of :mod:`bench.apps` runs in this process (Flask's test client, no gunicorn, one
request at a time) against a durable throwaway PostgreSQL with ``pg_stat_statements``
tracking planning. For S1 (new keys) and S2 (replays) it reports:

- the app's CPU per request (``time.process_time``, so waiting for the database is not
  counted) and the same under ``cProfile`` with that CPU timer, grouped by package
  (flask_idem, SQLAlchemy, psycopg2's C calls, Flask/Werkzeug, json/hashlib, the rest) and
  the top functions by own time, and the Python function calls per request (a count, the
  same on every run: the figure to compare hot-path changes by on a noisy machine), with the
  calls each flask_idem step (or hand-written layer function) makes itself;
- the database's statements per request with mean execution and planning time.

The test client's own cost is in every app's figure alike; compare apps, not absolutes.
"""

from __future__ import annotations

import contextlib
import cProfile
import dataclasses
import os
import pstats
import secrets
import sys
import time
import types
import typing as t
import uuid

import sqlalchemy as sa

from flask_idem.ops.migrate import upgrade
from tests.support import pgcluster

from . import apps
from .load import BODY

FACTORIES: dict[str, t.Callable[[str], t.Any]] = {
    "bare": apps.bare,
    "idem": apps.protected,
    "idem-atomic": apps.protected_atomic,
    "handwritten": apps.handwritten,
    "handwritten-atomic": apps.handwritten_atomic,
    "handwritten-partitioned": apps.handwritten_partitioned,
    "handwritten-atomic-partitioned": apps.handwritten_atomic_partitioned,
}
GROUPS = (
    ("flask_idem", ("/flask_idem/",)),
    ("sqlalchemy", ("/sqlalchemy/",)),
    ("flask/werkzeug", ("/flask/", "/werkzeug/", "/itsdangerous/", "/jinja2/", "/blinker/")),
    ("json/hashlib/hmac", ("/json/", "hashlib", "_hashlib", "hmac")),
    ("bench view", ("/bench/",)),
)


@dataclasses.dataclass
class Profiled:
    app: str
    scenario: str
    requests: int
    cpu_us: float
    wall_us: float
    profiled_cpu_us: float
    #: Python function calls per request (C functions included), from cProfile: unlike CPU
    #: time, the same on every run, so changes to the hot path can be compared on a noisy VM.
    python_calls: float
    groups: dict[str, float]
    top: list[tuple[str, int, float]]
    #: flask_idem's own functions by inclusive time (callees included): what each step costs.
    steps: list[tuple[str, int, float]]
    #: Python calls per request attributed to the innermost flask_idem (or bench layer)
    #: function on the stack: which step makes the calls (a count, like ``python_calls``).
    callers: list[tuple[str, float]]
    statements: list[tuple[str, float, float, float]]


def _group(filename: str, name: str) -> str:
    if filename == "~":
        # C functions: psycopg2's execute/fetch are the database round trips.
        if "psycopg2" in name or "cursor" in name or "connection" in name:
            return "psycopg2 (C, incl. waits off-CPU)"
        for label, needles in GROUPS:
            if any(n in name for n in needles):
                return label
        return "builtins"
    for label, needles in GROUPS:
        if any(n in filename for n in needles):
            return label
    return "other python"


def _shorten(filename: str) -> str:
    for marker in ("site-packages/", "/flask_idem/", "/bench/", "/lib/python3"):
        if marker in filename:
            return filename[filename.index(marker) :]
    return filename


def profile(app_name: str, url: str, admin: sa.Engine, scenario: str, requests: int) -> Profiled:
    app = FACTORIES[app_name](url)
    client = app.test_client()
    headers = {"Content-Type": "application/json"}
    replay_key = f"replay-{secrets.token_hex(4)}"
    prefix = f"{app_name}-{scenario}-{secrets.token_hex(4)}"

    def one(n: int) -> None:
        key = replay_key if scenario == "S2" else f"{prefix}-{n}"
        answer = client.post("/payments", data=BODY, headers=headers | {"Idempotency-Key": key})
        assert answer.status_code == 201, answer.get_data()

    try:
        for n in range(200):
            one(-n - 1)
        one(-1_000)  # the replayed key exists
        database = sa.make_url(url).database
        with admin.connect() as conn:
            conn.exec_driver_sql("SELECT pg_stat_statements_reset()")
        cpu, wall = time.process_time(), time.perf_counter()
        for n in range(requests):
            one(n)
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
        with admin.connect() as conn:
            rows = conn.execute(
                sa.text(
                    "SELECT s.query, s.calls, s.mean_exec_time, s.mean_plan_time"
                    " FROM pg_stat_statements AS s JOIN pg_database AS d ON d.oid = s.dbid"
                    " WHERE d.datname = :name AND s.toplevel ORDER BY s.calls DESC"
                ),
                {"name": database},
            ).all()
        statements = [
            (
                " ".join(str(r.query).split())[:90],
                r.calls / requests,
                r.mean_exec_time,
                r.mean_plan_time,
            )
            for r in rows
            if r.calls >= requests // 2
        ]
        profiler = cProfile.Profile(time.process_time)
        profiler.enable()
        for n in range(requests):
            one(requests + n)
        profiler.disable()
        stats = pstats.Stats(profiler)
        groups: dict[str, float] = {}
        top = []
        steps = []
        total = 0.0
        calls_total = 0
        for (filename, _, name), (_, calls, own, inclusive, _) in stats.stats.items():  # type: ignore[attr-defined]
            label = _group(filename, name)
            groups[label] = groups.get(label, 0.0) + own
            total += own
            calls_total += calls
            top.append((f"{_shorten(filename)}:{name}", calls, own))
            if "/flask_idem/" in filename:
                steps.append((f"{_shorten(filename)}:{name}", calls, inclusive))
        top.sort(key=lambda item: -item[2])
        steps.sort(key=lambda item: -item[2])
        callers = _attributed_calls(lambda n: one(2 * requests + n), min(requests, 100))
        return Profiled(
            app=app_name,
            scenario=scenario,
            requests=requests,
            cpu_us=cpu / requests * 1e6,
            wall_us=wall / requests * 1e6,
            profiled_cpu_us=total / requests * 1e6,
            python_calls=calls_total / requests,
            groups={k: v / requests * 1e6 for k, v in sorted(groups.items(), key=lambda i: -i[1])},
            top=[(name, calls // requests, own / requests * 1e6) for name, calls, own in top[:18]],
            steps=[(name, calls // requests, t / requests * 1e6) for name, calls, t in steps[:24]],
            statements=statements,
            callers=callers,
        )
    finally:
        app.extensions["bench_engine"].dispose()


#: Code whose calls are attributed to its own functions (flask_idem, the hand-written layers).
_OWNERS = ("/flask_idem/", "/bench/apps.py")


def _attributed_calls(one: t.Callable[[int], None], requests: int) -> list[tuple[str, float]]:
    """Run ``requests`` requests counting every call (Python and C) against the innermost
    flask_idem or bench-layer function on the stack; calls outside any are left out."""
    counts: dict[str | None, int] = {}
    stack: list[str | None] = []

    def count(frame: types.FrameType, event: str, _arg: t.Any) -> None:
        if event in ("call", "c_call"):
            owner = stack[-1] if stack else None
            counts[owner] = counts.get(owner, 0) + 1
            if event == "call":
                code = frame.f_code
                mine = any(part in code.co_filename for part in _OWNERS)
                stack.append(f"{_shorten(code.co_filename)}:{code.co_name}" if mine else owner)
        elif event == "return" and stack:
            stack.pop()

    sys.setprofile(count)
    try:
        for n in range(requests):
            one(n)
    finally:
        sys.setprofile(None)
    counts.pop(None, None)
    ranked = sorted(counts.items(), key=lambda item: -item[1])
    return [(str(name), calls / requests) for name, calls in ranked[:20]]


def format_text(results: list[Profiled]) -> str:
    out = []
    for r in results:
        out.append(
            f"== {r.app} {r.scenario}: app CPU {r.cpu_us:.0f} us/req, wall {r.wall_us:.0f} us/req "
            f"(under cProfile {r.profiled_cpu_us:.0f} us/req), "
            f"{r.python_calls:.0f} Python calls/req"
        )
        out.append(
            "   by package (own CPU us/req, cProfile): "
            + ", ".join(f"{k} {v:.0f}" for k, v in r.groups.items())
        )
        out.append("   database, per request: calls x mean exec ms / mean plan ms:")
        for query, calls, exec_ms, plan_ms in r.statements:
            out.append(f"     {calls:4.2f} x {exec_ms:6.3f} / {plan_ms:6.3f}  {query}")
        out.append("   top own time (us/req, calls/req):")
        for name, calls, own in r.top:
            out.append(f"     {own:7.1f} {calls:4d}  {name}")
        if r.steps:
            out.append("   flask_idem, inclusive time (us/req, calls/req):")
            for name, calls, inclusive in r.steps:
                out.append(f"     {inclusive:7.1f} {calls:4d}  {name}")
        if r.callers:
            out.append(
                "   Python calls/req made by each step (innermost flask_idem or layer frame):"
            )
            for name, calls in r.callers:
                out.append(f"     {calls:7.1f}  {name}")
    return "\n".join(out)


def run(requests: int = 1_000, only: t.Sequence[str] = ()) -> list[Profiled]:
    cluster = pgcluster.Cluster(pgcluster.PG_DIR / f"profile-{os.getpid()}")
    results = []
    with contextlib.ExitStack() as stack:
        cluster.start(durable=True, settings={"pg_stat_statements.track_planning": "on"})
        stack.callback(cluster.stop)
        admin = sa.create_engine(apps.database_url(cluster.url), isolation_level="AUTOCOMMIT")
        stack.callback(admin.dispose)
        with admin.connect() as conn:
            conn.exec_driver_sql("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        for app_name in only or FACTORIES:
            name = f"profile_{app_name.replace('-', '_')}_{uuid.uuid4().hex[:6]}"
            with admin.connect() as conn:
                conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
            url = sa.make_url(apps.database_url(cluster.url)).set(database=name)
            rendered = url.render_as_string(hide_password=False)
            apps.create_schema(rendered)
            if app_name.startswith("idem") or app_name.endswith("partitioned"):
                upgrade(rendered)
            for scenario in ("S1", "S2"):
                result = profile(app_name, rendered, admin, scenario, requests)
                print(format_text([result]), file=sys.stderr, flush=True)
                results.append(result)
    return results
