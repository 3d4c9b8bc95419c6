"""The sample app's HTTP contract, exact statuses and bodies, against gunicorn and PostgreSQL.

Four servers, each started once per module: ``main`` (fast provider, 2 workers x 4 threads),
``slow`` (a provider taking 3 s and a 3 s lease: in-flight duplicates and a killed worker),
``limited`` (a low rate limit) and ``down`` (its own PostgreSQL cluster, stopped by the test).
Every test uses its own keys and customers, so they share servers without seeing each other.
"""

from __future__ import annotations

import concurrent.futures
import http.client
import os
import signal
import threading
import time
import typing as t
import urllib.parse
import uuid
from pathlib import Path

import pytest
import sqlalchemy as sa

from tests.support.drivers import PG_DRIVERS
from tests.support.faultproxy import FaultProxy
from tests.support.sample_server import BETA, Reply, SampleServer, migrate, spelled, stored_key

pytestmark = pytest.mark.postgresql

TTL = 600
SLOW_LATENCY_MS = 3000
LEASE = 3
PAYMENT_MEMBERS = [
    "id",
    "object",
    "amount",
    "currency",
    "customer",
    "description",
    "status",
    "provider_charge_id",
    "created",
]
STORABLE_HEADERS = {"content-type", "location", "content-language", "etag", "link"}


# -- servers ------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=PG_DRIVERS, ids=["psycopg2", "psycopg"])
def main(
    request: pytest.FixtureRequest,
    fresh_pg_database: t.Callable[[], str],
    tmp_path_factory: pytest.TempPathFactory,
) -> t.Iterator[SampleServer]:
    """Fast provider; each driver (``postgresql+psycopg2://``, ``postgresql+psycopg://``) for
    both ``make migrate`` and the server: the contract holds on both."""
    url = spelled(fresh_pg_database(), request.param)
    migrate(url)
    server = SampleServer(
        url, tmp_path_factory.mktemp("main"), threads=4, FLASK_IDEMPOTENCY_TTL=str(TTL)
    )
    yield server
    server.stop()


@pytest.fixture(scope="module")
def slow(
    fresh_pg_database: t.Callable[[], str], tmp_path_factory: pytest.TempPathFactory
) -> t.Iterator[SampleServer]:
    """Slow provider and short lease; plain ``postgresql://`` for migrate and server."""
    url = spelled(fresh_pg_database(), "postgresql")
    migrate(url)
    server = SampleServer(
        url,
        tmp_path_factory.mktemp("slow"),
        SAMPLE_PROVIDER_LATENCY_MS=str(SLOW_LATENCY_MS),
        FLASK_IDEMPOTENCY_LEASE=str(LEASE),
    )
    yield server
    server.stop()


@pytest.fixture(scope="module")
def limited(
    fresh_pg_database: t.Callable[[], str], tmp_path_factory: pytest.TempPathFactory
) -> t.Iterator[SampleServer]:
    """3 POSTs per 3 seconds per API key. The provider takes 0.3 s so that concurrent
    requests occupy both sync workers: a per-process counter would grant 3 in each."""
    url = fresh_pg_database()
    migrate(url)
    server = SampleServer(
        url,
        tmp_path_factory.mktemp("limited"),
        SAMPLE_RATE_LIMIT="3 per 3 seconds",
        SAMPLE_PROVIDER_LATENCY_MS="300",
    )
    yield server
    server.stop()


# -- helpers ------------------------------------------------------------------------------


def new_key() -> str:
    return f"k-{uuid.uuid4().hex}"


def new_customer() -> str:
    return f"cus_{uuid.uuid4().hex[:12]}"


def payment(customer: str, amount: t.Any = 4200, **extra: t.Any) -> dict[str, t.Any]:
    return {"amount": amount, "currency": "eur", "customer": customer, **extra}


def assert_problem(reply: Reply, status: int, name: str) -> dict[str, t.Any]:
    """An RFC 9457 document: media type, absolute ``type`` ending in ``name``, members."""
    assert reply.status == status, reply.body
    assert reply.headers["Content-Type"] == "application/problem+json"
    document = reply.json()
    uri = urllib.parse.urlsplit(document["type"])
    assert uri.scheme and uri.netloc, document
    assert uri.path.rstrip("/").rsplit("/", 1)[-1] == name, document
    assert isinstance(document["title"], str) and document["title"]
    assert document["status"] == status
    assert isinstance(document["detail"], str) and document["detail"]
    return t.cast(dict[str, t.Any], document)


