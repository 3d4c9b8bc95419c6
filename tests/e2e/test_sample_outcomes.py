"""The outcome model under a real gunicorn, on PostgreSQL and SQLite: the provider charged,
then the attempt died (a lost answer, gunicorn's own worker timeout, SIGQUIT, SIGINT, kill -9)
and the retry, or the operator, ends with exactly one charge for one key."""

from __future__ import annotations

import http.client
import json
import os
import signal
import typing as t
from pathlib import Path

import pytest

from tests.e2e.test_sample_app import (
    assert_executed,
    assert_problem,
    assert_replay,
    count,
    in_background,
    new_customer,
    new_key,
    payment,
    records,
    wait_for,
)
from tests.support.sample_server import Reply, SampleServer, migrate, stored_key

pytestmark = [pytest.mark.postgresql, pytest.mark.slow]

#: ``flask idem release`` arguments naming a payment key (piped in on stdin).
OPERATOR = ["--tenant", "alpha", "--endpoint", "POST /v1/payments", "--yes"]

LATENCY_MS = 4000
#: The ``short_ttl`` server's TTL, and its provider's latency (longer).
SHORT_TTL_S = 2
SHORT_TTL_LATENCY_S = 3
#: gunicorn's worker timeout: the master kills (SIGABRT) a worker busy for longer.
WORKER_TIMEOUT = 2
LEASE = 2
#: How long a charge takes to reach the provider on the ``transit`` server.
TRANSIT_MS = 3000
#: Whether the lease of the record of ``:k`` has run out.
EXPIRED = "SELECT lease_expires_at <= CURRENT_TIMESTAMP FROM idempotency_keys WHERE key = :k"


def _database(request: pytest.FixtureRequest, workdir: Path) -> str:
    if request.param == "postgresql":
        url = str(request.getfixturevalue("fresh_pg_database")())
    else:
        url = f"sqlite:///{workdir / 'sample.sqlite3'}"
    migrate(url)
    return url


@pytest.fixture(scope="module", params=["postgresql", "sqlite"])
def server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> t.Iterator[SampleServer]:
    """A provider taking 4 s per new charge, behind gunicorn's 2 s worker timeout."""
    workdir = tmp_path_factory.mktemp(f"outcomes-{request.param}")
    server = SampleServer(
        _database(request, workdir),
        workdir,
        args=["--timeout", str(WORKER_TIMEOUT)],
        SAMPLE_PROVIDER_LATENCY_MS=str(LATENCY_MS),
        FLASK_IDEMPOTENCY_LEASE=str(LEASE),
        FLASK_IDEMPOTENCY_TTL="600",
    )
    yield server
    server.stop()


