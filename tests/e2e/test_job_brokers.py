"""The Celery and RQ recipes of docs/jobs.md, run by real workers on a real Redis, on
PostgreSQL and SQLite: a worker killed with SIGKILL mid-task, its message delivered again by the
broker, and a producer that publishes one message twice give one charge and one payment per
message, every time.

The recipe modules are the Python blocks of docs/jobs.md, written out as they are; the
application module they import (``myapp``) is the sample app, whose ``renew_subscription`` job
charges its provider (``provider_charges``: one row per downstream key, however often it is
called) and records a payment. The provider waits ``PROVIDER_LATENCY`` seconds after a new
charge, before the job's commit: the test kills the worker once the charge is in the database,
so the kill always lands after the job claimed its key and charged, before it committed.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import typing as t
from pathlib import Path

import pytest
import redis
import sqlalchemy as sa
from celery import Celery
from rq import Queue, Retry
from rq.job import Job, JobStatus
from rq.registry import StartedJobRegistry

from flask_idem.store import create_engine
from sample_app.jobs import renew_subscription
from tests.e2e.test_sample_outcomes import _database
from tests.support.pgcluster import ROOT

pytestmark = [pytest.mark.postgresql, pytest.mark.slow]

DOCS = ROOT / "docs" / "jobs.md"
#: The application module the recipes import: the sample app and its renewal job.
MYAPP = "from sample_app import create_app\nfrom sample_app.jobs import renew_subscription\n"
LEASE = 1
#: Seconds between a new charge and the job's commit: the window the kill lands in.
PROVIDER_LATENCY = 2.0
#: Celery's visibility timeout: longer than the lease, so a redelivered message finds the dead
#: run's lease expired and takes it over (``recovery="reexecute"``).
VISIBILITY_TIMEOUT = 3
#: The recipe's retry policy for RQ.
RETRY = {"max": 10, "interval": [1, 5, 30]}


def recipe(first_line: str) -> str:
    """The Python block of docs/jobs.md that begins with ``first_line``."""
    blocks = re.findall(r"^```python\n(.*?)^```", DOCS.read_text(), re.MULTILINE | re.DOTALL)
    (found,) = [block for block in blocks if block.startswith(first_line)]
    return found


class WorkerProcess:
    """A worker command in a process group of its own (a Celery worker and its pool)."""

    def __init__(self, command: list[str], workdir: Path, environment: dict[str, str]) -> None:
        self.log = workdir / "workers.log"
        with open(self.log, "ab") as log:
            self.process = subprocess.Popen(
                command,
                cwd=workdir,
                env=environment,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def kill(self) -> None:
        """SIGKILL to the worker and every process it started: no cleanup, no ack."""
        with contextlib.suppress(ProcessLookupError):  # all of them exited already
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.kill()


def _wait_for(
    condition: t.Callable[[], t.Any], what: str, worker: WorkerProcess, timeout: float = 40
) -> None:
    """Until ``condition()`` holds, while ``worker`` runs."""
    deadline = time.monotonic() + timeout
    while not condition():
        alive = worker.process.poll() is None
        assert alive and time.monotonic() < deadline, (
            f"{'timed out' if alive else 'the worker exited'} waiting for {what}; log:\n"
            + worker.log.read_text()[-4000:]
        )
        time.sleep(0.05)


def _message(name: str) -> list[t.Any]:
    """The renewal of one new subscription, with a customer of its own."""
    stamp = time.time_ns()
    return ["alpha", f"sub_{name}_{stamp}", "2026-12", 4200, "eur", f"cus_{name}_{stamp}"]


class Ledger:
    """What happened, read from the sample database: charges and payments per customer."""

    def __init__(self, url: str) -> None:
        self.engine = create_engine(url)

    def charges(self, customer: str) -> list[str]:
        with self.engine.connect() as conn:
            return list(
                conn.execute(
                    sa.text("SELECT id FROM provider_charges WHERE customer = :c"), {"c": customer}
                ).scalars()
            )

    def payments(self, customer: str) -> int:
        with self.engine.connect() as conn:
            return int(
                conn.execute(
                    sa.text("SELECT count(*) FROM payments WHERE customer = :c"), {"c": customer}
                ).scalar_one()
            )


@pytest.fixture(scope="module", params=["postgresql", "sqlite"])
def database(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
    return _database(request, tmp_path_factory.mktemp(f"brokers-{request.param}"))


@pytest.fixture
def ledger(database: str) -> t.Iterator[Ledger]:
    ledger = Ledger(database)
    yield ledger
    ledger.engine.dispose()


@pytest.fixture
def broker(redis_url: str) -> t.Iterator[redis.Redis]:
    """The session's Redis, emptied for each test."""
    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    yield client
    client.flushdb()
    client.close()


