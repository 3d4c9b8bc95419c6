"""Many claimants, one scope: exactly one wins, with real threads and real processes."""

from __future__ import annotations

import concurrent.futures
import hashlib
import multiprocessing
import threading
import typing as t

import pytest

from flask_idem import Scope, create_store
from flask_idem.store import SQLStore
from tests.support.helpers import shift

ROUNDS = 50
THREADS = 16
PROCESSES = 8
FP = hashlib.sha256(b"same request").digest()


def _scope(round_number: int) -> Scope:
    return Scope("tenant-a", "POST /v1/payments", f"race-{round_number}")


def test_threads_claiming_one_scope_have_one_winner(store: SQLStore) -> None:
    barrier = threading.Barrier(THREADS)

    def claimant(round_number: int) -> bool:
        barrier.wait()
        return store.claim(_scope(round_number), FP, ttl=60, lease=30).claimed

    with concurrent.futures.ThreadPoolExecutor(THREADS) as pool:
        for round_number in range(ROUNDS):
            futures = [pool.submit(claimant, round_number) for _ in range(THREADS)]
            winners = sum(f.result(timeout=60) for f in futures)
            assert winners == 1, f"round {round_number}: {winners} winners"


def test_threads_taking_over_one_lease_have_one_winner(store: SQLStore) -> None:
    barrier = threading.Barrier(THREADS)

    def contender(scope: Scope, token: str) -> bool:
        barrier.wait()
        return store.take_over(scope, token, lease=30) is not None

    with concurrent.futures.ThreadPoolExecutor(THREADS) as pool:
        for round_number in range(ROUNDS // 5):
            scope = _scope(round_number)
            token = store.claim(scope, FP, ttl=60, lease=1).token
            shift(store, scope, 2, "lease_expires_at")
            futures = [pool.submit(contender, scope, token) for _ in range(THREADS)]
            assert sum(f.result(timeout=60) for f in futures) == 1


def _process_claimant(
    url: str, barrier: t.Any, results: t.Any, rounds: int
) -> None:  # pragma: no cover - runs in a child process
    store = create_store(url)
    try:
        for round_number in range(rounds):
            barrier.wait(timeout=60)
            results.put(
                (round_number, store.claim(_scope(round_number), FP, ttl=60, lease=30).claimed)
            )
    finally:
        store.engine.dispose()


@pytest.mark.slow
def test_processes_claiming_one_scope_have_one_winner(store: SQLStore, db_url: str) -> None:
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(PROCESSES)
    results = context.Queue()
    processes = [
        context.Process(target=_process_claimant, args=(db_url, barrier, results, ROUNDS))
        for _ in range(PROCESSES)
    ]
    for process in processes:
        process.start()
    winners = [0] * ROUNDS
    try:
        for _ in range(ROUNDS * PROCESSES):
            round_number, claimed = results.get(timeout=120)
            winners[round_number] += claimed
    finally:
        for process in processes:
            process.join(timeout=60)
    assert all(process.exitcode == 0 for process in processes)
    assert winners == [1] * ROUNDS