def assert_replay(reply: Reply, original: Reply) -> None:
    assert reply.status == original.status
    assert reply.body == original.body
    assert reply.headers["Content-Type"] == original.headers["Content-Type"]
    assert reply.headers["Location"] == original.headers["Location"]
    assert reply.headers["Idempotent-Replayed"] == "true"
    assert reply.headers["Set-Cookie"] is None


def assert_executed(reply: Reply, status: int = 201) -> None:
    assert reply.status == status, reply.body
    assert reply.headers["Idempotent-Replayed"] is None


def count(server: SampleServer, table: str, customer: str) -> int:
    return int(server.scalar(f"SELECT count(*) FROM {table} WHERE customer = :c", c=customer))


def records(server: SampleServer, key: str) -> int:
    return int(
        server.scalar("SELECT count(*) FROM idempotency_keys WHERE key = :k", k=stored_key(key))
    )


def wait_for(condition: t.Callable[[], bool], timeout: float = 15) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def in_background(call: t.Callable[[], Reply]) -> tuple[threading.Thread, list[t.Any]]:
    """Run ``call`` on a real thread; the list receives its reply or its exception."""
    outcome: list[t.Any] = []

    def run() -> None:
        try:
            outcome.append(call())
        except Exception as exc:  # the test inspects it (a killed worker resets the socket)
            outcome.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, outcome


# -- setup --------------------------------------------------------------------------------


def test_make_migrate_prepares_every_table(main: SampleServer, slow: SampleServer) -> None:
    # main was migrated and is served with postgresql+psycopg2://, slow with postgresql://.
    for server in (main, slow):
        tables = {
            row[0]
            for row in server.sql("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")
        }
        assert {
            "idempotency_keys",
            "flask_idem_alembic_version",
            "payments",
            "refunds",
            "provider_charges",
            "rate_limit_counters",
        } <= tables
        assert server.pay(new_key(), payment(new_customer())).status == 201


def test_prefixed_env_sets_ttl_and_lease(main: SampleServer, slow: SampleServer) -> None:
    key = new_key()
    assert main.pay(key, payment(new_customer())).status == 201
    ttl = main.scalar(
        "SELECT extract(epoch FROM expires_at - created_at) FROM idempotency_keys WHERE key = :k",
        k=stored_key(key),
    )
    assert float(ttl) == TTL
    key = new_key()
    thread, outcome = in_background(lambda: slow.pay(key, payment(new_customer())))
    wait_for(lambda: records(slow, key) == 1)
    lease = slow.scalar(
        "SELECT extract(epoch FROM lease_expires_at - now()) FROM idempotency_keys WHERE key = :k",
        k=stored_key(key),
    )
    assert 0 < float(lease) <= LEASE
    thread.join()
    assert outcome[0].status == 201


# -- authentication -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "authorization", [None, "Bearer sk_test_gamma", "Bearer ", "Basic c2tfdGVzdF9hbHBoYTo="]
)
@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("POST", "/v1/payments"),
        ("POST", "/v1/payments/pay_x/refunds"),
        ("GET", "/v1/payments"),
        ("GET", "/v1/payments/pay_x"),
    ],
)
def test_unauthenticated_requests_get_401(
    main: SampleServer, authorization: str | None, method: str, path: str
) -> None:
    key = new_key()
    headers = {"Authorization": authorization} if authorization else {}
    reply = main.request(
        method, path, api_key=None, key=key, json_body={"amount": 1}, headers=headers
    )
    assert_problem(reply, 401, "unauthorized")
    assert reply.headers["WWW-Authenticate"] == "Bearer"
    assert records(main, key) == 0


#: Alpha's read-only API key (``payments:read`` only).
READ_ONLY = "sk_test_alpha_read"


def test_a_read_only_key_never_sees_a_stored_payment(main: SampleServer) -> None:
    key = new_key()
    customer = new_customer()
    paid = main.request("POST", "/v1/payments", key=key, json_body=payment(customer), timeout=30)
    assert_executed(paid)
    for body in (payment(customer), payment(customer, amount=1)):
        refused = main.request("POST", "/v1/payments", api_key=READ_ONLY, key=key, json_body=body)
        assert_problem(refused, 403, "forbidden")
        assert paid.json()["id"].encode() not in refused.body
        assert refused.headers["Idempotent-Replayed"] is None
    fresh = new_key()
    refused = main.request(
        "POST", "/v1/payments", api_key=READ_ONLY, key=fresh, json_body=payment(new_customer())
    )
    assert_problem(refused, 403, "forbidden")
    assert records(main, fresh) == 0, "no claim for a refused request"
    listed = main.request("GET", f"/v1/payments/{paid.json()['id']}", api_key=READ_ONLY)
    assert listed.status == 200, "reads stay allowed"


