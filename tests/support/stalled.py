"""Requests answered while the database is stalled (frozen, or the claim table locked): every
request starts at once, and each answer comes with the seconds it took, to show how the server
fails and how fast."""

from __future__ import annotations

import concurrent.futures
import contextlib
import time
import typing as t

import psycopg2

from tests.support.sample_server import Reply


def timed(call: t.Callable[[], Reply]) -> tuple[Reply, float]:
    """The call's reply and the seconds it took."""
    started = time.monotonic()
    reply = call()
    return reply, time.monotonic() - started


def answered_while(
    stall: t.ContextManager[t.Any], calls: t.Sequence[t.Callable[[], Reply]]
) -> list[tuple[Reply, float]]:
    """Run every call at once, each in its own thread, inside ``stall``; ``stall`` ends only
    once every call has answered.

    :param stall: what holds the database back (for example the tests' ``frozen(cluster)``).
    :param calls: the requests, each a call that returns the server's reply.
    :return: each call's reply and seconds, in the order of ``calls``.
    """
    with stall, concurrent.futures.ThreadPoolExecutor(len(calls)) as pool:
        return list(pool.map(timed, calls))


@contextlib.contextmanager
def table_locked(database: str) -> t.Iterator[None]:
    """A session of ``database`` holds ``idempotency_keys`` in ACCESS EXCLUSIVE mode, so every
    claim waits on the lock; released whatever happens.

    :param database: the PostgreSQL URL of the served database (psycopg2 spelling).
    """
    locker = psycopg2.connect(database)
    try:
        with locker.cursor() as cursor:
            cursor.execute("LOCK TABLE idempotency_keys IN ACCESS EXCLUSIVE MODE")
        yield
    finally:
        locker.rollback()
        locker.close()