@pytest.fixture(scope="module", params=["postgresql", "sqlite"])
def transit(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> t.Iterator[SampleServer]:
    """Charges that take 3 s to reach the provider, a 2 s lease, and a worker timeout long
    enough for gunicorn to leave a frozen worker alone."""
    workdir = tmp_path_factory.mktemp(f"transit-{request.param}")
    server = SampleServer(
        _database(request, workdir),
        workdir,
        args=["--timeout", "120"],
        SAMPLE_PROVIDER_TRANSIT_MS=str(TRANSIT_MS),
        FLASK_IDEMPOTENCY_LEASE=str(LEASE),
        FLASK_IDEMPOTENCY_TTL="600",
    )
    yield server
    server.stop()


@pytest.fixture(scope="module", params=["postgresql", "sqlite"])
def short_ttl(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> t.Iterator[SampleServer]:
    """A 2 s TTL, with a provider taking 3 s: requests outlive their TTL."""
    workdir = tmp_path_factory.mktemp(f"short-ttl-{request.param}")
    server = SampleServer(
        _database(request, workdir),
        workdir,
        SAMPLE_PROVIDER_LATENCY_MS=str(SHORT_TTL_LATENCY_S * 1000),
        FLASK_IDEMPOTENCY_TTL=str(SHORT_TTL_S),
    )
    yield server
    server.stop()


def _pay_and_lose(server: SampleServer, key: str, customer: str, kill: int | None) -> t.Any:
    """Pay; once the provider has charged, send ``kill`` to the worker serving the request
    (None: let gunicorn's worker timeout kill it). Returns what the client got."""
    connection = server.connection()
    connection.connect()
    assert connection.sock is not None
    client_port = connection.sock.getsockname()[1]
    thread, outcome = in_background(
        lambda: server.pay(key, payment(customer), connection=connection)
    )
    wait_for(lambda: count(server, "provider_charges", customer) == 1)
    if kill is not None:
        worker = server.worker_serving(client_port)
        assert worker is not None and worker != server.process.pid
        os.kill(worker, kill)
    thread.join()
    return outcome[0]


def _one_charge_one_payment(server: SampleServer, customer: str, reply: Reply) -> None:
    assert count(server, "provider_charges", customer) == 1, "charged exactly once"
    assert count(server, "payments", customer) == 1
    charge = server.scalar("SELECT id FROM provider_charges WHERE customer = :c", c=customer)
    assert reply.json()["provider_charge_id"] == charge


@pytest.mark.parametrize(
    "kill",
    [None, signal.SIGQUIT, signal.SIGINT],
    ids=["worker-timeout", "sigquit", "sigint"],
)
def test_a_worker_ended_after_the_charge_charges_once(
    server: SampleServer, kill: int | None
) -> None:
    key, customer = new_key(), new_customer()
    lost = _pay_and_lose(server, key, customer, kill)
    assert isinstance(lost, http.client.HTTPException | OSError) or lost.status >= 500, lost
    # SystemExit in the view: the key is unknown (not released), so a retry re-runs the
    # payment as the same operation and the provider answers the first charge.
    wait_for(
        lambda: (
            server.scalar("SELECT state FROM idempotency_keys WHERE key = :k", k=stored_key(key))
            == "unknown"
        )
    )
    retry = server.pay(key, payment(customer))
    assert_executed(retry)
    assert_replay(server.pay(key, payment(customer)), retry)
    _one_charge_one_payment(server, customer, retry)
    assert server.process.poll() is None


def test_a_provider_timeout_answers_504_and_the_retry_finishes(server: SampleServer) -> None:
    key = new_key()
    first = server.pay(key, payment("cus_timeout"))
    assert_problem(first, 504, "provider-timeout")
    retry = server.pay(key, payment("cus_timeout"))
    assert_executed(retry)
    charges = server.scalar(
        "SELECT count(*) FROM provider_charges WHERE id = :c", c=retry.json()["provider_charge_id"]
    )
    assert charges == 1
    assert records(server, key) == 1


@pytest.mark.parametrize("tool", ["reconcile", "release"])
def test_operator_after_kill_9_charges_once(server: SampleServer, tool: str) -> None:
    key, customer = new_key(), new_customer()
    _pay_and_lose(server, key, customer, signal.SIGKILL)
    wait_for(lambda: bool(server.scalar(EXPIRED, k=stored_key(key))), timeout=LEASE + 10)
    if tool == "reconcile":
        done = server.flask("idem", "reconcile")
        assert done.returncode == 0, done.stderr
        assert "1 completed" in done.stdout
        answer = server.pay(key, payment(customer))
        assert answer.status == 201 and answer.headers["Idempotent-Replayed"] == "true"
    else:
        args = ["--tenant", "alpha", "--endpoint", "POST /v1/payments", "--yes"]
        done = server.flask("idem", "release", *args, stdin=f"{key}\n")
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith("reopened")
        answer = server.pay(key, payment(customer))
        assert_executed(answer)
    _one_charge_one_payment(server, customer, answer)


@pytest.mark.parametrize(
    "verdict",
    [["reconcile"], ["release", *OPERATOR, "--not-happened"]],
    ids=["reconciler", "operator"],
)
def test_a_not_happened_verdict_on_a_frozen_worker_charges_once(
    transit: SampleServer, verdict: list[str]
) -> None:
    """A worker frozen (SIGSTOP) between deriving its downstream key and reaching the
    provider looks dead: its lease runs out and the provider has no charge, so the verdict
    is "not happened". The record must keep its downstream key, so that the client's retry
    and the worker, when it resumes, both charge under that one key: one charge."""
    key, customer = new_key(), new_customer()
    connection = transit.connection()
    connection.connect()
    assert connection.sock is not None
    worker, sent_before = None, len(transit.provider_attempts())
    thread, first = in_background(
        lambda: transit.pay(key, payment(customer), connection=connection)
    )
    try:
        # On its way to the provider: the attempt is logged, the charge not made yet.
        wait_for(lambda: len(transit.provider_attempts()) == sent_before + 1)
        worker = transit.worker_serving(connection.sock.getsockname()[1])
        assert worker is not None and worker != transit.process.pid
        os.kill(worker, signal.SIGSTOP)
        [(_, frozen_key)] = [line.split() for line in transit.provider_attempts()[sent_before:]]
        wait_for(lambda: bool(transit.scalar(EXPIRED, k=stored_key(key))), timeout=LEASE + 10)
        assert count(transit, "provider_charges", customer) == 0, "nothing charged yet"

        done = transit.flask("idem", *verdict, stdin=f"{key}\n")
        assert done.returncode == 0, done.stderr
        assert "1 reopened" in done.stdout or done.stdout.startswith("reopened"), done.stdout
        assert records(transit, key) == 1, "the record of the frozen attempt is kept"
        retry = transit.pay(key, payment(customer))
        assert_executed(retry)
    finally:
        if worker is not None:
            os.kill(worker, signal.SIGCONT)
        thread.join()
    charged = transit.sql(
        "SELECT DISTINCT downstream_key FROM provider_charges WHERE customer = :c", c=customer
    )
    assert [row[0] for row in charged] == [frozen_key], "one downstream key charged"
    sent = {line.split()[1] for line in transit.provider_attempts()[sent_before:]}
    assert sent == {frozen_key}, "the retry and the late worker sent the same key"
    _one_charge_one_payment(transit, customer, retry)
    [late] = first
    assert isinstance(late, Reply), late
    assert_problem(late, 409, "request-in-progress")  # its completion lost to the retry
    assert_replay(transit.pay(key, payment(customer)), retry)


def test_a_request_longer_than_its_ttl_replays(short_ttl: SampleServer) -> None:
    """The TTL counts from the answer, not from the claim: a retry sent as soon as the first
    answer arrives replays it, though the first request ran longer than the TTL.

    A retry that reached the server more than a TTL after that answer (a machine stalled
    for seconds: it happened once in CI) rightly runs again; the payments' ``created`` stamps
    prove when that was the case, and only then is the attempt made again with a new key."""
    for _ in range(3):
        key, customer = new_key(), new_customer()
        first = short_ttl.pay(key, payment(customer))
        assert_executed(first)
        retry = short_ttl.pay(key, payment(customer))
        if _retry_came_after_the_ttl(first, retry):
            continue
        assert_replay(retry, first)
        assert count(short_ttl, "payments", customer) == 1
        return
    pytest.fail("three retries in a row reached the server after the TTL: the machine stalls")


def _retry_came_after_the_ttl(first: Reply, retry: Reply) -> bool:
    """Whether ``retry`` ran again and provably claimed after the first answer's TTL ended.

    ``created`` is a payment's whole second (truncated) after its provider call: the first
    completed at or after ``c1``; the retry claimed before ``c2 + 1 - latency``. Its claim
    came after the TTL only if ``c2 + 1 - latency > c1 + ttl``: a retry that ran again with
    a smaller gap is a defect, and fails the test."""
    if retry.status != 201 or retry.headers["Idempotent-Replayed"] is not None:
        return False
    gap = json.loads(retry.body)["created"] - json.loads(first.body)["created"]
    return bool(gap > SHORT_TTL_S + SHORT_TTL_LATENCY_S - 1)