def test_401_is_never_stored(main: SampleServer) -> None:
    key, customer = new_key(), new_customer()
    assert main.pay(key, payment(customer), api_key="sk_test_wrong").status == 401
    assert_executed(main.pay(key, payment(customer)))
    assert count(main, "payments", customer) == 1


# -- POST /v1/payments --------------------------------------------------------------------


def test_first_request_then_replay(main: SampleServer) -> None:
    key, customer = new_key(), new_customer()
    attempts = len(main.provider_attempts())
    before = time.time()
    first = main.pay(key, payment(customer, description="Order 42", metadata={"order": "42"}))
    assert_executed(first)
    body = first.json()
    assert list(body) == PAYMENT_MEMBERS
    assert body["id"].startswith("pay_")
    assert body["provider_charge_id"].startswith("ch_")
    assert body | {"id": None, "provider_charge_id": None, "created": None} == {
        "id": None,
        "object": "payment",
        "amount": 4200,
        "currency": "eur",
        "customer": customer,
        "description": "Order 42",
        "status": "succeeded",
        "provider_charge_id": None,
        "created": None,
    }
    assert isinstance(body["created"], int) and before - 1 <= body["created"] <= time.time() + 1
    assert first.headers["Content-Type"] == "application/json"
    assert first.headers["Location"] == f"/v1/payments/{body['id']}"
    assert first.headers["Set-Cookie"] == f"last_payment={body['id']}; HttpOnly; Path=/"
    assert first.headers["Idempotency-Key"] == key

    for _ in range(2):
        replay = main.pay(key, payment(customer, description="Order 42", metadata={"order": "42"}))
        assert_replay(replay, first)
        assert replay.headers["Idempotency-Key"] == key

    assert len(main.provider_attempts()) == attempts + 1
    assert count(main, "payments", customer) == 1
    assert count(main, "provider_charges", customer) == 1
    stored = main.scalar(
        "SELECT response_headers FROM idempotency_keys WHERE key = :k", k=stored_key(key)
    )
    assert {name.lower() for name, _ in stored} <= STORABLE_HEADERS
    fetched = main.request("GET", f"/v1/payments/{body['id']}")
    assert fetched.status == 200 and fetched.json() == body


def test_a_first_request_may_spell_the_amount_as_a_float(main: SampleServer) -> None:
    customer = new_customer()
    for spelling in (b"4200.0", b"4.2e3"):
        raw = b'{"amount": %s, "currency": "eur", "customer": "%s"}' % (
            spelling,
            customer.encode(),
        )
        reply = main.request("POST", "/v1/payments", key=new_key(), raw=raw)
        assert_executed(reply)
        assert reply.json()["amount"] == 4200


def test_same_canonical_request_replays(main: SampleServer) -> None:
    key, customer = new_key(), new_customer()
    first = main.pay(key, payment(customer, client_ts="2026-11-30T10:00:00Z"))
    assert_executed(first)
    equivalent = [
        # number spelling, key order, white space, and client_ts left out or changed
        b'{"customer":"%s","currency":"eur","amount":4200.0}',
        b'{ "amount" : 4.2e3 ,\n "currency" : "eur" , "customer" : "%s", "client_ts": 99 }',
        b'{"amount": 42e2, "customer": "%s", "currency": "eur", "client_ts": null}',
    ]
    for template in equivalent:
        reply = main.request("POST", "/v1/payments", key=key, raw=template % customer.encode())
        assert_replay(reply, first)
    for different in (
        payment(customer, amount=4201),
        payment(customer, currency="usd"),
        payment(customer, description="other"),
        payment(new_customer()),
    ):
        assert_problem(main.pay(key, different), 422, "idempotency-key-reused")
    assert count(main, "payments", customer) == 1


