"""The sample app's /metrics under gunicorn with 4 workers (multiprocess mode, the child_exit
hook of ``sample_app/gunicorn_conf.py``): the counts add up to the requests sent, whichever
worker answers the scrape, also after a worker was killed and replaced."""

from __future__ import annotations

import os
import signal
import time
import typing as t
import uuid
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from .sample_server import SampleServer, served

ENDPOINT = "POST /v1/payments"
BODY = {"amount": 4200, "currency": "eur", "customer": "cus_42"}


def _scrape(server: SampleServer) -> dict[tuple[str, str], float]:
    """``idempotency_requests_total`` of the payments endpoint by (outcome, status), plus the
    claim histogram's count and the table gauges."""
    reply = server.request("GET", "/metrics", api_key=None)
    assert reply.status == 200, reply.body[:500]
    assert reply.headers["Content-Type"].startswith("text/plain")
    found: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(reply.body.decode()):
        for sample in family.samples:
            labels = sample.labels
            if sample.name == "idempotency_requests_total" and labels["endpoint"] == ENDPOINT:
                found[(labels["outcome"], labels["status"])] = sample.value
            elif sample.name == "idempotency_claim_duration_seconds_count":
                key = ("claim_count", labels["endpoint"])
                found[key] = found.get(key, 0) + sample.value
            elif sample.name.startswith("idempotency_") and not labels:
                found[(sample.name, "")] = sample.value
    return found


def _send(server: SampleServer, new: int, replays: int, mismatches: int, crashes: int) -> None:
    keys = [f"metrics-{uuid.uuid4()}" for _ in range(new)]
    for key in keys:
        assert server.pay(key, BODY).status == 201
    for index in range(replays):
        reply = server.pay(keys[index % new], BODY)
        assert reply.status == 201 and reply.headers["Idempotent-Replayed"] == "true"
    for index in range(mismatches):
        assert server.pay(keys[index % new], {**BODY, "amount": 1}).status == 422
    for _ in range(crashes):
        assert server.pay(f"crash-{uuid.uuid4()}", {**BODY, "customer": "cus_crash"}).status == 500
    assert server.pay("no-auth", BODY, api_key=None).status == 401  # never reaches the claim


def test_counts_add_up_across_four_workers(
    fresh_pg_database: t.Callable[[], str], tmp_path: Path
) -> None:
    directory = tmp_path / "prometheus"
    with served(
        fresh_pg_database(),
        tmp_path,
        workers=4,
        args=["-c", "python:sample_app.gunicorn_conf"],
        PROMETHEUS_MULTIPROC_DIR=str(directory),
    ) as server:
        _send(server, new=12, replays=8, mismatches=4, crashes=3)
        workers = server.workers()
        assert len(workers) == 4
        # A killed worker's counts stay (its files do); gunicorn replaces it.
        os.kill(workers[0], signal.SIGKILL)
        deadline = time.monotonic() + 20
        while (len(server.workers()) < 4 or workers[0] in server.workers()) and (
            time.monotonic() < deadline
        ):
            time.sleep(0.1)
        _send(server, new=8, replays=2, mismatches=1, crashes=1)
        expected = {
            ("executed", "201"): 20,
            ("replayed", "201"): 10,
            ("mismatch", "422"): 5,
            ("released", ""): 4,
        }
        sent = sum(expected.values())
        scrapes = [_scrape(server) for _ in range(8)]
        for found in scrapes:
            counted = {key: value for key, value in found.items() if key in expected}
            assert counted == expected, found
            outcomes = sum(
                value
                for (outcome, _), value in found.items()
                if not outcome.startswith(("idempotency_", "claim_count"))
            )
            assert outcomes == sent, found
            # Every request that reached the claim was timed: 20 claims, 10 replays, 5
            # mismatches, 4 claims of the crashing ones.
            assert found[("claim_count", ENDPOINT)] == sent
            assert found[("idempotency_table_up", "")] == 1
            assert found[("idempotency_unknown_records", "")] == 0
            assert found[("idempotency_partitions_ahead", "")] >= 7
        assert any(directory.iterdir()), "multiprocess mode: values live in files"