def _environment(database: str, workdir: Path, **extra: str) -> dict[str, str]:
    return {
        **os.environ,
        "DATABASE_URL": database,
        "FLASK_IDEMPOTENCY_LEASE": str(LEASE),
        "SAMPLE_PROVIDER_LATENCY_MS": str(int(PROVIDER_LATENCY * 1000)),
        "PYTHONPATH": os.pathsep.join([str(workdir), str(ROOT)]),
        **extra,
    }


# -- Celery ------------------------------------------------------------------------------------


def _celery_settings(redis_url: str) -> dict[str, t.Any]:
    """The documented settings, with this test's broker and a visibility timeout of seconds
    (restored every second rather than every 100 s, the default sweep; and a killed worker's
    restore lock, held a moment every second, lasting 2 s rather than 300 s)."""
    return {
        "broker_url": redis_url,
        "task_serializer": "json",
        "accept_content": ["json"],
        "task_ignore_result": True,
        "worker_prefetch_multiplier": 1,
        "broker_transport_options": {
            "visibility_timeout": VISIBILITY_TIMEOUT,
            "unacked_restore_interval": 1,
            "unacked_restore_throttle": 1,
            "unacked_mutex_expire": 2,
        },
    }


def _celery_worker(
    database: str, workdir: Path, redis_url: str, pool: str, name: str, **environment: str
) -> WorkerProcess:
    settings = json.dumps(_celery_settings(redis_url))
    command = [sys.executable, "-m", "celery", "-A", "tasks:celery", "worker", "--pool", pool]
    command += ["--concurrency", "1", "--without-gossip", "--without-mingle"]
    command += ["--without-heartbeat", "--loglevel", "INFO", "--hostname", f"{name}@%h"]
    return WorkerProcess(
        command, workdir, _environment(database, workdir, FLASK_CELERY=settings, **environment)
    )


@pytest.fixture
def celery_project(tmp_path: Path) -> Path:
    (tmp_path / "myapp.py").write_text(MYAPP)
    (tmp_path / "tasks.py").write_text(recipe("# tasks.py"))
    return tmp_path


@pytest.fixture
def producer(redis_url: str) -> t.Iterator[Celery]:
    """A publishing process's Celery: the task by name, not its code."""
    client = Celery("producer")
    client.config_from_object(_celery_settings(redis_url))
    yield client
    client.close()


def _celery_idle(broker: redis.Redis) -> bool:
    """Nothing queued and nothing delivered but unacknowledged (retries wait unacknowledged)."""
    return broker.llen("celery") == 0 and broker.hlen("unacked") == 0


def _wait_for_charge(ledger: Ledger, customer: str, worker: WorkerProcess) -> None:
    _wait_for(lambda: ledger.charges(customer), "the first run's charge", worker)


Sent = t.TypeVar("Sent")


def _killed_after_the_charge(
    worker: WorkerProcess, send: t.Callable[[], Sent], ledger: Ledger, customer: str
) -> tuple[Sent, list[str]]:
    """``send()`` the work to ``worker``, SIGKILL the worker once the first run has charged
    ``customer``, and check that the kill landed before the commit.

    :return: what ``send()`` returned, and the first run's charge.
    """
    try:
        sent = send()
        _wait_for_charge(ledger, customer, worker)
    finally:
        worker.kill()
    charge = ledger.charges(customer)
    assert ledger.payments(customer) == 0, "the kill landed before the commit"
    return sent, charge


def _run_until(worker: WorkerProcess, condition: t.Callable[[], t.Any], what: str) -> None:
    """Let ``worker`` run until ``condition()`` holds, then stop it (whatever happens)."""
    try:
        _wait_for(condition, what, worker)
    finally:
        worker.stop()