def test_key_headers(main: SampleServer) -> None:
    key, customer = new_key(), new_customer()
    first = main.pay(key, payment(customer))
    assert_executed(first)
    for headers in (
        {"X-Idempotency-Key": key},
        {"Idempotency-Key": f'"{key}"'},
        {"Idempotency-Key": key, "X-Idempotency-Key": f'"{key}"'},
    ):
        reply = main.pay(None, payment(customer), headers=headers)
        assert_replay(reply, first)
        assert reply.headers["Idempotency-Key"] == key

    attempts = len(main.provider_attempts())
    other = new_customer()
    conflicting = main.pay(
        None, payment(other), headers={"Idempotency-Key": "a", "X-Idempotency-Key": "b"}
    )
    assert_problem(conflicting, 400, "idempotency-key-invalid")
    assert_problem(main.pay(None, payment(other)), 400, "idempotency-key-missing")
    for invalid in ("has space", "x" * 256, "", "semi;colon", '"unterminated', "caf\u00e9"):
        reply = main.pay(None, payment(other), headers={"Idempotency-Key": invalid})
        assert_problem(reply, 400, "idempotency-key-invalid")
        assert records(main, invalid) == 0
    assert count(main, "payments", other) == 0
    assert len(main.provider_attempts()) == attempts

    longest = "Az09-_.:~+/=" + "k" * 243
    assert len(longest) == 255
    reply = main.pay(longest, payment(other))
    assert_executed(reply)
    assert reply.headers["Idempotency-Key"] == longest


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"amount": 0, "currency": "eur", "customer": "c"}, "amount"),
        ({"amount": -5, "currency": "eur", "customer": "c"}, "amount"),
        ({"amount": 42.5, "currency": "eur", "customer": "c"}, "amount"),
        ({"amount": "4200", "currency": "eur", "customer": "c"}, "amount"),
        ({"amount": True, "currency": "eur", "customer": "c"}, "amount"),
        ({"currency": "eur", "customer": "c"}, "amount"),
        ({"amount": 1, "currency": "EUR", "customer": "c"}, "currency"),
        ({"amount": 1, "currency": "eu", "customer": "c"}, "currency"),
        ({"amount": 1, "currency": "euro", "customer": "c"}, "currency"),
        ({"amount": 1, "currency": "eur"}, "customer"),
        ({"amount": 1, "currency": "eur", "customer": 7}, "customer"),
        ({"amount": 1, "currency": "eur", "customer": "c", "description": 5}, "description"),
        ({"amount": 1, "currency": "eur", "customer": "c", "metadata": {"a": 1}}, "metadata"),
        ({"amount": 1, "currency": "eur", "customer": "c", "metadata": "x"}, "metadata"),
        ({"amount": 1, "currency": "eur", "customer": "c", "surprise": 1}, "surprise"),
        ([1, 2], "_schema"),
        (b'{"amount": 1, "currency": ', "_schema"),
        (b"", "_schema"),
    ],
)
def test_invalid_body_is_a_stored_400(main: SampleServer, body: t.Any, field: str) -> None:
    key = new_key()
    attempts = len(main.provider_attempts())
    if isinstance(body, bytes):
        first = main.request("POST", "/v1/payments", key=key, raw=body)
    else:
        first = main.pay(key, body)
    document = assert_problem(first, 400, "invalid-request")
    assert isinstance(document["errors"][field], list | dict), document
    assert first.headers["Idempotency-Key"] == key
    retry = (
        main.request("POST", "/v1/payments", key=key, raw=body)
        if isinstance(body, bytes)
        else main.pay(key, body)
    )
    assert retry.status == 400 and retry.body == first.body
    assert retry.headers["Idempotent-Replayed"] == "true"
    assert len(main.provider_attempts()) == attempts


def test_declined_card_is_a_stored_402(main: SampleServer) -> None:
    key = new_key()
    attempts = len(main.provider_attempts())
    body = payment("cus_declined", amount=1234)
    first = main.pay(key, body)
    assert_problem(first, 402, "card-declined")
    assert first.headers["Idempotency-Key"] == key
    replay = main.pay(key, body)
    assert replay.status == 402 and replay.body == first.body
    assert replay.headers["Content-Type"] == "application/problem+json"
    assert replay.headers["Idempotent-Replayed"] == "true"
    assert len(main.provider_attempts()) == attempts + 1
    assert count(main, "payments", "cus_declined") == 0


def test_crash_before_the_provider_releases_the_key(main: SampleServer) -> None:
    key = new_key()
    attempts = len(main.provider_attempts())
    for _ in range(2):
        reply = main.pay(key, payment("cus_crash"))
        assert_problem(reply, 500, "internal-error")
        assert reply.headers["Idempotent-Replayed"] is None
        assert reply.headers["Idempotency-Key"] == key
        assert records(main, key) == 0
    assert len(main.provider_attempts()) == attempts
    assert count(main, "payments", "cus_crash") == 0


# -- scope --------------------------------------------------------------------------------


