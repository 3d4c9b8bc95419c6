"""Turn a results document into the summary, the target verdicts, a table and a JSON file.

Everything here works on the plain JSON document, so ``python -m bench report FILE`` re-prints
any earlier run. Ratios are computed per round (app / bare, and flask_idem / hand-written,
same scenario and concurrency, measured in the same round) and summarised by their median and
range, so one noisy round cannot make the headline.
"""

from __future__ import annotations

import datetime as dt
import json
import statistics
import typing as t
from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent / "results"
SCENARIO_NAMES = {"S1": "S1 new key", "S2": "S2 replay", "S3": "S3 storm"}
METRICS = (
    "rps",
    "p50",
    "p95",
    "p99",
    "statements",
    "xact_commits",
    "durable_commits",
    "wal_bytes",
    "plan_us",
    "app_cpu_ms",
    "db_cpu_ms",
    "client_cpu_ms",
    "server_cpu_ms",
)
#: The concurrency the performance targets (docs/performance.md) are stated at.
TARGET_CONCURRENCY = 8
#: A run that lost more than this share of the machine's CPU to the hypervisor is counted.
STEAL_NOTICE = 0.10
#: The floor, and the references flask_idem's apps are also compared with.
BARE, HANDWRITTEN = "bare", "handwritten"
HANDWRITTEN_ATOMIC = "handwritten-atomic"
HANDWRITTEN_PARTITIONED = "handwritten-partitioned"
HANDWRITTEN_ATOMIC_PARTITIONED = "handwritten-atomic-partitioned"
DURABLE, ATOMIC = "idem", "idem-atomic"
#: flask_idem's apps (durable and atomic claim).
IDEM_APPS = (DURABLE, ATOMIC)
#: What each flask_idem app is compared with in ``x hand``: the hand-written layer of its
#: kind (durable claim; one commit).
REFERENCES = {DURABLE: HANDWRITTEN, ATOMIC: HANDWRITTEN_ATOMIC}

Document = dict[str, t.Any]


