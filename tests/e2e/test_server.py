"""Concurrent duplicates through a real multi-threaded HTTP server and real sockets."""

from __future__ import annotations

import concurrent.futures
import threading
import time
import typing as t

import flask
import pytest
from werkzeug.serving import make_server

from flask_idem import Idempotency
from flask_idem.store import SQLStore
from tests.support.answers import PAYMENT
from tests.support.wire import Reply, post_json

CLIENTS = 16


@pytest.fixture
def server(store: SQLStore) -> t.Iterator[tuple[int, list[int]]]:
    app = flask.Flask("server-test")
    idem = Idempotency(app, store=store, tenant=lambda: flask.request.headers["X-Tenant"])
    executions: list[int] = []
    lock = threading.Lock()

    @app.post("/payments")
    @idem.idempotent
    def pay() -> t.Any:
        with lock:
            executions.append(1)
            number = len(executions)
        time.sleep(0.3)  # long enough for every duplicate to arrive while this one runs
        return flask.jsonify(id=f"pay_{number}"), 201

    httpd = make_server("127.0.0.1", 0, app, threaded=True)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield httpd.server_port, executions
    finally:
        httpd.shutdown()
        thread.join(timeout=10)


def _at_once(port: int, key: str, tenant: str, barrier: threading.Barrier) -> Reply:
    """Send the payment once every client of ``barrier`` is ready to send it too."""
    barrier.wait()
    return post_json(port, key, PAYMENT, tenant=tenant)


def test_concurrent_duplicates_execute_once(server: tuple[int, list[int]]) -> None:
    port, executions = server
    barrier = threading.Barrier(CLIENTS)
    with concurrent.futures.ThreadPoolExecutor(CLIENTS) as pool:
        replies = list(
            pool.map(lambda _: _at_once(port, "storm", "alpha", barrier), range(CLIENTS))
        )
    statuses = sorted(reply.status for reply in replies)
    assert len(executions) == 1, statuses
    originals = [r for r in replies if r.status == 201 and "Idempotent-Replayed" not in r.headers]
    assert len(originals) == 1
    for reply in replies:
        assert reply.status in (201, 409), statuses
        if reply.status == 409:
            assert reply.headers["Content-Type"] == "application/problem+json"
            assert int(reply.headers["Retry-After"]) >= 1
            assert reply.json()["type"].endswith("/request-in-progress")
        elif reply.headers.get("Idempotent-Replayed") == "true":
            assert reply.body == originals[0].body
    again = post_json(port, "storm", PAYMENT, tenant="alpha")
    replayed = (again.status, again.headers.get("Idempotent-Replayed"), again.body)
    assert replayed == (201, "true", originals[0].body)


def test_concurrent_tenants_do_not_interfere(server: tuple[int, list[int]]) -> None:
    port, executions = server
    tenants = [f"tenant-{n}" for n in range(8)]
    barrier = threading.Barrier(len(tenants))
    with concurrent.futures.ThreadPoolExecutor(len(tenants)) as pool:
        replies = list(pool.map(lambda tenant: _at_once(port, "same", tenant, barrier), tenants))
    assert [reply.status for reply in replies] == [201] * len(tenants)
    assert len(executions) == len(tenants)
    assert len({reply.body for reply in replies}) == len(tenants)
