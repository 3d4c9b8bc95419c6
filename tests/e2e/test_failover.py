"""A primary failover under load: the sample app under gunicorn on a libpq multi-host URL
(``target_session_attrs=read-write``), a streaming standby made by ``pg_basebackup``, the
primary stopped (``pg_ctl stop -m immediate``) and the standby promoted while new keys and
retries keep coming.

In flight, every answer is a completed one or a 503 problem (or a 409 for a key whose attempt
died with the primary), never a 500; afterwards every key settles to its one payment and one
charge. With synchronous replication no completed record is lost: every 201 replays after the
failover. With an asynchronous standby a record committed on the primary but not yet streamed
is lost, and its retry runs the payment again (what docs/operations.md, "Failover", warns of).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import threading
import time
import typing as t
from pathlib import Path

import pytest
import sqlalchemy as sa

from flask_idem import Scope, StoreUnavailable
from flask_idem.store import create_store
from tests.e2e.test_faults import (
    BOUND,
    PROMISED,
    assert_answer,
    assert_healthy,
    assert_no_key_in,
    new_customer,
    new_key,
    payment,
    settle,
)
from tests.support import pgcluster
from tests.support.drivers import PG_DRIVERS
from tests.support.replication import Replicated
from tests.support.sample_server import Reply, SampleServer, migrate

pytestmark = [pytest.mark.postgresql, pytest.mark.slow]

#: A request whose attempt died with the primary holds its key this long (then a retry takes
#: it over and re-executes it, with the same downstream key).
LEASE = 2
#: Client threads sending new keys and retries through the failover.
CLIENTS = 6
#: Seconds a client waits after a 409 or a 503 before its next request.
BACKOFF = 0.2
#: Payments completed before the primary is stopped, and again after the promotion.
COMPLETED = 10


@dataclasses.dataclass(frozen=True)
class Sent:
    key: str
    customer: str
    reply: Reply
    #: Whether the primary had been stopped when the request was sent.
    after_stop: bool


def _replicated(*, synchronous: bool) -> t.Iterator[Replicated]:
    """A primary and its standby for one test (a failover leaves them unusable), and no raw
    key in either server's log."""
    if not pgcluster.have_server_binaries() or not pgcluster.find_binary("pg_basebackup"):
        pytest.fail(pgcluster.NO_SERVER)
    name = f"failover-{'sync' if synchronous else 'async'}-{os.getpid()}"
    pair = Replicated(pgcluster.PG_DIR / name, synchronous=synchronous)
    try:
        pair.start()
        yield pair
        assert_no_key_in(pair.primary.log_file)
        assert_no_key_in(pair.standby.log_file)
    finally:
        pair.stop()


@pytest.fixture
def synchronous_pair() -> t.Iterator[Replicated]:
    yield from _replicated(synchronous=True)


@pytest.fixture
def asynchronous_pair() -> t.Iterator[Replicated]:
    yield from _replicated(synchronous=False)


def _serve(pair: Replicated, driver: str, workdir: Path) -> SampleServer:
    """The sample app on both servers' multi-host URL, its database migrated on the primary."""
    database = pgcluster.create_database(pair.primary.url)
    migrate(database)
    url = pair.url(sa.make_url(database).database or "", driver)
    return SampleServer(url, workdir, threads=4, FLASK_IDEMPOTENCY_LEASE=str(LEASE))