def test_celery_worker_killed_mid_task_is_redelivered_and_charges_once(
    database: str,
    ledger: Ledger,
    broker: redis.Redis,
    redis_url: str,
    celery_project: Path,
    producer: Celery,
) -> None:
    """The whole worker (solo pool) dies by SIGKILL after the charge and before the commit:
    the message, never acknowledged (``acks_late``), comes back to the next worker after the
    visibility timeout and completes with the first run's charge; a message published twice
    runs once."""
    killed, twice = _message("killed"), _message("twice")
    first = _celery_worker(database, celery_project, redis_url, "solo", "first")
    _, charge = _killed_after_the_charge(
        first, lambda: producer.send_task("renew-subscription", args=killed), ledger, killed[5]
    )
    assert broker.hlen("unacked") == 1, "the message was delivered and never acknowledged"
    producer.send_task("renew-subscription", args=twice)
    producer.send_task("renew-subscription", args=twice)  # the producer publishes twice
    _run_until(
        _celery_worker(database, celery_project, redis_url, "solo", "second"),
        lambda: ledger.payments(killed[5]) and ledger.payments(twice[5]) and _celery_idle(broker),
        "every message acknowledged",
    )
    assert ledger.charges(killed[5]) == charge, "redelivered: the same charge, not a second one"
    assert ledger.payments(killed[5]) == 1
    assert len(ledger.charges(twice[5])) == 1 and ledger.payments(twice[5]) == 1


@pytest.mark.parametrize("database", ["postgresql"], indirect=True)
def test_celery_pool_process_killed_mid_task_is_requeued_and_charges_once(
    database: str,
    ledger: Ledger,
    broker: redis.Redis,
    redis_url: str,
    celery_project: Path,
    producer: Celery,
) -> None:
    """Only the prefork pool process running the task dies: the worker lives on and
    requeues the message at once (``reject_on_worker_lost``), and the rerun, in a new pool
    process forked from the same parent, completes it with the first run's charge."""
    message = _message("lost")
    worker = _celery_worker(database, celery_project, redis_url, "prefork", "pool")
    try:
        producer.send_task("renew-subscription", args=message)
        _wait_for_charge(ledger, message[5], worker)
        (child,) = _children(worker.process.pid)
        os.kill(child, signal.SIGKILL)
        charge = ledger.charges(message[5])
        assert ledger.payments(message[5]) == 0, "the kill landed before the commit"
        _wait_for(
            lambda: ledger.payments(message[5]) == 1 and _celery_idle(broker),
            "the requeued message acknowledged",
            worker,
        )
    finally:
        worker.stop()
    assert "WorkerLostError" in worker.log.read_text(), "the pool process was lost"
    assert ledger.charges(message[5]) == charge and ledger.payments(message[5]) == 1


@pytest.mark.parametrize("database", ["postgresql"], indirect=True)
def test_celery_task_outliving_the_visibility_timeout_runs_once(
    database: str,
    ledger: Ledger,
    broker: redis.Redis,
    redis_url: str,
    celery_project: Path,
    producer: Celery,
) -> None:
    """A task still running when the visibility timeout passes is delivered to a second
    worker while the first works on: that one gets ``JobInProgress`` and retries
    (``autoretry_for``) until the first run has completed, then gets its result."""
    message = _message("slow")
    slow = str(int((VISIBILITY_TIMEOUT + 2) * 1000))  # the charge outlives the timeout
    workers = [
        _celery_worker(
            database, celery_project, redis_url, "solo", name, SAMPLE_PROVIDER_LATENCY_MS=slow
        )
        for name in ("one", "two")
    ]
    try:
        _wait_for(  # the workers share one log
            lambda: workers[0].log.read_text().count(" ready.") == len(workers),
            "both workers ready",
            workers[0],
        )
        producer.send_task("renew-subscription", args=message)
        _wait_for(
            lambda: ledger.payments(message[5]) == 1 and _celery_idle(broker),
            "every delivery acknowledged",
            workers[0],
        )
    finally:
        for worker in workers:
            worker.stop()
    assert "JobInProgress" in workers[0].log.read_text(), "delivered again while it ran"
    assert len(ledger.charges(message[5])) == 1 and ledger.payments(message[5]) == 1


