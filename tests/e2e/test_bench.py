"""Smoke tests of ``make bench``: its apps answer alike, its client counts right, its report
adds up. No timing assertions: benchmarks are not unit tests."""

from __future__ import annotations

import json
import threading
import time
import typing as t
from pathlib import Path

import flask
import pytest
import sqlalchemy as sa
from werkzeug.serving import make_server

from bench import db, load, report, runner
from bench.__main__ import parse
from bench.apps import (
    HEALTH_PATH,
    bare,
    create_schema,
    handwritten,
    handwritten_atomic,
    handwritten_atomic_partitioned,
    handwritten_partitioned,
    protected,
    protected_atomic,
)
from flask_idem.core.key_digest import unkeyed
from flask_idem.ops.migrate import upgrade

BODY = {"amount": 4200, "currency": "EUR", "customer": "cus_bench"}


@pytest.fixture(scope="module")
def bench_url(fresh_pg_database: t.Callable[[], str]) -> str:
    url = fresh_pg_database()
    upgrade(url)
    create_schema(url)
    return url


def _rows(url: str, key: str) -> int:
    engine = sa.create_engine(sa.make_url(url).set(drivername="postgresql+psycopg2"))
    try:
        with engine.connect() as conn:
            return int(
                conn.execute(
                    sa.text("SELECT count(*) FROM bench_payments WHERE idempotency_key = :k"),
                    {"k": key},
                ).scalar_one()
            )
    finally:
        engine.dispose()


@pytest.mark.postgresql
@pytest.mark.parametrize(
    "factory",
    [
        bare,
        protected,
        protected_atomic,
        handwritten,
        handwritten_atomic,
        handwritten_partitioned,
        handwritten_atomic_partitioned,
    ],
)
def test_apps_answer_the_same_payment(bench_url: str, factory: t.Any) -> None:
    app = factory(bench_url)
    sent: list[str] = []

    def record(_conn: t.Any, _cursor: t.Any, statement: str, *_args: t.Any) -> None:
        sent.append(statement)

    try:
        client = app.test_client()
        key = f"smoke-{factory.__name__}"
        headers = {"Idempotency-Key": key}
        sa.event.listen(sa.Engine, "before_cursor_execute", record)
        try:
            first = client.post("/payments", json=BODY, headers=headers)
        finally:
            sa.event.remove(sa.Engine, "before_cursor_execute", record)
        assert first.status_code == 201
        # The runner counts served requests by this statement (per-request figures divide by
        # it): exactly one per request.
        name = {function: app for app, function in runner.FACTORIES.items()}[factory.__name__]
        assert len([sql for sql in sent if runner._MARKERS[name] in sql]) == 1, sent
        payment = first.get_json()
        assert payment["id"].startswith("pay_")
        assert {k: payment[k] for k in ("amount", "currency", "customer")} == BODY
        assert first.headers["Location"] == f"/payments/{payment['id']}"
        again = client.post("/payments", json=BODY, headers=headers)
        assert again.status_code == 201
        if factory is not bare:
            # A replay: same answer, one row.
            assert again.headers["Idempotent-Replayed"] == "true"
            assert again.get_json() == payment
            assert again.headers["Location"] == first.headers["Location"]
            assert _rows(bench_url, key) == 1
            other = client.post("/payments", json=dict(BODY, amount=1), headers=headers)
            assert other.status_code == 422
            assert _rows(bench_url, key) == 1
        else:
            # The bare app does the work again: that is what the bench compares against.
            assert again.get_json()["id"] != payment["id"]
            assert _rows(bench_url, key) == 2
        assert client.get(HEALTH_PATH).status_code == 200
    finally:
        app.extensions["bench_engine"].dispose()


