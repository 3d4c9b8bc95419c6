"""Reconcilers and ``flask idem reconcile``, on both databases, and a worker killed mid-request.

The payments app of ``tests/support/slow_app.py`` charges a "provider" table with its downstream
key; its reconciler finds the charge by that key.
"""

from __future__ import annotations

import contextlib
import hashlib
import http.client
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import typing as t
from pathlib import Path

import flask
import pytest
import sqlalchemy as sa
from click.testing import Result

from flask_idem import ConfigurationError, Idempotency, Record, Scope, State, Verdict
from flask_idem.ops.migrate import upgrade
from flask_idem.ops.reconcile import resolve_targets
from flask_idem.store import SQLStore
from tests.support import pgcluster, slow_app
from tests.support.helpers import shift, wait_until
from tests.support.wire import post_json

FP = hashlib.sha256(b"request").digest()
PAYMENTS = "POST /payments"
ROOT = Path(__file__).resolve().parents[2]


def idem(app: flask.Flask, *args: str) -> Result:
    return app.test_cli_runner().invoke(args=["idem", *args])


def _pay(app: flask.Flask, key: str) -> t.Any:
    return app.test_client().post(
        "/payments",
        json={"amount": 4200, "reference": "order-1"},
        headers={"Idempotency-Key": key, "X-Tenant": "alpha"},
    )


def _charges(app: flask.Flask) -> int:
    with app.extensions["idempotency"].store.engine.connect() as conn:
        return int(conn.execute(sa.select(sa.func.count()).select_from(slow_app.charges)).scalar())


@pytest.fixture
def payments(store: SQLStore, db_url: str) -> t.Iterator[flask.Flask]:
    """The payments app on an empty store; answers 500 problems instead of raising."""
    app = slow_app.create_app(db_url)
    app.config["PROPAGATE_EXCEPTIONS"] = False
    engine = app.extensions["idempotency"].store.engine
    yield app
    slow_app.charges.drop(engine)
    engine.dispose()


def _crash(app: flask.Flask, key: str, where: str) -> None:
    """A request that dies at ``where`` after declaring its side effect: outcome unknown."""
    app.config["SLOW_APP_FAIL"] = where
    assert _pay(app, key).status_code == 500
    app.config["SLOW_APP_FAIL"] = None
    retry = _pay(app, key)
    assert retry.status_code == 409
    assert retry.get_json()["type"].endswith("/outcome-pending")


# -- the three answers -------------------------------------------------------------------------


def test_happened_completes_and_replays_like_a_normal_completion(payments: flask.Flask) -> None:
    store = payments.extensions["idempotency"].store
    scope = Scope("alpha", PAYMENTS, "crash-key")
    _crash(payments, "crash-key", "after-charge")

    result = idem(payments, "reconcile")
    assert result.exit_code == 0, result.output
    assert result.stdout == "reconciled 1 stuck record: 1 completed, 0 reopened, 0 still unknown\n"
    reconciled = store.get(scope)
    assert reconciled.state is State.COMPLETED
    replay = _pay(payments, "crash-key")
    assert replay.status_code == 201
    assert replay.headers["Idempotent-Replayed"] == "true"
    assert _charges(payments) == 1, "charged once"

    # The same request completed in the request, for comparison (a new record: the record
    # was evicted): the same stored snapshot, and retries get byte-for-byte the same answer.
    store.evict(scope)
    with store.engine.begin() as conn:
        conn.execute(slow_app.charges.delete())
    original = _pay(payments, "crash-key")
    assert original.status_code == 201 and "Idempotent-Replayed" not in original.headers
    assert store.get(scope).response == reconciled.response
    normal_replay = _pay(payments, "crash-key")
    assert normal_replay.status_code == replay.status_code
    assert normal_replay.headers.to_wsgi_list() == replay.headers.to_wsgi_list()
    assert normal_replay.data == replay.data == original.data


def test_not_happened_reopens_the_record_for_a_run_with_the_same_keys(
    payments: flask.Flask,
) -> None:
    store = payments.extensions["idempotency"].store
    scope = Scope("alpha", PAYMENTS, "early-key")
    _crash(payments, "early-key", "before-charge")
    crashed = store.get(scope)
    result = idem(payments, "reconcile", "--json")
    assert result.exit_code == 0, result.output
    answer = json.loads(result.stdout)
    assert {name: answer[name] for name in ("completed", "reopened", "unknown", "skipped")} == {
        "completed": 0,
        "reopened": 1,
        "unknown": 0,
        "skipped": 0,
    }
    [record] = answer["records"]
    assert record["action"] == "reopened"
    assert record["reason"] == "no charge with the downstream key"
    assert record["state"] == "unknown" and "key" not in record
    reopened = store.get(scope)
    assert reopened.state is State.REOPENED and reopened.created_at == crashed.created_at

    again = json.loads(idem(payments, "reconcile", "--json").stdout)
    assert (again["reopened"], again["skipped"]) == (0, 1), "reopened once"
    assert again["records"][0]["reason"] == "already reopened: the next retry runs it"
    rerun = _pay(payments, "early-key")
    assert rerun.status_code == 201 and "Idempotent-Replayed" not in rerun.headers
    assert _charges(payments) == 1