def test_tenants_are_isolated(main: SampleServer) -> None:
    key, customer = new_key(), new_customer()
    alpha = main.pay(key, payment(customer))
    assert_executed(alpha)
    beta = main.pay(key, payment(customer), api_key=BETA)
    assert_executed(beta)
    assert beta.json()["id"] != alpha.json()["id"]
    assert_replay(main.pay(key, payment(customer), api_key=BETA), beta)
    assert_problem(main.pay(key, payment(customer, 1), api_key=BETA), 422, "idempotency-key-reused")
    assert_replay(main.pay(key, payment(customer)), alpha)

    alpha_id, beta_id = alpha.json()["id"], beta.json()["id"]
    assert_problem(
        main.request("GET", f"/v1/payments/{alpha_id}", api_key=BETA), 404, "payment-not-found"
    )
    assert_problem(main.request("GET", f"/v1/payments/{beta_id}"), 404, "payment-not-found")
    refund = main.request(
        "POST",
        f"/v1/payments/{alpha_id}/refunds",
        api_key=BETA,
        key=new_key(),
        json_body={"amount": 1},
    )
    assert_problem(refund, 404, "payment-not-found")
    alpha_ids = {p["id"] for p in main.request("GET", "/v1/payments").json()["data"]}
    beta_ids = {p["id"] for p in main.request("GET", "/v1/payments", api_key=BETA).json()["data"]}
    assert alpha_id in alpha_ids and beta_id not in alpha_ids
    assert beta_id in beta_ids and alpha_id not in beta_ids
    assert count(main, "payments", customer) == 2


def test_the_other_endpoint_is_independent(main: SampleServer) -> None:
    key = new_key()
    created = main.pay(key, payment(new_customer()))
    assert_executed(created)
    path = f"/v1/payments/{created.json()['id']}/refunds"
    refund = main.request("POST", path, key=key, json_body={"amount": 100})
    assert_executed(refund)
    assert refund.json()["object"] == "refund"
    again = main.request("POST", path, key=key, json_body={"amount": 100})
    assert again.body == refund.body and again.headers["Idempotent-Replayed"] == "true"


def test_get_ignores_the_key_header(main: SampleServer) -> None:
    created = main.pay(new_key(), payment(new_customer()))
    for path in ("/v1/payments", f"/v1/payments/{created.json()['id']}"):
        for key in ("get-key", "not a valid key"):
            for _ in range(2):
                reply = main.request("GET", path, key=key)
                assert reply.status == 200
                assert reply.headers["Idempotent-Replayed"] is None
    assert records(main, "get-key") == 0


# -- reads and refunds -------------------------------------------------------------------


def test_list_is_newest_first(main: SampleServer) -> None:
    ids = [main.pay(new_key(), payment(new_customer())).json()["id"] for _ in range(3)]
    listing = main.request("GET", "/v1/payments")
    assert listing.status == 200
    document = listing.json()
    assert list(document) == ["object", "data"] and document["object"] == "list"
    listed = [p["id"] for p in document["data"]]
    assert listed[:3] == ids[::-1]
    assert all(list(p) == PAYMENT_MEMBERS for p in document["data"])
    assert_problem(main.request("GET", "/v1/payments/pay_unknown"), 404, "payment-not-found")


def test_refunds(main: SampleServer) -> None:
    customer = new_customer()
    paid = main.pay(new_key(), payment(customer, amount=4200)).json()
    path = f"/v1/payments/{paid['id']}/refunds"

    def refund(amount: t.Any, key: str | None = None) -> Reply:
        return main.request("POST", path, key=key or new_key(), json_body={"amount": amount})

    first = refund(1000)
    assert_executed(first)
    body = first.json()
    assert list(body) == ["id", "object", "payment", "amount"]
    assert body["id"].startswith("re_")
    assert body | {"id": None} == {
        "id": None,
        "object": "refund",
        "payment": paid["id"],
        "amount": 1000,
    }

    over = refund(3201)
    document = assert_problem(over, 400, "refund-exceeds-payment")
    assert "amount" in document["errors"]
    assert_executed(refund(3200))
    assert_problem(refund(1), 400, "refund-exceeds-payment")
    for invalid in (0, -1, 1.5, "1"):
        assert_problem(refund(invalid), 400, "invalid-request")
    missing = main.request(
        "POST", "/v1/payments/pay_missing/refunds", key=new_key(), json_body={"amount": 1}
    )
    assert_problem(missing, 404, "payment-not-found")
    total = main.scalar("SELECT sum(amount) FROM refunds WHERE payment_id = :p", p=paid["id"])
    assert total == 4200


