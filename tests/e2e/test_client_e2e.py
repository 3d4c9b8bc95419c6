"""The retrying client against the sample app under gunicorn, through a proxy that loses answers."""

from __future__ import annotations

import re
import typing as t

import httpx
import pytest

from flask_idem.client import IdempotentClient, KeyReused, RetryPolicy
from tests.support.faultproxy import FaultProxy
from tests.support.sample_server import SampleServer, served


@pytest.fixture(scope="module")
def server(
    fresh_pg_database: t.Callable[[], str], tmp_path_factory: pytest.TempPathFactory
) -> t.Iterator[SampleServer]:
    with served(fresh_pg_database(), tmp_path_factory.mktemp("client")) as sample:
        yield sample


def _client(port: int) -> IdempotentClient:
    http = httpx.Client(
        base_url=f"http://127.0.0.1:{port}",
        headers={"Authorization": "Bearer sk_test_alpha"},
        timeout=10,
    )
    policy = RetryPolicy(max_attempts=4, total_timeout=30, base_delay=0.05, max_delay=0.2)
    return IdempotentClient(http, policy=policy)


def _keys(requests: list[bytes]) -> list[str]:
    found = []
    for raw in requests:
        match = re.search(rb"(?im)^idempotency-key: *(\S+)\r$", raw)
        assert match is not None, raw[:200]
        found.append(match.group(1).decode())
    return found


def test_a_lost_answer_is_retried_with_the_same_key_and_replayed(server: SampleServer) -> None:
    proxy = FaultProxy(server.port, drop=1)
    try:
        client = _client(proxy.port)
        body = {"amount": 4200, "currency": "usd", "customer": "cus_proxy"}
        result = client.post("/v1/payments", json=body)
        client.client.close()
    finally:
        proxy.close()
    assert result.attempts == 2
    assert result.response.status_code == 201
    assert result.replayed, "the second attempt got the stored answer of the first"
    payment = result.response.json()
    rows = server.sql("SELECT id FROM payments WHERE customer = 'cus_proxy'")
    assert [row.id for row in rows] == [payment["id"]], "exactly one payment, the replayed one"
    assert server.scalar("SELECT count(*) FROM provider_charges WHERE customer = 'cus_proxy'") == 1
    assert _keys(proxy.requests) == [result.key, result.key]


def test_a_reused_key_raises_and_creates_nothing(server: SampleServer) -> None:
    client = _client(server.port)
    first = client.post(
        "/v1/payments", json={"amount": 1, "currency": "usd", "customer": "cus_reuse"}
    )
    with pytest.raises(KeyReused) as info:
        client.post(
            "/v1/payments",
            json={"amount": 2, "currency": "usd", "customer": "cus_reuse"},
            key=first.key,
        )
    client.client.close()
    assert info.value.key == first.key and info.value.attempts == 1
    assert server.scalar("SELECT count(*) FROM payments WHERE customer = 'cus_reuse'") == 1