def test_unknown_stays_reported_and_exits_non_zero(payments: flask.Flask) -> None:
    _crash(payments, "dark-key", "after-charge")
    payments.config["PROVIDER_DOWN"] = True
    result = idem(payments, "reconcile")
    assert result.exit_code == 1
    lines = result.stdout.splitlines()
    assert lines[0] == "reconciled 1 stuck record: 0 completed, 0 reopened, 1 still unknown"
    assert lines[2] == "still unknown:"
    assert lines[3].split() == ["AGE", "TENANT", "ENDPOINT", "KEY", "HASH", "WHY"]
    assert lines[4].endswith("provider unreachable")
    assert "dark-key" not in result.stdout
    answer = json.loads(idem(payments, "reconcile", "--json").stdout)
    assert answer["unknown"] == 1 and answer["records"][0]["reason"] == "provider unreachable"
    assert _pay(payments, "dark-key").status_code == 409, "still outcome-pending"

    payments.config["PROVIDER_DOWN"] = False
    assert idem(payments, "reconcile").exit_code == 0
    assert _pay(payments, "dark-key").headers["Idempotent-Replayed"] == "true"


def test_nothing_stuck_is_a_quiet_success(payments: flask.Flask) -> None:
    result = idem(payments, "reconcile")
    assert (result.exit_code, result.stdout) == (
        0,
        "reconciled 0 stuck records: 0 completed, 0 reopened, 0 still unknown\n",
    )


def test_long_runs_show_a_progress_bar(payments: flask.Flask) -> None:
    store = payments.extensions["idempotency"].store
    for n in range(25):
        scope = Scope("alpha", PAYMENTS, f"batch-{n}")
        store.mark_unknown(scope, store.claim(scope, FP, ttl=60, lease=30).token)
    result = idem(payments, "reconcile", "--json")
    assert result.exit_code == 0, result.output
    assert "reconciling" in result.stderr
    assert json.loads(result.stdout)["reopened"] == 25
    assert {record.state for record in store.stuck()} == {State.REOPENED}


# -- reconcilers that cannot settle ----------------------------------------------------------


def _stuck_app(store: SQLStore, **config: t.Any) -> tuple[flask.Flask, Idempotency]:
    app = flask.Flask("stuck")
    app.config.update(config)
    return app, Idempotency(app, store=store, tenant=lambda: "alpha")


def _unknown(store: SQLStore, endpoint: str, key: str = "k") -> Scope:
    scope = Scope("alpha", endpoint, key)
    store.mark_unknown(scope, store.claim(scope, FP, ttl=60, lease=30).token)
    return scope


def test_failures_leave_records_unknown_and_the_run_goes_on(
    store: SQLStore, caplog: pytest.LogCaptureFixture
) -> None:
    app, ext = _stuck_app(store, IDEMPOTENCY_MAX_BODY=10)

    def broken(record: Record) -> Verdict:
        raise RuntimeError(f"lookup failed for {record.scope.key}")

    ext.reconciler("POST /broken")(broken)
    ext.reconciler("POST /odd")(lambda record: "yes")  # type: ignore[arg-type,return-value]
    ext.reconciler("POST /busy")(lambda record: Verdict.happened(("busy", 503)))
    ext.reconciler("POST /large")(lambda record: Verdict.happened("x" * 11))
    ext.reconciler("POST /fine")(lambda record: Verdict.not_happened())
    for endpoint in ("POST /broken", "POST /odd", "POST /busy", "POST /large", "POST /none"):
        _unknown(store, endpoint)
    fine = _unknown(store, "POST /fine")

    with caplog.at_level(logging.ERROR, logger="flask_idem"):
        result = idem(app, "reconcile", "--json")
    assert result.exit_code == 1
    answer = json.loads(result.stdout)
    reasons = {r["endpoint"]: r["reason"] for r in answer["records"] if r["action"] == "unknown"}
    assert reasons == {
        "POST /broken": "reconciler failed: RuntimeError",
        "POST /odd": "the reconciler returned str, not a Verdict",
        "POST /busy": "status 503 is never stored (IDEMPOTENCY_NEVER_STORE)",
        "POST /large": "the response is streamed or larger than IDEMPOTENCY_MAX_BODY",
        "POST /none": "no reconciler for this endpoint",
    }
    assert answer["reopened"] == 1 and store.get(fine).state is State.REOPENED
    [logged] = [r for r in caplog.records if r.getMessage() == "reconciler failed"]
    assert getattr(logged, "key_hash", None)
    states = [record.state for record in store.stuck()]
    assert states.count(State.UNKNOWN) == 5, "nothing settled that could not be"


def test_a_request_finishing_meanwhile_wins(store: SQLStore) -> None:
    app, ext = _stuck_app(store)
    scope = Scope("alpha", PAYMENTS, "late")
    token = store.claim(scope, FP, ttl=60, lease=30).token
    shift(store, scope, 31, "lease_expires_at")

    @ext.reconciler(PAYMENTS)
    def owner_finishes_first(record: Record) -> Verdict:
        assert record.lease_expired and record.claim_token == token
        store.complete(scope, token, None)
        return Verdict.happened(({"late": False}, 201))

    answer = json.loads(idem(app, "reconcile", "--json").stdout)
    assert answer["skipped"] == 1 and answer["completed"] == 0
    assert answer["records"][0]["reason"] == "no longer stuck: settled meanwhile"
    assert store.get(scope).state is State.UNSTORED, "the owner's outcome stands"