def test_concurrent_refunds_never_exceed_the_payment(main: SampleServer) -> None:
    paid = main.pay(new_key(), payment(new_customer(), amount=1000)).json()
    path = f"/v1/payments/{paid['id']}/refunds"
    barrier = threading.Barrier(8)

    def refund(_: int) -> int:
        barrier.wait()
        return main.request("POST", path, key=new_key(), json_body={"amount": 300}).status

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        statuses = sorted(pool.map(refund, range(8)))
    assert statuses == [201] * 3 + [400] * 5
    total = main.scalar("SELECT sum(amount) FROM refunds WHERE payment_id = :p", p=paid["id"])
    assert total == 900


# -- lifetime and storage -----------------------------------------------------------------


def test_a_key_past_its_ttl_executes_again(main: SampleServer) -> None:
    key, customer = new_key(), new_customer()
    first = main.pay(key, payment(customer))
    assert_executed(first)
    main.sql(
        "UPDATE idempotency_keys SET expires_at = now() - interval '1 second' WHERE key = :k",
        k=stored_key(key),
    )
    second = main.pay(key, payment(customer))
    assert_executed(second)
    assert second.json()["id"] != first.json()["id"]
    assert second.headers["Set-Cookie"] is not None
    assert_replay(main.pay(key, payment(customer)), second)
    assert count(main, "payments", customer) == 2


def test_records_are_partitioned_and_deduplicate_across_partitions(main: SampleServer) -> None:
    strategy = main.scalar(
        "SELECT p.partstrat FROM pg_partitioned_table AS p "
        "WHERE p.partrelid = 'idempotency_keys'::regclass"
    )
    assert strategy == "r"
    column = main.scalar(
        "SELECT a.attname FROM pg_partitioned_table AS p JOIN pg_attribute AS a "
        "ON a.attrelid = p.partrelid AND a.attnum = p.partattrs[0] "
        "WHERE p.partrelid = 'idempotency_keys'::regclass"
    )
    assert column == "created_at"
    bounds = dict(
        main.sql(
            "SELECT c.relname, pg_get_expr(c.relpartbound, c.oid) FROM pg_inherits AS i "
            "JOIN pg_class AS c ON c.oid = i.inhrelid "
            "WHERE i.inhparent = 'idempotency_keys'::regclass"
        )
    )
    assert "DEFAULT" in bounds.values()
    today = main.scalar("SELECT to_char(now() AT TIME ZONE 'UTC', 'YYYYMMDD')")
    tomorrow = main.scalar(
        "SELECT to_char((now() AT TIME ZONE 'UTC') + interval '1 day', 'YYYYMMDD')"
    )
    assert {f"idempotency_keys_p{today}", f"idempotency_keys_p{tomorrow}"} <= set(bounds)

    key, customer = new_key(), new_customer()
    first = main.pay(key, payment(customer))
    assert_executed(first)
    main.sql(
        "UPDATE idempotency_keys SET created_at = created_at - interval '1 day' WHERE key = :k",
        k=stored_key(key),
    )
    partition, day = main.sql(
        "SELECT tableoid::regclass::text, to_char(created_at AT TIME ZONE 'UTC', 'YYYYMMDD') "
        "FROM idempotency_keys WHERE key = :k",
        k=stored_key(key),
    )[0]
    assert partition == f"idempotency_keys_p{day}" and day != today
    assert_replay(main.pay(key, payment(customer)), first)
    assert_problem(main.pay(key, payment(customer, 1)), 422, "idempotency-key-reused")
    assert records(main, key) == 1 and count(main, "payments", customer) == 1


# -- concurrency and recovery ------------------------------------------------------------


def test_concurrent_duplicates_execute_once(main: SampleServer) -> None:
    key, customer = new_key(), new_customer()
    barrier = threading.Barrier(10)

    def send(_: int) -> Reply:
        barrier.wait()
        return main.pay(key, payment(customer))

    with concurrent.futures.ThreadPoolExecutor(10) as pool:
        replies = list(pool.map(send, range(10)))
    originals = [r for r in replies if r.status == 201 and r.headers["Idempotent-Replayed"] is None]
    assert len(originals) == 1, [r.status for r in replies]
    for reply in replies:
        assert reply.headers["Idempotency-Key"] == key
        if reply.status == 409:
            assert_problem(reply, 409, "request-in-progress")
            assert int(reply.headers["Retry-After"]) >= 1
        elif reply is not originals[0]:
            assert_replay(reply, originals[0])
    assert_replay(main.pay(key, payment(customer)), originals[0])
    assert count(main, "payments", customer) == 1
    assert count(main, "provider_charges", customer) == 1