@pytest.mark.postgresql
def test_handwritten_layer_409_in_flight_and_release_on_failure(bench_url: str) -> None:
    app = handwritten(bench_url)
    engine = app.extensions["bench_engine"]
    try:
        client = app.test_client()
        with engine.begin() as conn:
            conn.execute(
                sa.text(
                    "INSERT INTO bench_handwritten_keys (tenant, key, fingerprint, state)"
                    " VALUES ('bench', 'hw-running', '\\x00', 'running')"
                )
            )
        running = client.post("/payments", json=BODY, headers={"Idempotency-Key": "hw-running"})
        assert running.status_code == 409
        assert client.post("/payments", json=BODY).status_code == 400
        # A failing view (no amount) releases its claim: the corrected retry runs.
        headers = {"Idempotency-Key": "hw-fails"}
        app.config["PROPAGATE_EXCEPTIONS"] = False
        failed = client.post("/payments", json={"currency": "EUR"}, headers=headers)
        assert failed.status_code == 500
        assert client.post("/payments", json=BODY, headers=headers).status_code == 201
        assert _rows(bench_url, "hw-fails") == 1
    finally:
        engine.dispose()


@pytest.mark.postgresql
@pytest.mark.parametrize(
    "factory",
    [handwritten, handwritten_atomic, handwritten_partitioned, handwritten_atomic_partitioned],
)
def test_hand_written_layers_run_a_key_once_under_concurrency(
    bench_url: str, factory: t.Any
) -> None:
    """The references are correct layers too: 8 threads on one key, one payment, the others
    replayed or 409; a failing view leaves nothing and its retry runs."""
    app = factory(bench_url)
    storm, fails = f"storm-{factory.__name__}", f"fails-{factory.__name__}"
    try:
        barrier = threading.Barrier(8)
        statuses: list[int] = []

        def send() -> None:
            client = app.test_client()
            barrier.wait()
            answer = client.post("/payments", json=BODY, headers={"Idempotency-Key": storm})
            statuses.append(answer.status_code)

        threads = [threading.Thread(target=send) for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert _rows(bench_url, storm) == 1
        assert set(statuses) <= {201, 409} and 201 in statuses
        client = app.test_client()
        app.config["PROPAGATE_EXCEPTIONS"] = False
        headers = {"Idempotency-Key": fails}
        assert (
            client.post("/payments", json={"currency": "EUR"}, headers=headers).status_code == 500
        )
        assert client.post("/payments", json=BODY, headers=headers).status_code == 201
        assert _rows(bench_url, fails) == 1
    finally:
        app.extensions["bench_engine"].dispose()


def _admin(url: str, **options: t.Any) -> sa.Engine:
    return sa.create_engine(sa.make_url(url).set(drivername="postgresql+psycopg2"), **options)


_SCOPE_LOCK = (
    "SELECT pg_advisory_xact_lock(hashtext('flask_idem'),"
    " hashtext('bench' || E'\\x1f' || 'POST /payments' || E'\\x1f' || :key))"
)


@pytest.mark.postgresql
def test_partitioned_layer_409_in_flight_and_releases_only_its_own_claim(bench_url: str) -> None:
    app = handwritten_partitioned(bench_url)
    admin = _admin(bench_url, isolation_level="AUTOCOMMIT")
    try:
        client = app.test_client()
        with admin.connect() as conn:
            # A claim in progress (another worker's), and an expired record of another key.
            conn.exec_driver_sql(
                "SELECT * FROM idempotency_claim('bench', 'POST /payments',"
                f" '{unkeyed('bench', 'pt-running')}', '\\x00', 'other', 86400, 30)"
            )
            conn.exec_driver_sql(
                "INSERT INTO idempotency_keys (tenant, endpoint, key, fingerprint, state,"
                " created_at, completed_at, expires_at) VALUES ('bench', 'POST /payments',"
                f" '{unkeyed('bench', 'pt-fails')}', '\\x00', 'completed',"
                " now() - interval '3 days',"
                " now() - interval '3 days', now() - interval '2 days')"
            )
        headers = {"Idempotency-Key": "pt-running"}
        assert client.post("/payments", json=BODY, headers=headers).status_code == 409
        app.config["PROPAGATE_EXCEPTIONS"] = False
        headers = {"Idempotency-Key": "pt-fails"}
        assert (
            client.post("/payments", json={"currency": "EUR"}, headers=headers).status_code == 500
        )
        with admin.connect() as conn:
            left = conn.exec_driver_sql(
                f"SELECT state FROM idempotency_keys WHERE key = '{unkeyed('bench', 'pt-fails')}'"
            ).scalars()
            # The failed claim is gone; the expired record it did not own is not.
            assert list(left) == ["completed"]
        assert client.post("/payments", json=BODY, headers=headers).status_code == 201
        assert _rows(bench_url, "pt-fails") == 1
    finally:
        app.extensions["bench_engine"].dispose()
        admin.dispose()


def _send(app: flask.Flask, key: str, answers: list[t.Any]) -> None:
    answers.append(app.test_client().post("/payments", json=BODY, headers={"Idempotency-Key": key}))


@pytest.mark.postgresql
def test_atomic_partitioned_layer_never_waits_for_a_held_scope(bench_url: str) -> None:
    """With the scope's lock held elsewhere: a completed key replays, a new one is 409, and
    neither waits for the lock (the atomic claim only tries it)."""
    app = handwritten_atomic_partitioned(bench_url)
    admin = _admin(bench_url)
    try:
        client = app.test_client()
        done = {"Idempotency-Key": "apt-done"}
        first = client.post("/payments", json=BODY, headers=done)
        assert first.status_code == 201
        for key, expected in (("apt-done", 201), ("apt-new", 409)):
            answers: list[t.Any] = []
            with admin.connect() as holder, holder.begin():
                holder.execute(sa.text(_SCOPE_LOCK), {"key": unkeyed("bench", key)})
                sender = threading.Thread(target=_send, args=(app, key, answers))
                sender.start()
                sender.join(timeout=5)
                waited = sender.is_alive()
            sender.join()
            assert not waited, "the claim waited for the held lock"
            assert answers[0].status_code == expected
            if expected == 201:
                assert answers[0].headers["Idempotent-Replayed"] == "true"
                assert answers[0].get_json() == first.get_json()
        assert _rows(bench_url, "apt-new") == 0
    finally:
        app.extensions["bench_engine"].dispose()
        admin.dispose()


def test_every_app_has_a_factory_a_marker_and_records() -> None:
    from bench import apps

    for app in runner.APPS:
        assert callable(getattr(apps, runner.FACTORIES[app]))
        assert app in runner._MARKERS
    assert set(runner._RECORDS) == set(runner.PROTECTED_APPS)
    assert set(runner.IDEM_APPS) == set(report.IDEM_APPS)
    assert set(report.REFERENCES.values()) <= set(runner.APPS)
    # The durable claim's marker must not count the atomic claim's calls.
    assert runner._MARKERS["idem"] not in "SELECT * FROM idempotency_claim_reserve($1)"


@pytest.fixture
def echo_server() -> t.Iterator[int]:
    """A tiny server answering like the payment endpoint; replays for the key ``same``."""
    app = flask.Flask("bench-smoke")
    seen: set[str] = set()
    lock = threading.Lock()

    @app.post("/payments")
    def pay() -> t.Any:
        key = flask.request.headers.get("Idempotency-Key", "")
        with lock:
            replay = key in seen
            seen.add(key)
        headers = {"Idempotent-Replayed": "true"} if replay else {}
        return flask.jsonify(id="pay_1", key=key), 201, headers

    @app.get("/stats")
    def stats() -> t.Any:
        return {"ok": True}

    server = make_server("127.0.0.1", 0, app, threaded=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_port
    finally:
        server.shutdown()
        thread.join(timeout=10)


def test_python_client_counts_requests_and_statuses(echo_server: int) -> None:
    result = load.python_load(
        echo_server, lambda n: f"k-{n}", concurrency=4, max_requests=40, max_seconds=20
    )
    assert (result.requests, result.errors, result.statuses) == (40, 0, {"201": 40})
    assert 0 < result.p50 <= result.p95 <= result.p99

    storm = load.storm(echo_server, "same", 10)
    assert storm.errors == 0
    assert sum(storm.statuses.values()) == 10
    assert storm.statuses.get("201 replayed", 0) == 10 - storm.statuses.get("201", 0)
    assert storm.distinct_bodies == 1
    assert load.get_json(echo_server, "/stats", count=2) == [{"ok": True}] * 2


def test_percentile_is_nearest_rank() -> None:
    values = list(range(1, 101))
    assert load.percentile(values, 0.5) == 50
    assert load.percentile(values, 0.99) == 99
    assert load.percentile([], 0.5) == 0.0


def test_wrk_script_renders() -> None:
    script = load._WRK_SCRIPT % {
        "mode": "new",
        "prefix": "p",
        "limit": 10,
        "body": load.BODY.decode(),
        "path": "/payments",
    }
    assert "wrk.thread:stop()" in script and "WRK_JSON" in script


def _run(round_: int, scenario: str, app: str, rps: float, p99: float) -> dict[str, t.Any]:
    per_request = {
        ("S1", "bare"): (3.0, 1.0, 1.0),
        ("S1", "idem"): (5.0, 2.0, 1.3),
        ("S1", "idem-atomic"): (5.0, 1.0, 1.2),
        ("S1", "handwritten"): (5.0, 2.0, 1.4),
        ("S1", "handwritten-atomic"): (5.0, 1.0, 1.1),
        ("S1", "handwritten-partitioned"): (5.0, 2.0, 1.45),
        ("S1", "handwritten-atomic-partitioned"): (5.0, 1.0, 1.15),
        ("S2", "bare"): (3.0, 1.0, 1.0),
        ("S2", "idem"): (1.0, 0.0, 0.5),
        ("S2", "idem-atomic"): (3.0, 0.0, 0.6),
        ("S2", "handwritten"): (2.0, 0.0, 0.6),
        ("S2", "handwritten-atomic"): (3.0, 0.0, 0.55),
        ("S2", "handwritten-partitioned"): (1.0, 0.0, 0.65),
        ("S2", "handwritten-atomic-partitioned"): (3.0, 0.0, 0.7),
    }
    statements, commits, cpu = per_request[scenario, app]
    return {
        "round": round_,
        "scenario": scenario,
        "concurrency": 8,
        "app": app,
        "client": "python",
        "requests": 100,
        "seconds": 1.0,
        "rps": rps,
        "p50": 1.0,
        "p95": 2.0,
        "p99": p99,
        "mean": 1.0,
        "statuses": {"201": 100},
        "errors": 0,
        "statements": statements,
        "xact_commits": commits,
        "durable_commits": commits,
        "app_cpu_ms": cpu,
        "db_cpu_ms": 0.5 * cpu,
        "wal_bytes": 800.0,
        "client_cpu_ms": 0.1,
        "top_statements": [],
    }


def _document() -> dict[str, t.Any]:
    runs = []
    for round_, (s1, s2) in enumerate([(0.8, 1.4), (0.7, 1.2), (0.9, 1.5)], start=1):
        runs += [
            _run(round_, "S1", "bare", 100.0, 10.0),
            _run(round_, "S1", "idem", 100.0 * s1, 12.0),
            _run(round_, "S1", "idem-atomic", 100.0 * (s1 + 0.05), 11.0),
            _run(round_, "S1", "handwritten", 100.0 * (s1 - 0.1), 12.0),
            _run(round_, "S1", "handwritten-atomic", 100.0 * (s1 + 0.1), 10.0),
            _run(round_, "S1", "handwritten-partitioned", 100.0 * (s1 - 0.2), 10.0),
            _run(round_, "S1", "handwritten-atomic-partitioned", 100.0 * (s1 - 0.05), 10.0),
            _run(round_, "S2", "bare", 100.0, 10.0),
            _run(round_, "S2", "idem", 100.0 * s2, 8.0),
            _run(round_, "S2", "idem-atomic", 100.0 * s2, 8.0),
            _run(round_, "S2", "handwritten", 100.0 * s2, 8.0),
            _run(round_, "S2", "handwritten-atomic", 100.0 * s2, 8.0),
            _run(round_, "S2", "handwritten-partitioned", 100.0 * (s2 - 0.1), 8.0),
            _run(round_, "S2", "handwritten-atomic-partitioned", 100.0 * (s2 - 0.2), 8.0),
        ]
    storms = [
        {
            "app": app,
            "size": 50,
            "storms": 2,
            "statuses": {"201": 2, "409": 98},
            "errors": 0,
            "rows": [1, 1],
            "records": [1, 1],
            "distinct_bodies": [1, 1],
            "statements": 1.0,
            "durable_commits": 0.02,
        }
        for app in ("idem", "idem-atomic", "handwritten")
    ]
    return {
        "options": {"mode": "quick", "workers": 4, "client": "python", "rounds": 3, "seconds": 1},
        "postgresql": {"server_version": "15", "fsync": "on", "synchronous_commit": "on"},
        "machine": {"nproc": 2},
        "runs": runs,
        "storms": storms,
    }


def test_report_ratios_targets_and_files(tmp_path: Path) -> None:
    document = report.complete(_document())
    idem_s1 = next(r for r in document["summary"] if (r["scenario"], r["app"]) == ("S1", "idem"))
    assert idem_s1["rps_ratio"]["median"] == pytest.approx(0.8)
    assert (idem_s1["rps_ratio"]["min"], idem_s1["rps_ratio"]["max"]) == pytest.approx((0.7, 0.9))
    assert idem_s1["p99_ratio"]["median"] == pytest.approx(1.2)
    assert idem_s1["hand_ratio"]["median"] == pytest.approx(0.8 / 0.7)
    assert idem_s1["cpu_ratio"]["median"] == pytest.approx(1.3)
    atomic_s1 = next(
        r for r in document["summary"] if (r["scenario"], r["app"]) == ("S1", "idem-atomic")
    )
    # The atomic app is compared with the one-commit hand-written layer.
    assert atomic_s1["hand_ratio"]["median"] == pytest.approx(0.85 / 0.9)
    floors = {t["target"]: t["value"] for t in document["targets"] if t.get("floor")}
    # Floors: what the hand-written layers reach, no verdict; only apps in the run.
    assert floors == {
        "  floor handwritten-atomic S1 x bare req/s": pytest.approx(0.9),
        "  floor handwritten-atomic S2 x bare req/s": pytest.approx(1.4),
        "  floor handwritten-atomic S2 x bare CPU": pytest.approx(0.55),
        "  floor handwritten S1 x bare req/s": pytest.approx(0.7),
        "  floor handwritten S2 x bare req/s": pytest.approx(1.4),
        "  floor handwritten S2 x bare CPU": pytest.approx(0.6),
        "  floor handwritten-partitioned S1 x bare req/s": pytest.approx(0.6),
        "  floor handwritten-partitioned S2 x bare req/s": pytest.approx(1.3),
        "  floor handwritten-partitioned S2 x bare CPU": pytest.approx(0.65),
        "  floor handwritten-atomic-partitioned S1 x bare req/s": pytest.approx(0.75),
        "  floor handwritten-atomic-partitioned S2 x bare req/s": pytest.approx(1.2),
        "  floor handwritten-atomic-partitioned S2 x bare CPU": pytest.approx(0.7),
    }
    assert all(t["holds"] is None for t in document["targets"] if t.get("floor"))
    verdicts = {t["target"]: t["holds"] for t in document["targets"] if not t.get("floor")}
    assert verdicts == {
        "atomic S1 >= 0.70x bare req/s": True,
        "atomic S1 db CPU <= 1.15x the one-commit layer's": True,
        "atomic S1 WAL bytes per new key <= 900": True,
        "atomic S1 1 commit per new key": True,
        "atomic S2 >= 1.35x bare req/s": True,
        "atomic S2 server CPU < bare request's": True,
        "atomic S2 no commit": True,
        "durable S1 >= 0.60x bare req/s": True,
        "durable S1 ahead of hand-written": True,
        "durable S2 >= 1.35x bare req/s": True,
        "durable S2 server CPU < bare request's": True,
        "durable S1 statements <= bare + 2": True,
        "durable S1 2 commits per new key": True,
        "durable S2 exactly 1 statement": True,
        "durable S2 no commit": True,
        "idem S3 one row per storm, no 5xx": True,
        "idem-atomic S3 one row per storm, no 5xx": True,
    }
    text = report.format_text(document)
    assert "x bare req/s" in text and "0.80 [0.70-0.90]" in text and "MISSED" not in text
    assert report.format_markdown(document).startswith("| scenario | conc | app |")
    path = report.write(document, tmp_path)
    assert path.name.startswith("bench-quick-")
    assert json.loads(path.read_text())["targets"] == document["targets"]


def test_report_flags_a_missed_target() -> None:
    document = _document()
    for run in document["runs"]:
        if (run["scenario"], run["app"]) == ("S2", "idem"):
            run["statements"] = 2.0
        if (run["scenario"], run["app"]) == ("S1", "idem-atomic"):
            run["db_cpu_ms"] = 0.7  # 1.27x the one-commit layer's 0.55 ms
            run["wal_bytes"] = 901.0
    verdicts = {t["target"]: t["holds"] for t in report.complete(document)["targets"]}
    assert verdicts["durable S2 exactly 1 statement"] is False
    assert verdicts["atomic S1 db CPU <= 1.15x the one-commit layer's"] is False
    assert verdicts["atomic S1 WAL bytes per new key <= 900"] is False


def test_report_says_how_much_cpu_the_hypervisor_took() -> None:
    document = _document()
    assert "stolen" not in report.format_text(document)  # older results carry no figure
    for i, run in enumerate(document["runs"]):
        run["steal"] = 0.3 if i < 3 else 0.01
    line = report.steal_line(document)
    assert line is not None and line in report.format_text(document)
    assert "median 1.0%, max 30.0%; 3 of" in line, line
    before = db.machine_cpu()
    time.sleep(0.1)
    after = db.machine_cpu()
    assert before is not None and after is not None and after[1] > before[1]
    share = db.stolen_share(before, after)
    assert share is not None and 0 <= share <= 1


def test_command_line() -> None:
    assert parse(["--quick"]).command == "run"
    assert parse(["--quick"]).quick is True
    assert parse(["growth", "--sizes", "1,5"]).sizes == (1.0, 5.0)
    assert parse(["report", "x.json", "--markdown"]).markdown is True
    counted = parse(["instructions", "--apps", "bare,idem", "--requests", "50"])
    assert (counted.command, counted.apps) == ("instructions", ("bare", "idem"))
    assert counted.requests == 50


def test_instruction_counts_print_per_scenario_against_bare() -> None:
    from bench.instructions import Counted, format_text

    text = format_text(
        [
            Counted("bare", "S1", 1_000_000),
            Counted("idem", "S1", 1_500_000),
            Counted("idem", "S2", 9),
        ]
    )
    assert "idem" in text and "1,500,000   1.50" in text, text
    assert text.splitlines()[-1].endswith("    -"), "no bare run in S2: no ratio"


def test_sealing_bench_measures_every_variant(tmp_path: Path, pg_url: str) -> None:
    from bench import sealing
    from flask_idem.store import create_store

    options = sealing.SealingOptions(codec_iterations=2, store_operations=3, rows=5)
    body = sealing.payment_body(4096)
    assert len(body) >= 4096 and json.loads(body)["object"] == "payment"
    document: dict[str, t.Any] = {**sealing.measure_codec(options), "store": [], "size": []}
    sqlite_url = f"sqlite:///{tmp_path / 'sealing.sqlite3'}"
    upgrade(sqlite_url)
    for url in (sqlite_url, pg_url):
        store = create_store(url)
        try:
            document["store"] += sealing.measure_store(store, options)
            document["size"] += sealing.measure_size(store, options)
        finally:
            store.engine.dispose()
    assert {row["variant"] for row in document["codec"]} == set(sealing.VARIANTS)
    assert {(row["dialect"], row["variant"]) for row in document["size"]} == {
        (dialect, variant) for dialect in ("postgresql", "sqlite") for variant in sealing.VARIANTS
    }
    big = {r["variant"]: r["stored_bytes"] for r in document["codec"] if r["body"] == 65536}
    assert big["zlib"] < big["off"] // 3 and big["zlib+aes"] < big["off"] // 3
    text = sealing.format_text(document)
    assert "zlib+aes" in text and "Bytes per row" in text
    assert parse(["sealing", "--quick"]).command == "sealing"


def test_profile_attributes_calls_to_the_innermost_layer_function() -> None:
    from bench import apps
    from bench.profile import _attributed_calls

    def one(_n: int) -> None:
        apps.database_url("postgresql://bench@localhost/bench")

    one(0)  # first use loads and caches SQLAlchemy's dialect
    counted = dict(_attributed_calls(one, 3))
    assert set(counted) == {"/bench/apps.py:database_url"}
    # A count per request, not a time: the same for any number of requests.
    assert counted == dict(_attributed_calls(one, 7))
    assert counted["/bench/apps.py:database_url"] >= 3


@pytest.mark.parametrize("driver", ["psycopg2", "psycopg"])
def test_every_layer_runs_on_the_driver_bench_driver_names(
    monkeypatch: pytest.MonkeyPatch, bench_url: str, driver: str
) -> None:
    """``make bench BENCH_DRIVER=psycopg`` measures psycopg 3: each layer's engine uses it,
    whatever driver the bench database's URL names, and answers the payment."""
    from bench import apps

    monkeypatch.setenv("BENCH_DRIVER", driver)
    for spelling in ("postgresql", "postgresql+psycopg2", "postgresql+psycopg"):
        url = apps.database_url(
            sa.make_url(bench_url).set(drivername=spelling).render_as_string(hide_password=False)
        )
        assert sa.make_url(url).drivername == f"postgresql+{driver}"
    engine = sa.create_engine(apps.database_url(bench_url))
    try:
        with engine.connect() as conn:
            assert conn.exec_driver_sql("SELECT 1").scalar_one() == 1
            assert engine.dialect.driver == driver
    finally:
        engine.dispose()
    monkeypatch.setenv("BENCH_DRIVER", "pg8000")
    with pytest.raises(RuntimeError, match="psycopg2 or psycopg"):
        apps.database_url(bench_url)


@pytest.mark.postgresql
def test_probe_reads_planning_time_and_wal_per_database(
    fresh_pg_database: t.Callable[[], str],
) -> None:
    """The report's planning and WAL columns come from real counters: planning time is read
    only where it is tracked (else n/a, never a misleading 0), and WAL grows with writes."""
    control, measured = fresh_pg_database(), fresh_pg_database()
    name = sa.make_url(measured).database
    untracked = db.Probe(control)
    try:
        assert untracked.plan_ms(name) is None, "planning not tracked: n/a"
    finally:
        untracked.dispose()
    for url in (control, measured):
        admin = sa.create_engine(sa.make_url(url).set(drivername="postgresql+psycopg2"))
        with admin.begin() as conn:
            conn.exec_driver_sql(
                f'ALTER DATABASE "{sa.make_url(url).database}" '
                "SET pg_stat_statements.track_planning = on"
            )
        admin.dispose()
    probe = db.Probe(control)
    engine = sa.create_engine(sa.make_url(measured).set(drivername="postgresql+psycopg2"))
    try:
        if not probe.statements_available:
            pytest.skip("pg_stat_statements is not loaded on this server")
        probe.reset_statements()
        before = probe.wal_position()
        with engine.begin() as conn:
            conn.exec_driver_sql("CREATE TABLE t (n int PRIMARY KEY, pad text)")
            for n in range(20):
                conn.execute(sa.text("INSERT INTO t VALUES (:n, repeat('x', 200))"), {"n": n})
        assert probe.wal_position() - before > 20 * 200, "the inserts' WAL"
        planned = probe.plan_ms(name)
        assert planned is not None and planned > 0, planned
    finally:
        engine.dispose()
        probe.dispose()