# -- registration ----------------------------------------------------------------------------


def test_reconcilers_register_by_view_endpoint_name_or_record_spelling(store: SQLStore) -> None:
    app, ext = _stuck_app(store, IDEMPOTENCY_METHODS=["POST", "PUT"])
    blueprint = flask.Blueprint("orders", __name__)

    @blueprint.route("/orders/<int:order>", methods=["POST", "PUT", "GET"])
    @ext.idempotent
    def order(order: int) -> t.Any:
        return {}

    app.register_blueprint(blueprint, url_prefix="/v1")
    app.add_url_rule("/refunds", "refund", lambda: "", methods=["POST"])

    def by_view(record: Record) -> Verdict:
        return Verdict.unknown("by view")

    def by_name(record: Record) -> Verdict:
        return Verdict.unknown("by name")

    def by_spelling(record: Record) -> Verdict:
        return Verdict.unknown("by spelling")

    resolved = resolve_targets(
        app, {order: by_view, "refund": by_name, "POST /legacy": by_spelling}, {"POST", "PUT"}
    )
    assert resolved == {
        "POST /v1/orders/<int:order>": by_view,
        "PUT /v1/orders/<int:order>": by_view,
        "POST /refunds": by_name,
        "POST /legacy": by_spelling,
    }
    with pytest.raises(ConfigurationError, match="two reconcilers are registered for"):
        resolve_targets(app, {order: by_view, "PUT /v1/orders/<int:order>": by_name}, {"PUT"})

    ext.reconciler("orders.order")(by_name)
    with pytest.raises(ConfigurationError, match="already registered"):
        ext.reconciler("orders.order")(by_name)
    assert dict(ext.reconcilers) == {"orders.order": by_name}


def test_a_reconciler_for_a_missing_view_fails_the_run(store: SQLStore) -> None:
    app, ext = _stuck_app(store)
    ext.reconciler("payments.create")(lambda record: Verdict.not_happened())
    result = idem(app, "reconcile")
    assert result.exit_code == 1
    assert "reconciler target 'payments.create' is no view of this app" in result.stderr


# -- a worker killed mid-request under a real server -----------------------------------------


def _listening(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def _post_and_lose_the_answer(port: int, key: str) -> None:
    # The worker dies: the client never learns what happened.
    with contextlib.suppress(ConnectionError, http.client.HTTPException):
        post_json(port, key, {"amount": 4200, "reference": "order-1"})


def test_worker_killed_mid_request_is_listed_and_reconciled(
    fresh_pg_database: t.Callable[[], str], tmp_path: Path
) -> None:
    url = fresh_pg_database()
    upgrade(url)
    port, pidfile = pgcluster.free_port(), tmp_path / "worker.pid"
    env = {
        **os.environ,
        "DATABASE_URL": url,
        "SLOW_APP_SLEEP": "60",
        "SLOW_APP_PIDFILE": str(pidfile),
    }
    server = subprocess.Popen(
        [sys.executable, "-m", "gunicorn", "-w", "1", "-b", f"127.0.0.1:{port}"]
        + ["--graceful-timeout", "1", "tests.support.slow_app:create_app()"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    client = threading.Thread(target=_post_and_lose_the_answer, args=(port, "killed-key"))
    try:
        wait_until(lambda: _listening(port), "gunicorn to listen")
        client.start()
        wait_until(pidfile.exists, "the request to charge and hang")
        os.kill(int(pidfile.read_text()), signal.SIGKILL)
        client.join(timeout=10)
    finally:
        server.terminate()
        server.wait(timeout=15)

    app = slow_app.create_app(url)
    store = app.extensions["idempotency"].store
    try:
        scope = Scope("alpha", PAYMENTS, "killed-key")
        record = store.get(scope)
        assert record is not None and record.state is State.IN_PROGRESS
        assert idem(app, "stuck").stdout == "no stuck records\n", "the lease is still live"
        shift(store, scope, 60, "lease_expires_at")  # the lease runs out (no sleeping)

        [listed] = json.loads(idem(app, "stuck", "--json").stdout)
        assert (listed["state"], listed["lease_expired"]) == ("in_progress", True)
        assert _pay(app, "killed-key").status_code == 409, "outcome-pending until reconciled"

        result = idem(app, "reconcile")
        assert result.exit_code == 0, result.output
        assert "1 completed, 0 reopened, 0 still unknown" in result.stdout
        replay = _pay(app, "killed-key")
        assert (replay.status_code, replay.headers["Idempotent-Replayed"]) == (201, "true")
        assert replay.get_json()["amount"] == 4200
        assert _charges(app) == 1, "charged exactly once"
        assert json.loads(idem(app, "stuck", "--json").stdout) == []
    finally:
        store.engine.dispose()