@pytest.mark.slow
def test_duplicate_while_in_flight_gets_409(slow: SampleServer) -> None:
    key, customer = new_key(), new_customer()
    attempts = len(slow.provider_attempts())
    thread, outcome = in_background(lambda: slow.pay(key, payment(customer)))
    wait_for(lambda: len(slow.provider_attempts()) == attempts + 1)
    busy = slow.pay(key, payment(customer))
    assert_problem(busy, 409, "request-in-progress")
    assert 1 <= int(busy.headers["Retry-After"]) <= LEASE
    assert busy.headers["Idempotency-Key"] == key
    assert_problem(slow.pay(key, payment(customer, 1)), 422, "idempotency-key-reused")
    thread.join()
    (first,) = outcome
    assert_executed(first)
    assert_replay(slow.pay(key, payment(customer)), first)
    assert len(slow.provider_attempts()) == attempts + 1


@pytest.mark.slow
def test_killed_worker_recovers_after_the_lease(slow: SampleServer) -> None:
    key, customer = new_key(), new_customer()
    attempts = len(slow.provider_attempts())
    connection = slow.connection()
    connection.connect()
    assert connection.sock is not None
    client_port = connection.sock.getsockname()[1]
    thread, outcome = in_background(lambda: slow.pay(key, payment(customer), connection=connection))
    # The provider has charged and is "answering" (SAMPLE_PROVIDER_LATENCY_MS): kill now.
    wait_for(lambda: count(slow, "provider_charges", customer) == 1)
    worker = slow.worker_serving(client_port)
    assert worker is not None and worker != slow.process.pid
    os.kill(worker, signal.SIGKILL)
    thread.join()
    assert isinstance(outcome[0], http.client.HTTPException | OSError), outcome
    assert slow.process.poll() is None

    early = slow.pay(key, payment(customer))
    assert_problem(early, 409, "request-in-progress")
    assert int(early.headers["Retry-After"]) >= 1
    wait_for(
        lambda: bool(
            slow.scalar(
                "SELECT lease_expires_at <= now() FROM idempotency_keys WHERE key = :k",
                k=stored_key(key),
            )
        ),
        timeout=LEASE + 5,
    )
    recovered = slow.pay(key, payment(customer))
    assert_executed(recovered)
    assert_replay(slow.pay(key, payment(customer)), recovered)

    assert count(slow, "provider_charges", customer) == 1
    assert count(slow, "payments", customer) == 1
    charge = slow.scalar("SELECT id FROM provider_charges WHERE customer = :c", c=customer)
    assert recovered.json()["provider_charge_id"] == charge
    tried = slow.provider_attempts()[attempts:]
    assert len(tried) == 2 and tried[0] == tried[1]


# -- rate limit ---------------------------------------------------------------------------


@pytest.mark.slow
def test_rate_limit_is_shared_by_workers_and_never_stored(limited: SampleServer) -> None:
    keys = [new_key() for _ in range(4)]
    barrier = threading.Barrier(4)

    def send(key: str) -> Reply:
        barrier.wait()
        return limited.pay(key, payment(new_customer()))

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        replies = dict(zip(keys, pool.map(send, keys), strict=True))
    assert sorted(r.status for r in replies.values()) == [201, 201, 201, 429]
    (limited_key,) = [k for k, r in replies.items() if r.status == 429]
    refused = replies[limited_key]
    assert_problem(refused, 429, "rate-limited")
    assert int(refused.headers["Retry-After"]) >= 1
    assert records(limited, limited_key) == 0
    assert len(limited.provider_attempts()) == 3

    # Per API key, and only on POST.
    assert limited.request("GET", "/v1/payments").status == 200
    assert_executed(limited.pay(new_key(), payment(new_customer()), api_key=BETA))

    # The 429 claimed nothing: once the window is over, the same key executes.
    time.sleep(int(refused.headers["Retry-After"]))
    customer = new_customer()
    deadline = time.monotonic() + 10
    retry = limited.pay(limited_key, payment(customer))
    while retry.status == 429 and time.monotonic() < deadline:
        time.sleep(0.2)
        retry = limited.pay(limited_key, payment(customer))
    assert_executed(retry)
    assert count(limited, "payments", customer) == 1