def _median(values: t.Iterable[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def summarize(document: Document) -> list[dict[str, t.Any]]:
    """One row per (scenario, concurrency, app): medians over rounds, plus the per-round
    ratios to bare on the protected rows."""
    runs = document["runs"]
    keys = sorted({(r["scenario"], r["concurrency"], r["app"]) for r in runs})
    rows = []
    for scenario, concurrency, app in keys:
        mine = [
            r
            for r in runs
            if r["scenario"] == scenario and r["concurrency"] == concurrency and r["app"] == app
        ]
        row: dict[str, t.Any] = {
            "scenario": scenario,
            "concurrency": concurrency,
            "app": app,
            "rounds": len(mine),
            "requests": sum(r["requests"] for r in mine),
            "errors": sum(r["errors"] for r in mine),
            "statuses": _merge([r["statuses"] for r in mine]),
        }
        for metric in METRICS:
            row[metric] = _median(_metric(r, metric) for r in mine)
        if app != BARE:
            paired = _paired(runs, mine, scenario, concurrency, BARE)
            row["rps_ratio"] = _spread([r["rps"] / b["rps"] for r, b in paired if b["rps"]])
            row["p99_ratio"] = _spread([r["p99"] / b["p99"] for r, b in paired if b["p99"]])
            row["cpu_ratio"] = _spread(
                [
                    _metric(r, "server_cpu_ms") / _metric(b, "server_cpu_ms")  # type: ignore[operator]
                    for r, b in paired
                    if _metric(r, "server_cpu_ms") is not None and _metric(b, "server_cpu_ms")
                ]
            )
        if app in IDEM_APPS:
            paired = _paired(runs, mine, scenario, concurrency, REFERENCES[app])
            row["hand_ratio"] = _spread([r["rps"] / b["rps"] for r, b in paired if b["rps"]])
        rows.append(row)
    return rows


def _metric(run: dict[str, t.Any], metric: str) -> float | None:
    """A run's figure; ``server_cpu_ms`` is the app's and the database's CPU together."""
    if metric == "server_cpu_ms" and "server_cpu_ms" not in run:
        if run.get("app_cpu_ms") is None or run.get("db_cpu_ms") is None:
            return None
        return float(run["app_cpu_ms"] + run["db_cpu_ms"])
    value = run.get(metric)
    return None if value is None else float(value)


def _paired(
    runs: list[dict[str, t.Any]],
    mine: list[dict[str, t.Any]],
    scenario: str,
    concurrency: int,
    other: str,
) -> list[tuple[dict[str, t.Any], dict[str, t.Any]]]:
    """``mine`` with ``other``'s run of the same round, scenario and concurrency."""
    theirs = {
        r["round"]: r
        for r in runs
        if r["scenario"] == scenario and r["concurrency"] == concurrency and r["app"] == other
    }
    return [(r, theirs[r["round"]]) for r in mine if r["round"] in theirs]


def _spread(values: list[float]) -> dict[str, float | list[float]] | None:
    if not values:
        return None
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "rounds": values,
    }


def _merge(statuses: t.Iterable[dict[str, int]]) -> dict[str, int]:
    merged: dict[str, int] = {}
    for counts in statuses:
        for status, count in counts.items():
            merged[status] = merged.get(status, 0) + count
    return dict(sorted(merged.items()))


def _find(rows: list[dict[str, t.Any]], scenario: str, app: str) -> dict[str, t.Any] | None:
    for row in rows:
        if (row["scenario"], row["concurrency"], row["app"]) == (
            scenario,
            TARGET_CONCURRENCY,
            app,
        ):
            return row
    return None


def check_targets(document: Document, rows: list[dict[str, t.Any]]) -> list[dict[str, t.Any]]:
    """The performance targets of docs/performance.md (medians at concurrency 8, ratios to
    bare in the same run), each with its measured value and whether it holds; None where the
    run could not measure it (an app missing from the run is left out)."""
    apps = {row["app"] for row in rows}
    targets: list[dict[str, t.Any]] = []

    def add(name: str, value: float | str | None, holds: bool | None) -> None:
        targets.append({"target": name, "value": value, "holds": holds})

    def floor(app: str, scenario: str, target: str, field: str) -> None:
        """What a hand-written layer reaches on the same figure: no verdict, a measured floor."""
        if app in apps:
            value = ratio(_find(rows, scenario, app), field)
            targets.append(
                {
                    "target": f"  floor {app} {scenario} {target}",
                    "value": value,
                    "holds": None,
                    "floor": True,
                }
            )

    def ratio(row: dict[str, t.Any] | None, field: str) -> float | None:
        spread = row.get(field) if row else None
        return None if spread is None else float(spread["median"])

    def at_least(name: str, value: float | None, goal: float) -> None:
        add(name, value, None if value is None else value >= goal)

    def at_most(name: str, value: float | None, goal: float) -> None:
        add(name, value, None if value is None else value <= goal)

    def field(row: dict[str, t.Any] | None, name: str) -> float | None:
        return None if row is None or row.get(name) is None else float(row[name])

    bare1 = _find(rows, "S1", BARE)
    if ATOMIC in apps:
        s1, s2 = _find(rows, "S1", ATOMIC), _find(rows, "S2", ATOMIC)
        at_least("atomic S1 >= 0.70x bare req/s", ratio(s1, "rps_ratio"), 0.70)
        for app in (HANDWRITTEN_ATOMIC, HANDWRITTEN_ATOMIC_PARTITIONED):
            floor(app, "S1", "x bare req/s", "rps_ratio")
        plain = _find(rows, "S1", HANDWRITTEN_ATOMIC)
        db, plain_db = field(s1, "db_cpu_ms"), field(plain, "db_cpu_ms")
        at_most(
            "atomic S1 db CPU <= 1.15x the one-commit layer's",
            None if db is None or not plain_db else round(db / plain_db, 2),
            1.15,
        )
        wal = field(s1, "wal_bytes")
        at_most("atomic S1 WAL bytes per new key <= 900", wal, 900)
        commits = field(s1, "durable_commits")
        add(
            "atomic S1 1 commit per new key",
            commits,
            None if commits is None else abs(commits - 1) < 0.01,
        )
        at_least("atomic S2 >= 1.35x bare req/s", ratio(s2, "rps_ratio"), 1.35)
        for app in (HANDWRITTEN_ATOMIC, HANDWRITTEN_ATOMIC_PARTITIONED):
            floor(app, "S2", "x bare req/s", "rps_ratio")
        r = ratio(s2, "cpu_ratio")
        add("atomic S2 server CPU < bare request's", r, None if r is None else r < 1.0)
        for app in (HANDWRITTEN_ATOMIC, HANDWRITTEN_ATOMIC_PARTITIONED):
            floor(app, "S2", "x bare CPU", "cpu_ratio")
        at_most("atomic S2 no commit", field(s2, "durable_commits"), 0.005)
    if DURABLE in apps:
        s1, s2 = _find(rows, "S1", DURABLE), _find(rows, "S2", DURABLE)
        at_least("durable S1 >= 0.60x bare req/s", ratio(s1, "rps_ratio"), 0.60)
        for app in (HANDWRITTEN, HANDWRITTEN_PARTITIONED):
            floor(app, "S1", "x bare req/s", "rps_ratio")
        if HANDWRITTEN in apps:
            at_least("durable S1 ahead of hand-written", ratio(s1, "hand_ratio"), 1.0)
        at_least("durable S2 >= 1.35x bare req/s", ratio(s2, "rps_ratio"), 1.35)
        for app in (HANDWRITTEN, HANDWRITTEN_PARTITIONED):
            floor(app, "S2", "x bare req/s", "rps_ratio")
        r = ratio(s2, "cpu_ratio")
        add("durable S2 server CPU < bare request's", r, None if r is None else r < 1.0)
        for app in (HANDWRITTEN, HANDWRITTEN_PARTITIONED):
            floor(app, "S2", "x bare CPU", "cpu_ratio")
        d = None
        if field(s1, "statements") is not None and field(bare1, "statements") is not None:
            d = t.cast(float, field(s1, "statements")) - t.cast(float, field(bare1, "statements"))
        at_most("durable S1 statements <= bare + 2", d, 2.005)
        commits = field(s1, "durable_commits")
        add(
            "durable S1 2 commits per new key",
            commits,
            None if commits is None else abs(commits - 2) < 0.01,
        )
        v = field(s2, "statements")
        add("durable S2 exactly 1 statement", v, None if v is None else abs(v - 1) < 0.01)
        at_most("durable S2 no commit", field(s2, "durable_commits"), 0.005)

    for app in IDEM_APPS:
        if app not in apps:
            continue
        storms = [s for s in document.get("storms", []) if s["app"] == app]
        name = f"{app} S3 one row per storm, no 5xx"
        if not storms:
            add(name, None, None)
            continue
        rows_per_key = [n for s in storms for n in s["rows"]]
        server_errors = sum(
            s["errors"] + sum(n for k, n in s["statuses"].items() if k.startswith("5"))
            for s in storms
        )
        add(
            name,
            f"rows per storm {sorted(set(rows_per_key))}, 5xx {server_errors}",
            all(n == 1 for n in rows_per_key) and server_errors == 0,
        )
    return targets


def _fmt(value: float | None, digits: int = 1) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def _ratio(spread: dict[str, t.Any] | None) -> str:
    if spread is None:
        return ""
    return f"{spread['median']:.2f} [{spread['min']:.2f}-{spread['max']:.2f}]"


COLUMNS = (
    ("scenario", "<"),
    ("conc", ">"),
    ("app", "<"),
    ("req/s", ">"),
    ("p50 ms", ">"),
    ("p95 ms", ">"),
    ("p99 ms", ">"),
    ("x bare req/s", ">"),
    ("x bare p99", ">"),
    ("x hand req/s", ">"),
    ("stmt/req", ">"),
    ("commit/req", ">"),
    ("xact/req", ">"),
    ("WAL B/req", ">"),
    ("plan us/req", ">"),
    ("app CPU ms/req", ">"),
    ("db CPU ms/req", ">"),
    ("x bare CPU", ">"),
)


def table_rows(rows: list[dict[str, t.Any]]) -> list[list[str]]:
    body = []
    for row in rows:
        body.append(
            [
                SCENARIO_NAMES.get(row["scenario"], row["scenario"]),
                str(row["concurrency"]),
                row["app"],
                _fmt(row["rps"], 0),
                _fmt(row["p50"], 2),
                _fmt(row["p95"], 2),
                _fmt(row["p99"], 2),
                _ratio(row.get("rps_ratio")),
                _ratio(row.get("p99_ratio")),
                _ratio(row.get("hand_ratio")),
                _fmt(row["statements"], 2),
                _fmt(row["durable_commits"], 2),
                _fmt(row["xact_commits"], 2),
                _fmt(row.get("wal_bytes"), 0),
                _fmt(row.get("plan_us"), 1),
                _fmt(row["app_cpu_ms"], 2),
                _fmt(row["db_cpu_ms"], 2),
                _ratio(row.get("cpu_ratio")),
            ]
        )
    return body


def storm_lines(document: Document) -> list[str]:
    lines = []
    for s in document.get("storms", []):
        statuses = " ".join(f"{k}:{v}" for k, v in s["statuses"].items())
        lines.append(
            f"{SCENARIO_NAMES['S3']} {s['app']:<11}: {s['storms']} storms of {s['size']}, "
            f"payment rows per key {sorted(set(s['rows']))}, statuses {statuses}, "
            f"client errors {s['errors']}, stmt/req {_fmt(s['statements'], 2)}, "
            f"commit/req {_fmt(s['durable_commits'], 2)}"
        )
    return lines


def steal_line(document: Document) -> str | None:
    """How much CPU the hypervisor took during the measured runs (None if not recorded)."""
    shares = sorted(run["steal"] for run in document["runs"] if run.get("steal") is not None)
    if not shares:
        return None
    over = sum(1 for share in shares if share > STEAL_NOTICE)
    return (
        f"CPU stolen by the hypervisor during the measured runs (share of the machine's CPU "
        f"time, /proc/stat): median {statistics.median(shares):.1%}, max {shares[-1]:.1%}; "
        f"{over} of {len(shares)} runs above {STEAL_NOTICE:.0%}"
    )


def header(document: Document) -> str:
    options, pg, machine = document["options"], document["postgresql"], document["machine"]
    return (
        f"flask_idem bench ({options['mode']}): {options['workers']} gunicorn sync workers per "
        f"app, client {options['client']}, {options['rounds']} interleaved rounds of "
        f"{options['seconds']:g} s; PostgreSQL {pg.get('server_version')} (fsync="
        f"{pg.get('fsync')}, synchronous_commit={pg.get('synchronous_commit')}); "
        f"{machine.get('nproc')} CPUs ({machine.get('Model name', '?')})"
    )


def format_text(document: Document) -> str:
    """The table as printed by the bench."""
    rows = summarize(document)
    names = [name for name, _ in COLUMNS]
    body = table_rows(rows)
    widths = [max(len(line[i]) for line in [names, *body]) for i in range(len(names))]

    def line(cells: list[str]) -> str:
        aligned = zip(cells, COLUMNS, widths, strict=True)
        return "  ".join(f"{cell:{align}{width}}" for cell, (_, align), width in aligned)

    out = [header(document), "", line(names), "  ".join("-" * w for w in widths)]
    out += [line(cells) for cells in body]
    stolen = steal_line(document)
    out += ["", *storm_lines(document), *([stolen] if stolen else [])]
    out += ["", "targets (medians at concurrency 8):"]
    for target in check_targets(document, rows):
        verdict = {True: "holds", False: "MISSED", None: "not measured"}[target["holds"]]
        if target.get("floor"):
            verdict = "(measured floor, no target)"
        value = target["value"]
        shown = f"{value:.2f}" if isinstance(value, float) else str(value)
        out.append(f"  {target['target']:<56} {shown:<32} {verdict}")
    out += [
        "",
        "x bare: per-round ratio app/bare, median [min-max]; x hand: flask_idem/hand-written "
        "req/s (idem: handwritten; idem-atomic: handwritten-atomic); x bare CPU: server CPU "
        "(app + db) per request. stmt/req: top-level statements (BEGIN/COMMIT included) "
        "from pg_stat_statements. commit/req: durable "
        "(write) commits. xact/req: pg_stat_database xact_commit, read-only autocommit "
        "statements included. WAL B/req: WAL bytes written per request (cluster-wide). "
        "plan us/req: the server's planning time (pg_stat_statements total_plan_time; n/a "
        "where track_planning is off). CPU: gunicorn workers and PostgreSQL backends, from "
        "/proc.",
    ]
    return "\n".join(out)


def format_markdown(document: Document) -> str:
    """The same table for README."""
    rows = summarize(document)
    names = [name for name, _ in COLUMNS]
    out = [
        "| " + " | ".join(names) + " |",
        "| " + " | ".join("---" if a == "<" else "---:" for _, a in COLUMNS) + " |",
    ]
    out += ["| " + " | ".join(cells) + " |" for cells in table_rows(rows)]
    return "\n".join(out)


def complete(document: Document) -> Document:
    """Add the summary and the target verdicts to a results document."""
    rows = summarize(document)
    return document | {"summary": rows, "targets": check_targets(document, rows)}


def write(document: Document, directory: Path = RESULTS_DIR) -> Path:
    """Write ``bench-<mode>-<UTC time>.json`` (git-ignored) and return its path."""
    directory.mkdir(parents=True, exist_ok=True)
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    kind = document.get("kind", "bench")
    name = f"{kind}-{stamp}" if kind != "bench" else f"bench-{document['options']['mode']}-{stamp}"
    path = directory / f"{name}.json"
    path.write_text(json.dumps(document, indent=2, default=str) + "\n")
    return path
