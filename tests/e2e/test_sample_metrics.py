"""The sample app's /metrics under gunicorn with 4 workers (multiprocess mode, the child_exit
hook of ``sample_app/gunicorn_conf.py``): the counts add up to the requests sent, whichever
worker answers the scrape, also after a worker was killed and replaced; and that configuration
never deletes what it did not make."""

from __future__ import annotations

import importlib
import os
import signal
import tempfile
import time
import types
import typing as t
import uuid
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.sample_server import SampleServer, served

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


def test_the_documented_command_counts_without_a_directory_named_beforehand(
    fresh_pg_database: t.Callable[[], str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``gunicorn -c python:sample_app.gunicorn_conf`` with no ``PROMETHEUS_MULTIPROC_DIR`` in
    the environment: the config makes the directory, but loading it imports the sample app's
    package first, and that imported prometheus_client before the directory was set, so every
    worker counted in its own memory and ``/metrics`` showed no request counter at all."""
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    with served(
        fresh_pg_database(), tmp_path, workers=3, args=["-c", "python:sample_app.gunicorn_conf"]
    ) as server:
        _send(server, new=6, replays=3, mismatches=2, crashes=1)
        expected = {
            ("executed", "201"): 6,
            ("replayed", "201"): 3,
            ("mismatch", "422"): 2,
            ("released", ""): 1,
        }
        for found in [_scrape(server) for _ in range(6)]:
            assert {key: value for key, value in found.items() if key in expected} == expected
            assert found[("claim_count", ENDPOINT)] == sum(expected.values())


def _load_config(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, directory: Path | None
) -> types.ModuleType:
    """``sample_app.gunicorn_conf`` as gunicorn loads it, with ``PROMETHEUS_MULTIPROC_DIR``
    naming ``directory`` or unset; its own temporary directories go under ``tmp_path/tmp``."""
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    # Set (also to "" for unset) so that the variable is restored whatever the module does.
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", "" if directory is None else str(directory))
    import sample_app.gunicorn_conf

    return importlib.reload(sample_app.gunicorn_conf)


def test_the_gunicorn_config_never_deletes_what_it_did_not_make(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    shared = tmp_path / "shared"
    (shared / "keep").mkdir(parents=True)
    metric_files = ["counter_4242.db", "gauge_livesum_4242.db", "histogram_4243.db"]
    others = ["app.sqlite3", "notes.txt", "instance.db", "keep"]
    for name in metric_files + others[:3]:
        (shared / name).write_text("x")
    config = _load_config(monkeypatch, tmp_path, shared)
    assert os.listdir(tmp_path / "tmp") == [], "no directory of its own when one is named"

    config.on_starting(None)
    assert sorted(os.listdir(shared)) == sorted(others), "only prometheus_client's files go"
    config.on_exit(None)
    assert sorted(os.listdir(shared)) == sorted(others), "a named directory stays"


def test_without_a_directory_the_config_makes_and_removes_its_own(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    config = _load_config(monkeypatch, tmp_path, None)
    made = Path(os.environ["PROMETHEUS_MULTIPROC_DIR"])
    assert made.parent == tmp_path / "tmp" and made.is_dir()
    config.on_starting(None)
    (made / "counter_4242.db").write_text("x")  # what the workers write
    config.on_exit(None)
    assert not made.exists()