# -- database down ------------------------------------------------------------------------


@pytest.mark.slow
def test_database_down_answers_503_without_running_the_handler(
    fresh_pg_database: t.Callable[[], str], tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The app reaches its database through a proxy; closing it takes the database away."""
    url = fresh_pg_database()
    migrate(url)
    real = sa.make_url(url)
    proxy = FaultProxy(real.port or 5432)
    server: SampleServer | None = None
    try:
        through_proxy = real.set(host="127.0.0.1", port=proxy.port)
        server = SampleServer(
            through_proxy.render_as_string(hide_password=False),
            Path(tmp_path_factory.mktemp("down")),
        )
        done = new_key()
        assert_executed(server.pay(done, payment(new_customer())))
        assert len(server.provider_attempts()) == 1
        proxy.close()
        for key in (new_key(), new_key(), done):
            reply = server.pay(key, payment(new_customer()))
            assert_problem(reply, 503, "store-unavailable")
            assert int(reply.headers["Retry-After"]) >= 1
            assert reply.headers["Idempotency-Key"] == key
        assert len(server.provider_attempts()) == 1
        # Reads too, whether a worker opens a new connection or finds a stale pooled one.
        for path in ("/v1/payments", "/v1/payments/pay_" + "0" * 24) * 3:
            assert_problem(server.request("GET", path), 503, "store-unavailable")
    finally:
        proxy.close()
        if server is not None:
            server.stop()


# -- echo before the claim, downstream keys after expiry ------------------------------


def test_401_echoes_the_key(main: SampleServer) -> None:
    key = new_key()
    reply = main.pay(key, payment(new_customer()), api_key="sk_test_wrong")
    assert reply.status == 401
    assert reply.headers["Idempotency-Key"] == key


def test_an_expired_key_charges_anew(main: SampleServer) -> None:
    key, customer = new_key(), new_customer()
    first = main.pay(key, payment(customer, amount=4200))
    main.sql(
        "UPDATE idempotency_keys SET expires_at = now() - interval '1 second' WHERE key = :k",
        k=stored_key(key),
    )
    second = main.pay(key, payment(customer, amount=100))
    assert_executed(second)
    assert second.json()["provider_charge_id"] != first.json()["provider_charge_id"]


# -- bad input and unknown routes ----------------------------------------------------------


@pytest.mark.parametrize("escape", [r"c\u0000", r"\ud800"])
@pytest.mark.parametrize("field", ["customer", "description"])
def test_unstorable_text_is_a_400_before_any_charge(
    main: SampleServer, escape: str, field: str
) -> None:
    """A NUL or a lone surrogate is valid JSON but no storable text: refused up front."""
    values = {"customer": '"cus_text"', "description": '"fine"'}
    values[field] = f'"{escape}"'
    raw = (
        '{"amount": 1, "currency": "eur", '
        f'"customer": {values["customer"]}, "description": {values["description"]}}}'
    ).encode()
    before = len(main.provider_attempts())
    reply = main.request("POST", "/v1/payments", key=new_key(), raw=raw)
    document = assert_problem(reply, 400, "invalid-request")
    assert field in document["errors"]
    assert len(main.provider_attempts()) == before, "refused before the provider is called"


@pytest.mark.parametrize(
    ("method", "path", "status", "name"),
    [
        ("POST", "/v1/payments/", 404, "not-found"),
        ("GET", "/v1/nothing", 404, "not-found"),
        ("PUT", "/v1/payments", 405, "method-not-allowed"),
    ],
)
def test_unknown_routes_answer_problems(
    main: SampleServer, method: str, path: str, status: int, name: str
) -> None:
    reply = main.request(method, path, json_body={})
    assert_problem(reply, status, name)
    if status == 405:
        assert "POST" in reply.headers["Allow"]


def test_the_contract_settings_start_the_app(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """``FLASK_IDEMPOTENCY_TTL=2`` alone, and with ``FLASK_IDEMPOTENCY_LEASE=3``."""
    from sample_app import create_app

    monkeypatch.setenv("DATABASE_URL", f"sqlite:///{tmp_path}/boot.sqlite3")
    monkeypatch.setenv("FLASK_IDEMPOTENCY_TTL", "2")
    assert create_app().extensions["idempotency"].settings.ttl == 2
    monkeypatch.setenv("FLASK_IDEMPOTENCY_LEASE", "3")
    settings = create_app().extensions["idempotency"].settings
    assert (settings.ttl, settings.lease) == (2, 3)