class Load:
    """Client threads: each pays with a new key, then retries it, until stopped."""

    def __init__(self, server: SampleServer) -> None:
        self.server = server
        self.sent: list[Sent] = []
        self.primary_stopped = False
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._client) for _ in range(CLIENTS)]

    def __enter__(self) -> Load:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join()

    def _client(self) -> None:
        while not self._stop.is_set():
            key, customer = new_key(), new_customer()
            for _attempt in range(2):
                after_stop = self.primary_stopped
                reply = self.server.pay(key, payment(customer), timeout=60)
                with self._lock:
                    self.sent.append(Sent(key, customer, reply, after_stop))
                if reply.status != 201:
                    time.sleep(BACKOFF)  # as a client would, before its retry

    def wait_for(self, condition: t.Callable[[list[Sent]], bool], timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while not condition(list(self.sent)):
            assert time.monotonic() < deadline, "the load did not get there"
            time.sleep(0.05)


def _completed_before_stop(sent: list[Sent]) -> int:
    return sum(1 for s in sent if s.reply.status == 201 and not s.after_stop)


def _fail_over_under_load(pair: Replicated, server: SampleServer) -> list[Sent]:
    """Load, the primary stopped, a second of a standby that refuses writes, the promotion,
    and load again until new keys complete on the new primary."""
    with Load(server) as load:
        load.wait_for(lambda sent: _completed_before_stop(sent) >= COMPLETED)
        load.primary_stopped = True
        pair.stop_primary()
        time.sleep(1)
        pair.promote_standby()
        promoted = len(load.sent)
        load.wait_for(
            lambda sent: sum(1 for s in sent[promoted:] if s.reply.status == 201) >= COMPLETED
        )
    return load.sent


def _charges_per_customer(server: SampleServer, table: str) -> dict[str, int]:
    rows = server.sql(f"SELECT customer, count(*) FROM {table} GROUP BY customer")
    return {customer: int(count) for customer, count in rows}


@pytest.mark.parametrize("driver", PG_DRIVERS, ids=["psycopg2", "psycopg"])
def test_synchronous_failover_loses_nothing_and_charges_once(
    synchronous_pair: Replicated, driver: str, tmp_path: Path
) -> None:
    """Through the switch only 201, 409 and 503 problems; the application reaches the new
    primary by itself; afterwards every key settles to one payment and one charge, and every
    201 answered before (or during) the failover replays byte for byte."""
    server = _serve(synchronous_pair, driver, tmp_path)
    try:
        sent = _fail_over_under_load(synchronous_pair, server)
        for s in sent:
            # 409: a retry of a key whose first attempt died with the primary, lease still held.
            assert_answer(s.reply, {201, 409, 503})
        assert any(s.reply.status == 503 for s in sent), "the switch was not seen"
        completed: dict[str, bytes] = {}
        for s in sent:
            if s.reply.status == 201:
                assert completed.setdefault(s.key, s.reply.body) == s.reply.body
        customers = {s.key: s.customer for s in sent}
        with concurrent.futures.ThreadPoolExecutor(CLIENTS) as pool:
            settled = pool.map(lambda key: settle(server, key, payment(customers[key])), customers)
            finals = dict(zip(customers, settled, strict=True))
        for key, final in finals.items():
            assert final.status == 201, final.body
            if key in completed:
                # Committed on the primary, hence on the synchronous standby: replayed.
                assert final.body == completed[key]
                assert final.headers["Idempotent-Replayed"] == "true"
        wanted = dict.fromkeys(customers.values(), 1)
        assert _charges_per_customer(server, "provider_charges") == wanted
        assert _charges_per_customer(server, "payments") == wanted
    finally:
        server.stop()
    assert_healthy(server)


def test_asynchronous_failover_loses_what_was_not_streamed_and_the_retry_runs_again(
    asynchronous_pair: Replicated, tmp_path: Path
) -> None:
    """What docs/operations.md ("Failover") says an asynchronous standby can lose: a payment
    committed on the primary but not streamed yet. The retry after the failover finds no
    record, runs the payment again and calls the provider with a *new* downstream key (it
    derives from the lost record): against a real provider, a second charge."""
    server = _serve(asynchronous_pair, PG_DRIVERS[0], tmp_path)
    try:
        streamed_key, streamed_customer = new_key(), new_customer()
        streamed = server.pay(streamed_key, payment(streamed_customer))
        assert streamed.status == 201
        asynchronous_pair.wait_caught_up()
        asynchronous_pair.hold_streaming()
        lost_key, lost_customer = new_key(), new_customer()
        attempts_before = len(server.provider_attempts())
        lost = server.pay(lost_key, payment(lost_customer))
        assert lost.status == 201, "an asynchronous commit does not wait for the standby"
        asynchronous_pair.stop_primary()
        asynchronous_pair.promote_standby()

        replay = settle(server, streamed_key, payment(streamed_customer))
        assert (replay.status, replay.body) == (201, streamed.body)
        assert replay.headers["Idempotent-Replayed"] == "true"

        again = settle(server, lost_key, payment(lost_customer))
        assert again.status == 201, again.body
        assert "Idempotent-Replayed" not in again.headers, "the completed record was lost"
        assert again.json()["id"] != lost.json()["id"]
        attempts = server.provider_attempts()[attempts_before:]
        assert len(attempts) == 2 and len(set(attempts)) == 2, "two charges, two downstream keys"
    finally:
        server.stop()
    assert_healthy(server)


def test_without_its_synchronous_standby_a_new_key_answers_503_in_time_and_runs_once_later(
    synchronous_pair: Replicated, tmp_path: Path
) -> None:
    """The price of synchronous replication: with its only standby down the primary commits
    nothing, so a new key answers 503 within the client-side deadline (a commit waiting for
    the standby is not ended by the server's statement timeout), its view never runs, and once
    the standby is back its retries end in one charge."""
    server = _serve(synchronous_pair, PG_DRIVERS[0], tmp_path)
    try:
        assert server.pay(new_key(), payment(new_customer())).status == 201
        synchronous_pair.standby.stop_server("immediate")
        key, customer = new_key(), new_customer()
        attempts = len(server.provider_attempts())
        started = time.monotonic()
        reply = server.pay(key, payment(customer))
        assert time.monotonic() - started < BOUND
        assert_answer(reply, {503})
        assert len(server.provider_attempts()) == attempts, "the view ran"
        # The sample's rate limiter may have answered first: the store's own claim, alone,
        # in a thread, so that a claim that never returns fails the test instead of hanging it.
        store = create_store(server.url)
        scope = Scope("alpha", "POST /x", new_key())
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            claim = pool.submit(store.claim, scope, b"f" * 32, ttl=60, lease=LEASE)
            try:
                assert isinstance(claim.exception(timeout=PROMISED + 2), StoreUnavailable)
            finally:
                synchronous_pair.standby.start_server()  # ends any wait for it
        store.engine.dispose()
        synchronous_pair.wait_streaming()
        assert settle(server, key, payment(customer)).status == 201
        assert _charges_per_customer(server, "provider_charges")[customer] == 1
    finally:
        server.stop()
    assert_healthy(server)
