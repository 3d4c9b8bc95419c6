"""A client process killed mid-operation, restarted: exactly one payment per operation.

The client (``tests/support/outbox_client.py``, a real process) keeps its operations in an outbox on
SQLite or PostgreSQL and talks to the sample app under gunicorn through a fault proxy that
leaves it waiting at a known point; there it gets SIGKILL, so nothing in its memory survives.
The restarted process resumes from the outbox alone, starting with an expired API key that it
refreshes on the 401.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import typing as t
import uuid
from pathlib import Path

import pytest
import sqlalchemy as sa

from flask_idem.outbox import Outbox, OutboxState
from tests.support.faultproxy import FaultProxy
from tests.support.pgcluster import ROOT
from tests.support.sample_server import SampleServer, served


@pytest.fixture(scope="module")
def server(
    fresh_pg_database: t.Callable[[], str], tmp_path_factory: pytest.TempPathFactory
) -> t.Iterator[SampleServer]:
    with served(fresh_pg_database(), tmp_path_factory.mktemp("outbox")) as sample:
        yield sample


@pytest.fixture(params=["sqlite", "postgresql"])
def outbox_url(
    request: pytest.FixtureRequest, tmp_path: Path, fresh_pg_database: t.Callable[[], str]
) -> str:
    """The client application's own database, where its outbox lives."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/client.sqlite3"
    return fresh_pg_database()


def _client(api_key: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.support.outbox_client", *args],
        cwd=ROOT,
        env={**os.environ, "OUTBOX_API_KEY": api_key},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _key(raw: bytes) -> str:
    match = re.search(rb"(?im)^idempotency-key: *(\S+)\r$", raw)
    assert match is not None, raw[:200]
    return match.group(1).decode()


def _stored(outbox_url: str) -> OutboxState | None:
    engine = sa.create_engine(outbox_url)
    try:
        entry = Outbox(engine).get("order-1")
    finally:
        engine.dispose()
    return None if entry is None else entry.state


@pytest.mark.parametrize(
    ("fault", "payments_at_the_kill"),
    [("hold", 0), ("withhold", 1)],
    ids=["killed-after-persisting-before-sending", "killed-after-sending-before-the-answer"],
)
def test_a_killed_client_pays_once_after_its_restart(
    server: SampleServer, outbox_url: str, fault: str, payments_at_the_kill: int
) -> None:
    customer = f"cus_outbox_{uuid.uuid4().hex[:12]}"
    proxy = FaultProxy(server.port, **{fault: 1})
    base_url = f"http://127.0.0.1:{proxy.port}"
    try:
        first = _client("sk_test_alpha", "send", outbox_url, base_url, "order-1", customer)
        try:
            assert proxy.faulted.wait(60), first.stderr.read() if first.poll() is not None else ""
            assert _stored(outbox_url) is OutboxState.PENDING, "committed before the send"
            count = "SELECT count(*) FROM payments WHERE customer = :customer"
            assert server.scalar(count, customer=customer) == payments_at_the_kill
        finally:
            first.kill()
            first.communicate()  # reaps it and closes its pipes
        assert first.returncode == -9 and _stored(outbox_url) is OutboxState.PENDING

        restarted = _client("sk_test_expired", "resume", outbox_url, base_url)
        out, err = restarted.communicate(timeout=120)
        assert restarted.returncode == 0, err[-3000:]
    finally:
        proxy.close()
    (finished,) = json.loads(out)
    assert (finished["operation"], finished["state"], finished["status"]) == (
        "order-1",
        "done",
        201,
    )
    rows = server.sql("SELECT id FROM payments WHERE customer = :customer", customer=customer)
    assert [row.id for row in rows] == [finished["body"]["id"]], "exactly one payment"
    charges = "SELECT count(*) FROM provider_charges WHERE customer = :customer"
    assert server.scalar(charges, customer=customer) == 1
    assert _stored(outbox_url) is OutboxState.DONE
    deadline = time.monotonic() + 10
    while len(proxy.requests) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)  # the proxy files a forwarded request once its connection closes
    keys = {_key(raw) for raw in proxy.requests}
    assert len(proxy.requests) >= 2 and len(keys) == 1, "every attempt carried the stored key"