@contextlib.contextmanager
def _database_refusing_connections(url: str) -> t.Iterator[None]:
    """The database down for the block: new connections refused, open ones terminated."""
    name = sa.engine.make_url(url).database
    admin = sa.create_engine(
        sa.engine.make_url(url).set(database="postgres"), isolation_level="AUTOCOMMIT"
    )
    try:
        with admin.connect() as conn:
            conn.execute(sa.text(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS false'))
            conn.execute(
                sa.text(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = :d"
                ),
                {"d": name},
            )
        yield
    finally:
        with admin.connect() as conn:
            conn.execute(sa.text(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS true'))
        admin.dispose()


@pytest.mark.parametrize("database", ["postgresql"], indirect=True)
def test_celery_store_outage_at_the_claim_is_retried_and_runs_once_back(
    database: str,
    ledger: Ledger,
    broker: redis.Redis,
    redis_url: str,
    celery_project: Path,
    producer: Celery,
) -> None:
    """The database is down when the worker claims the message: the claim raises
    ``StoreUnavailable``, which the recipe's ``autoretry_for`` retries (never a failed task,
    acknowledged and gone), and once the database is back the renewal runs, once."""
    warm, message = _message("warm"), _message("outage")
    worker = _celery_worker(database, celery_project, redis_url, "solo", "outage")
    try:
        producer.send_task("renew-subscription", args=warm)  # the worker is up and connected
        _wait_for(lambda: ledger.payments(warm[5]) == 1, "the warm-up renewal", worker)
        ledger.engine.dispose()
        with _database_refusing_connections(database):
            producer.send_task("renew-subscription", args=message)
            _wait_for(
                lambda: "StoreUnavailable" in worker.log.read_text(), "the failed claim", worker
            )
        _wait_for(
            lambda: ledger.payments(message[5]) == 1 and _celery_idle(broker),
            "the retried message acknowledged",
            worker,
        )
    finally:
        worker.stop()
    assert "raised unexpected" not in worker.log.read_text(), "the task never failed"
    assert len(ledger.charges(message[5])) == 1 and ledger.payments(message[5]) == 1


def _children(pid: int) -> list[int]:
    listed = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return [int(child) for child in listed]


# -- RQ ----------------------------------------------------------------------------------------


@pytest.fixture
def rq_project(tmp_path: Path) -> Path:
    (tmp_path / "myapp.py").write_text(MYAPP)
    (tmp_path / "worker.py").write_text(recipe("# worker.py"))
    return tmp_path


def _rq_worker(database: str, workdir: Path, redis_url: str, *, scheduler: bool) -> WorkerProcess:
    """``rq worker`` with the documented worker class (``worker.FlaskWorker``)."""
    command = [str(Path(sys.executable).parent / "rq"), "worker", "--url", redis_url]
    command += ["--worker-class", "worker.FlaskWorker", "--path", str(workdir)]
    command += ["--with-scheduler"] if scheduler else []
    return WorkerProcess(command, workdir, _environment(database, workdir))


def test_rq_worker_killed_mid_job_is_retried_as_abandoned_and_charges_once(
    database: str, ledger: Ledger, broker: redis.Redis, redis_url: str, rq_project: Path
) -> None:
    """RQ's worker dies by SIGKILL after the charge and before the commit: its job stays in the
    ``StartedJobRegistry``; RQ's abandoned-job cleanup retries it (``retry=``), the scheduler of
    the next worker enqueues it, and it completes with the first run's charge. A message
    enqueued twice runs once and both jobs return the same payment.

    RQ counts a job as abandoned once its heartbeat has run out (the job timeout plus 60 s);
    rather than wait minutes, the test runs the registry's cleanup, what every worker's
    maintenance runs, with that moment as its cutoff.
    """
    queue = Queue(connection=broker)
    killed, twice = _message("killed"), _message("twice")
    # The killed worker runs no scheduler: a dead scheduler's lock would hold retries ~1 min.
    first = _rq_worker(database, rq_project, redis_url, scheduler=False)
    job, charge = _killed_after_the_charge(
        first,
        lambda: queue.enqueue(renew_subscription, *killed, retry=Retry(**RETRY)),
        ledger,
        killed[5],
    )
    registry = StartedJobRegistry(queue=queue)
    entries = broker.zrange(registry.key, 0, -1, withscores=True)
    assert len(entries) == 1 and entries[0][0].decode().startswith(job.id), entries
    registry.cleanup(timestamp=entries[0][1])  # the moment the dead worker's heartbeat runs out
    assert job.get_status() == JobStatus.SCHEDULED, "abandoned, and retried"
    duplicates = [queue.enqueue(renew_subscription, *twice, retry=Retry(**RETRY)) for _ in "ab"]
    _run_until(
        _rq_worker(database, rq_project, redis_url, scheduler=True),
        lambda: all(each.get_status() == JobStatus.FINISHED for each in [job, *duplicates]),
        "every job finished",
    )
    assert ledger.charges(killed[5]) == charge, "retried: the same charge, not a second one"
    assert ledger.payments(killed[5]) == 1
    assert len(ledger.charges(twice[5])) == 1 and ledger.payments(twice[5]) == 1
    results = [Job.fetch(each.id, connection=broker).return_value() for each in duplicates]
    assert results[0] == results[1] and results[0]["provider_charge_id"] in ledger.charges(twice[5])
    assert job.return_value()["provider_charge_id"] == charge[0]
