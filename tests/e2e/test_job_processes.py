"""Queue workers killed at random points (kill -9) while their messages are redelivered, on
PostgreSQL and SQLite: exactly one charge and one payment per message.

The "queue" is this test: it hands each message to one of two worker processes
(``tests/support/job_worker.py``, the sample app's ``renew_subscription`` job in a plain process)
and
counts it as done only on the worker's ack, as a broker does. A worker is killed with SIGKILL
at a random moment of a delivery (before the claim, before or after the provider's charge,
before or after the commit, before the ack), and its message is then delivered again; some
messages are also delivered to both workers at once (a visibility timeout running out). A
``JobInProgress`` answer is redelivered a moment later. The lease is 1 s, so a killed run's
message is taken over (``recovery="reexecute"``) with the same downstream key.
"""

from __future__ import annotations

import collections
import json
import os
import random
import selectors
import subprocess
import sys
import time
import typing as t
from pathlib import Path

import pytest
import sqlalchemy as sa

from flask_idem.store import create_engine
from tests.e2e.test_sample_outcomes import _database
from tests.support.pgcluster import ROOT

pytestmark = [pytest.mark.postgresql, pytest.mark.slow]

MESSAGES = 8
WORKERS = 2
KILLS = 6
#: Seconds a redelivery after ``JobInProgress`` waits (a broker's retry delay).
RETRY_DELAY = 0.3
#: The provider takes this long after recording a charge, so a delivery lasts at least as long
#: and a kill scheduled within it lands before the ack (before the claim, before or after the
#: charge, or after the commit).
PROVIDER_LATENCY = 0.3


class Worker:
    """One worker process and the delivery it is working on."""

    def __init__(self, url: str, log: Path) -> None:
        with open(log, "ab") as stderr:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "tests.support.job_worker"],
                cwd=ROOT,
                env={
                    **os.environ,
                    "DATABASE_URL": url,
                    "FLASK_IDEMPOTENCY_LEASE": "1",
                    "SAMPLE_PROVIDER_LATENCY_MS": str(int(PROVIDER_LATENCY * 1000)),
                },
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=stderr,
                text=True,
            )
        self.ready = False
        self.message: str | None = None
        self.kill_at: float | None = None

    def deliver(self, message: str, args: dict[str, t.Any]) -> None:
        assert self.process.stdin is not None
        self.message = message
        self.process.stdin.write(json.dumps({"id": message, "args": args}) + "\n")
        self.process.stdin.flush()

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()
        for pipe in (self.process.stdin, self.process.stdout):
            if pipe is not None:
                pipe.close()


def _messages(seed: int) -> dict[str, dict[str, t.Any]]:
    return {
        f"m{i}": {
            "tenant": ("alpha", "beta")[i % 2],
            "subscription": f"sub_{seed}_{i}",
            "period": "2026-12",
            "amount": 1000 + i,
            "currency": "eur",
            "customer": f"cus_job_{seed}_{i}",
        }
        for i in range(MESSAGES)
    }


def _run_queue(
    url: str, workdir: Path, messages: dict[str, dict[str, t.Any]], rng: random.Random
) -> tuple[dict[str, list[t.Any]], int]:
    """Deliver every message until acked; returns the acks per message and the kills."""
    log = workdir / "workers.log"
    workers = [Worker(url, log) for _ in range(WORKERS)]
    due: collections.deque[tuple[float, str]] = collections.deque(
        (0.0, message) for message in messages
    )
    acks: dict[str, list[t.Any]] = {}
    kills = deliveries = 0
    selector = selectors.DefaultSelector()
    for worker in workers:
        assert worker.process.stdout is not None
        selector.register(worker.process.stdout, selectors.EVENT_READ, worker)
    deadline = time.monotonic() + 90
    try:
        while len(acks) < len(messages) or any(w.message for w in workers):
            now = time.monotonic()
            assert now < deadline, f"not done: acked {sorted(acks)}, log:\n{log.read_text()}"
            idle = [w for w in workers if w.ready and w.message is None]
            while idle and due and due[0][0] <= now:
                message = due.popleft()[1]
                if message in acks:
                    continue
                worker = idle.pop()
                worker.deliver(message, messages[message])
                first, deliveries = deliveries == 0, deliveries + 1
                if first:
                    # A first delivery of a fresh key, alone, lasts the provider's latency at
                    # least: a kill within it always lands (a later one may meet a quick
                    # JobInProgress or an ack first, so a run could end with no kill at all).
                    worker.kill_at = now + rng.uniform(0, PROVIDER_LATENCY / 2)
                elif kills < KILLS and rng.random() < 0.6:
                    worker.kill_at = now + rng.uniform(0, PROVIDER_LATENCY + 0.05)
                if idle and not first and rng.random() < 0.3:
                    idle.pop().deliver(message, messages[message])  # delivered twice at once
            for key, _ in selector.select(timeout=0.02):
                worker = key.data
                line = key.fileobj.readline()  # type: ignore[union-attr]
                assert line, f"a worker died on its own:\n{log.read_text()}"
                answer = json.loads(line)
                if "ready" in answer:
                    worker.ready = True
                    continue
                if "ack" in answer:
                    acks.setdefault(answer["id"], []).append(answer["ack"])
                else:
                    assert answer["retry"] == "JobInProgress", answer
                    due.append((time.monotonic() + RETRY_DELAY, answer["id"]))
                worker.message = worker.kill_at = None
            for index, worker in enumerate(workers):
                if worker.kill_at is not None and worker.kill_at <= time.monotonic():
                    assert worker.process.stdout is not None
                    selector.unregister(worker.process.stdout)
                    worker.kill()
                    kills += 1
                    if worker.message is not None:
                        due.append((time.monotonic(), worker.message))  # never acked
                    workers[index] = Worker(url, log)
                    stdout = workers[index].process.stdout
                    assert stdout is not None
                    selector.register(stdout, selectors.EVENT_READ, workers[index])
            due = collections.deque(sorted(due))
    finally:
        for worker in workers:
            worker.kill()
        selector.close()
    return acks, kills


@pytest.fixture(scope="module", params=["postgresql", "sqlite"])
def database(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
    return _database(request, tmp_path_factory.mktemp(f"jobs-{request.param}"))


def test_killed_workers_and_redeliveries_charge_each_message_once(
    database: str, tmp_path: Path
) -> None:
    seed = random.randrange(2**32)
    messages = _messages(seed)
    acks, kills = _run_queue(database, tmp_path, messages, random.Random(seed))
    assert kills > 0, f"seed {seed}"
    engine = create_engine(database)
    try:
        with engine.connect() as conn:
            for message, args in messages.items():
                customer = {"c": args["customer"]}
                charges = conn.execute(
                    sa.text("SELECT id FROM provider_charges WHERE customer = :c"), customer
                ).all()
                assert len(charges) == 1, f"seed {seed}: {message} charged {len(charges)} times"
                payments = conn.execute(
                    sa.text("SELECT count(*) FROM payments WHERE customer = :c"), customer
                ).scalar_one()
                assert payments == 1, f"seed {seed}: {message} has {payments} payments"
                answers = acks[message]
                assert all(answer == answers[0] for answer in answers), f"seed {seed}: {answers}"
                assert answers[0]["provider_charge_id"] == charges[0][0]
    finally:
        engine.dispose()
