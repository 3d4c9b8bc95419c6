"""Concurrent duplicates through a real multi-threaded HTTP server and real sockets."""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import threading
import time
import typing as t

import flask
import pytest
from werkzeug.serving import make_server

from flask_idem import Idempotency
from flask_idem.store import SQLStore

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


def _post(
    port: int, key: str, tenant: str, barrier: threading.Barrier
) -> tuple[int, dict[str, str], bytes]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        barrier.wait()
        connection.request(
            "POST",
            "/payments",
            body=json.dumps({"amount": 4200}),
            headers={
                "Idempotency-Key": key,
                "X-Tenant": tenant,
                "Content-Type": "application/json",
            },
        )
        response = connection.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        connection.close()


def test_concurrent_duplicates_execute_once(server: tuple[int, list[int]]) -> None:
    port, executions = server
    barrier = threading.Barrier(CLIENTS)
    with concurrent.futures.ThreadPoolExecutor(CLIENTS) as pool:
        results = list(pool.map(lambda _: _post(port, "storm", "alpha", barrier), range(CLIENTS)))
    statuses = sorted(status for status, _, _ in results)
    assert len(executions) == 1, statuses
    originals = [r for r in results if r[0] == 201 and "Idempotent-Replayed" not in r[1]]
    assert len(originals) == 1
    for status, headers, body in results:
        assert status in (201, 409), statuses
        if status == 409:
            assert headers["Content-Type"] == "application/problem+json"
            assert int(headers["Retry-After"]) >= 1
            assert json.loads(body)["type"].endswith("/request-in-progress")
        elif headers.get("Idempotent-Replayed") == "true":
            assert body == originals[0][2]
    barrier = threading.Barrier(1)
    status, headers, body = _post(port, "storm", "alpha", barrier)
    assert (status, headers.get("Idempotent-Replayed"), body) == (201, "true", originals[0][2])


def test_concurrent_tenants_do_not_interfere(server: tuple[int, list[int]]) -> None:
    port, executions = server
    tenants = [f"tenant-{n}" for n in range(8)]
    barrier = threading.Barrier(len(tenants))
    with concurrent.futures.ThreadPoolExecutor(len(tenants)) as pool:
        results = list(pool.map(lambda tenant: _post(port, "same", tenant, barrier), tenants))
    assert [status for status, _, _ in results] == [201] * len(tenants)
    assert len(executions) == len(tenants)
    assert len({body for _, _, body in results}) == len(tenants)
