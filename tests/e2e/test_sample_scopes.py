"""The sample app under gunicorn and PostgreSQL with account-wide keys per API key
(``FLASK_IDEMPOTENCY_SCOPE=account``, ``SAMPLE_KEYS_PER_API_KEY=true``): a payment's key reused
for a refund is refused, two API keys of one tenant never share a key, and the operator tools
find both. The sample app's own contract (tests/e2e/test_sample_app.py) runs on its defaults."""

from __future__ import annotations

import hashlib
import json
import typing as t
import uuid

import pytest

from tests.support.sample_server import ALPHA, SampleServer, migrate, spelled, stored_key

pytestmark = pytest.mark.postgresql

SECOND = "sk_test_alpha_2"
BASE = "https://payments.example/problems/"


@pytest.fixture(scope="module")
def server(
    fresh_pg_database: t.Callable[[], str], tmp_path_factory: pytest.TempPathFactory
) -> t.Iterator[SampleServer]:
    url = spelled(fresh_pg_database(), "postgresql")
    migrate(url)
    served = SampleServer(
        url,
        tmp_path_factory.mktemp("scopes"),
        threads=4,
        FLASK_IDEMPOTENCY_SCOPE="account",
        SAMPLE_KEYS_PER_API_KEY="true",
    )
    yield served
    served.stop()


def _payment() -> dict[str, t.Any]:
    return {"amount": 4200, "currency": "eur", "customer": f"cus_{uuid.uuid4().hex[:12]}"}


def test_a_payments_key_reused_for_a_refund_is_refused(server: SampleServer) -> None:
    key, body = f"scope-{uuid.uuid4()}", _payment()
    paid = server.pay(key, body)
    assert paid.status == 201, paid.body
    assert server.pay(key, body).headers["Idempotent-Replayed"] == "true"
    other = server.pay(key, _payment())
    assert other.status == 422 and other.json()["type"] == f"{BASE}idempotency-key-reused"
    path = f"/v1/payments/{paid.json()['id']}/refunds"
    refused = server.request("POST", path, key=key, json_body={"amount": 100})
    assert refused.status == 422, refused.body
    assert refused.headers["Content-Type"] == "application/problem+json"
    assert refused.json()["type"] == f"{BASE}idempotency-key-used-elsewhere"
    assert (
        server.scalar("SELECT count(*) FROM refunds WHERE payment_id = :id", id=paid.json()["id"])
        == 0
    )
    refunded = server.request("POST", path, key=f"scope-{uuid.uuid4()}", json_body={"amount": 100})
    assert refunded.status == 201, refunded.body


def test_two_api_keys_of_one_tenant_never_share_an_idempotency_key(server: SampleServer) -> None:
    key, body = f"scope-{uuid.uuid4()}", _payment()
    charges = len(server.provider_attempts())
    first = server.pay(key, body)
    second = server.pay(key, body, api_key=SECOND)
    assert first.status == second.status == 201
    assert first.json()["id"] != second.json()["id"], "each API key ran its own payment"
    for api_key, original in ((ALPHA, first), (SECOND, second)):
        again = server.pay(key, body, api_key=api_key)
        assert again.status == 201 and again.headers["Idempotent-Replayed"] == "true"
        assert again.json() == original.json()
    assert len(server.provider_attempts()) == charges + 2, "two charges, no more"
    namespaces = server.sql(
        "SELECT tenant, endpoint FROM idempotency_keys WHERE key = :key ORDER BY created_at",
        key=stored_key(key),
    )
    assert [row.tenant for row in namespaces] == ["alpha", "alpha"], "the tenant stays the tenant"
    assert all(
        row.endpoint.startswith("principal=") and row.endpoint.endswith(" *") for row in namespaces
    )
    assert not any("sk_test" in row.endpoint for row in namespaces), "never the API key itself"

    for api_key in (ALPHA, SECOND):
        key_id = hashlib.sha256(api_key.encode()).hexdigest()[:16]
        status = server.request(
            "GET", "/idempotency/requests?endpoint=POST%20/v1/payments", api_key=api_key, key=key
        )
        assert status.status == 200, status.body
        [seen] = status.json()["requests"]
        assert seen["status"] == 201 and seen["replays"] is True
        assert seen["endpoint"] == f"principal={key_id} *", "its own record, never the other's"

    shown = server.flask("idem", "show", "--tenant", "alpha", "--json", stdin=key)
    assert shown.returncode == 0, shown.stderr
    assert sorted(r["endpoint"] for r in json.loads(shown.stdout)) == sorted(
        row.endpoint for row in namespaces
    )
