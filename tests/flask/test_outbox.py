"""The client outbox on SQLite and PostgreSQL, against a flask_idem API served in-process."""

from __future__ import annotations

import json
import typing as t
from pathlib import Path

import flask
import httpx
import pytest
import sqlalchemy as sa
from flask import Flask

from flask_idem import Idempotency
from flask_idem.client import (
    IdempotentClient,
    IndefiniteAnswer,
    KeyReused,
    RetriesExhausted,
    RetryPolicy,
)
from flask_idem.outbox import (
    CREDENTIAL_HEADERS,
    Outbox,
    OutboxConflict,
    OutboxState,
    outbox_table,
)
from flask_idem.store import create_store
from flask_idem.testing import empty_store

FAST = RetryPolicy(max_attempts=3, total_timeout=10, base_delay=0.001, max_delay=0.01)
PAYMENT = {"amount": 4200, "currency": "usd"}


class Api:
    """A payments API behind flask_idem; ``charges`` counts what it executed."""

    def __init__(self, store_url: str) -> None:
        self.store = create_store(store_url)
        empty_store(self.store)
        self.app = Flask("outbox-api")
        self.charges: list[t.Any] = []
        self.sent: list[httpx.Request] = []
        idem = Idempotency(self.app, store=self.store, tenant=lambda: "alpha")

        @self.app.before_request
        def authenticate() -> t.Any:
            if flask.request.headers.get("Authorization") != "Bearer good":
                return {"error": "unauthenticated"}, 401
            return None

        @self.app.post("/v1/payments")
        @idem.idempotent
        def pay() -> t.Any:
            self.charges.append(flask.request.get_json())
            return {"id": f"pay_{len(self.charges)}"}, 201

        @self.app.post("/v1/refunds/")  # POST /v1/refunds is answered 308 by Flask
        @idem.idempotent
        def refund() -> t.Any:
            self.charges.append(flask.request.get_json())
            return {"id": f"re_{len(self.charges)}"}, 201

        @self.app.post("/v1/transfers")
        @idem.idempotent
        def transfer() -> t.Any:
            """Charges, then answers 500 on its own: flask_idem stores and replays that 500."""
            self.charges.append(flask.request.get_json())
            return {"error": "ledger said no after the charge"}, 500

    def transport(self, *, before: t.Callable[[httpx.Request], None] | None = None) -> t.Any:
        wsgi = httpx.WSGITransport(app=self.app)
        api = self

        class Recording(httpx.BaseTransport):
            def handle_request(self, request: httpx.Request) -> httpx.Response:
                api.sent.append(request)
                if before is not None:
                    before(request)
                return wsgi.handle_request(request)

        return Recording()

    def client(self, transport: t.Any = None, **options: t.Any) -> IdempotentClient:
        http = httpx.Client(
            transport=transport or self.transport(),
            base_url="http://api",
            headers={"Authorization": "Bearer good"},
        )
        return IdempotentClient(http, policy=FAST, **options)


class Unreachable(httpx.BaseTransport):
    def handle_request(self, request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)


@pytest.fixture
def api(sqlite_url: str) -> t.Iterator[Api]:
    api = Api(sqlite_url)
    yield api
    empty_store(api.store)
    api.store.engine.dispose()


@pytest.fixture(params=["sqlite", "postgresql"])
def outbox_url(
    request: pytest.FixtureRequest, tmp_path: Path, fresh_pg_database: t.Callable[[], str]
) -> str:
    """An empty application database of each dialect, where the outbox lives."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/app.sqlite3"
    return fresh_pg_database()


@pytest.fixture
def engine(outbox_url: str) -> t.Iterator[sa.Engine]:
    engine = sa.create_engine(outbox_url)
    yield engine
    engine.dispose()


@pytest.fixture
def outbox(engine: sa.Engine) -> Outbox:
    outbox = Outbox(engine)
    outbox.create_table()
    return outbox


def test_the_operation_is_committed_before_the_first_send(
    api: Api, outbox: Outbox, outbox_url: str
) -> None:
    seen_in_another_connection = []

    def check(request: httpx.Request) -> None:
        other = sa.create_engine(outbox_url)
        try:
            with other.connect() as conn:
                rows = conn.execute(sa.text("SELECT key, state FROM idempotency_outbox")).all()
        finally:
            other.dispose()
        seen_in_another_connection.append((rows, request.headers["Idempotency-Key"]))

    entry = outbox.send(
        api.client(api.transport(before=check)), "order-1", "POST", "/v1/payments", json=PAYMENT
    )
    assert seen_in_another_connection == [([(entry.key, "pending")], entry.key)]
    assert entry.state is OutboxState.DONE and entry.response_status == 201
    assert entry.json() == {"id": "pay_1"} and api.charges == [PAYMENT]


def test_a_restart_resumes_pending_operations_with_their_stored_key_and_bytes(
    api: Api, engine: sa.Engine, outbox: Outbox
) -> None:
    first = outbox.add("order-1", "POST", "/v1/payments", json=PAYMENT)
    second = outbox.add("order-2", "POST", "/v1/payments", json={**PAYMENT, "amount": 1})
    restarted = Outbox(engine)  # a new process: nothing in memory but the table
    resumed = restarted.resume(api.client())
    assert [(entry.operation, entry.state, entry.response_status) for entry in resumed] == [
        ("order-1", OutboxState.DONE, 201),
        ("order-2", OutboxState.DONE, 201),
    ]
    assert [request.headers["Idempotency-Key"] for request in api.sent] == [first.key, second.key]
    assert [request.content for request in api.sent] == [first.body, second.body]
    assert api.charges == [PAYMENT, {**PAYMENT, "amount": 1}]
    assert restarted.pending() == [] and restarted.resume(api.client()) == []


def test_no_answer_leaves_the_operation_pending_and_the_retry_replays(
    api: Api, outbox: Outbox
) -> None:
    """The answer is lost after the API executed: the operation must stay pending, and the
    resumed send must get the replay, not a second charge."""
    wsgi = api.transport()

    class AnswerLost(httpx.BaseTransport):
        def handle_request(self, request: httpx.Request) -> httpx.Response:
            wsgi.handle_request(request).read()
            raise httpx.ReadTimeout("the answer was lost", request=request)

    with pytest.raises(RetriesExhausted):
        outbox.send(api.client(AnswerLost()), "order-1", "POST", "/v1/payments", json=PAYMENT)
    entry = outbox.get("order-1")
    assert entry is not None and entry.state is OutboxState.PENDING
    assert entry.response_status is None

    (still,) = outbox.resume(api.client(Unreachable()))
    assert still == entry, "still pending, same key, after a resume that reached nobody"

    (resumed,) = outbox.resume(api.client())
    assert resumed.done and resumed.response_status == 201
    assert resumed.json() == {"id": "pay_1"} and api.charges == [PAYMENT]
    assert {request.headers["Idempotency-Key"] for request in api.sent} == {entry.key}


def test_a_401_is_refreshed_and_retried_with_the_same_key(api: Api, outbox: Outbox) -> None:
    http = httpx.Client(
        transport=api.transport(), base_url="http://api", headers={"Authorization": "Bearer old"}
    )
    client = IdempotentClient(
        http, policy=FAST, refresh_credentials=lambda response: {"Authorization": "Bearer good"}
    )
    entry = outbox.send(client, "order-1", "POST", "/v1/payments", json=PAYMENT)
    assert entry.done and entry.response_status == 201 and api.charges == [PAYMENT]
    assert [request.headers["Authorization"] for request in api.sent] == [
        "Bearer old",
        "Bearer good",
    ]
    assert {request.headers["Idempotency-Key"] for request in api.sent} == {entry.key}


def test_a_401_without_a_refresh_leaves_the_operation_pending(api: Api, outbox: Outbox) -> None:
    http = httpx.Client(transport=api.transport(), base_url="http://api")
    outbox.add("order-1", "POST", "/v1/payments", json=PAYMENT)
    (entry,) = outbox.resume(IdempotentClient(http, policy=FAST))
    assert entry.state is OutboxState.PENDING and api.charges == []


def test_a_422_is_definitive_and_recorded(api: Api, engine: sa.Engine, outbox: Outbox) -> None:
    """The stored request no longer matches what its key ran (here: altered in the table)."""
    done = outbox.send(api.client(), "order-1", "POST", "/v1/payments", json=PAYMENT)
    with engine.begin() as conn:
        conn.execute(
            outbox.table.update().values(
                state="pending", body=json.dumps({**PAYMENT, "amount": 1}).encode()
            )
        )
    (entry,) = outbox.resume(api.client())
    assert entry.done and entry.response_status == 422 and entry.key == done.key
    assert outbox.pending() == [] and api.charges == [PAYMENT]
    with engine.begin() as conn:
        conn.execute(outbox.table.update().values(state="pending"))
    with pytest.raises(KeyReused):
        outbox.deliver(api.client(), outbox.pending()[0])
    assert outbox.pending() == []


def test_sending_a_done_operation_again_returns_its_answer_without_sending(
    api: Api, outbox: Outbox
) -> None:
    first = outbox.send(api.client(), "order-1", "POST", "/v1/payments", json=PAYMENT)
    again = outbox.send(api.client(), "order-1", "POST", "/v1/payments", json=PAYMENT)
    assert again == first and len(api.sent) == 1


def test_another_request_under_a_stored_operation_is_refused(api: Api, outbox: Outbox) -> None:
    outbox.add("order-1", "POST", "/v1/payments", json=PAYMENT)
    with pytest.raises(OutboxConflict, match="different request"):
        outbox.send(api.client(), "order-1", "POST", "/v1/payments", json={"amount": 1})
    with pytest.raises(OutboxConflict):
        outbox.add("order-1", "POST", "/v1/refunds", json=PAYMENT)
    assert api.sent == []


def test_a_redirect_leaves_the_operation_pending(api: Api, outbox: Outbox) -> None:
    """Flask's trailing-slash 308: the operation never ran, so it is no answer to record."""
    with pytest.raises(IndefiniteAnswer, match="redirect"):
        outbox.send(api.client(), "refund-1", "POST", "/v1/refunds", json=PAYMENT)
    entry = outbox.get("refund-1")
    assert entry is not None and entry.state is OutboxState.PENDING
    assert entry.response_status is None and api.charges == [] and len(api.sent) == 1
    (still,) = outbox.resume(api.client())
    assert still == entry and len(api.sent) == 2, "resumed, still pending"


@pytest.mark.parametrize("status", [307, 308, 501, 505, 507, 511, 520, 521, 522, 523, 524])
def test_a_status_that_does_not_answer_the_operation_leaves_it_pending(
    api: Api, outbox: Outbox, status: int
) -> None:
    """A CDN's 522/524 (origin unreachable, timed out) leaves open whether the charge ran."""
    edge = httpx.MockTransport(lambda request: httpx.Response(status))
    with pytest.raises(IndefiniteAnswer):
        outbox.send(api.client(edge), "order-1", "POST", "/v1/payments", json=PAYMENT)
    entry = outbox.get("order-1")
    assert entry is not None and entry.state is OutboxState.PENDING
    (resumed,) = outbox.resume(api.client())
    assert resumed.done and resumed.response_status == 201 and api.charges == [PAYMENT]


def test_a_stored_500_replayed_is_the_operations_answer(api: Api, outbox: Outbox) -> None:
    """The view answered 500 after its charge; the replay of that 500 ends the operation."""
    entry = outbox.send(api.client(), "transfer-1", "POST", "/v1/transfers", json=PAYMENT)
    assert entry.done and entry.response_status == 500 and api.charges == [PAYMENT]
    assert [request.headers.get("Idempotency-Key") for request in api.sent] == [entry.key] * 2
    assert outbox.pending() == [] and outbox.resume(api.client()) == []
    assert len(api.sent) == 2 and api.charges == [PAYMENT]


@pytest.mark.parametrize(
    ("first", "again"),
    [
        (
            {"json": {"amount": 4200, "currency": "usd"}},
            {"json": {"currency": "usd", "amount": 4200}},
        ),
        (
            {"json": {"amount": 4200, "currency": "usd"}},
            {"json": {"amount": 4200.0, "currency": "usd"}},
        ),
        ({"headers": {"X-Request-Id": "r-1"}}, {"headers": {"X-Request-Id": "r-2"}}),
        ({"headers": {"traceparent": "00-a-b-01"}}, {}),
    ],
    ids=["key-order", "number-spelling", "request-id", "trace-context"],
)
def test_the_same_request_as_the_server_sees_it_is_the_same_operation(
    api: Api, outbox: Outbox, first: dict[str, t.Any], again: dict[str, t.Any]
) -> None:
    """What the server's fingerprint treats as one request is one operation: no conflict that
    would push the caller to a second name, a second key and a second charge."""
    stored = outbox.add("order-1", "POST", "/v1/payments", **{"json": PAYMENT, **first})
    assert outbox.add("order-1", "POST", "/v1/payments", **{"json": PAYMENT, **again}) == stored
    done = outbox.send(
        api.client(), "order-1", "POST", "/v1/payments", **{"json": PAYMENT, **again}
    )
    assert done.done and done.key == stored.key and api.charges == [PAYMENT]
    assert api.sent[0].content == stored.body, "the stored bytes are what is sent"


def test_the_query_order_does_not_make_another_request(outbox: Outbox) -> None:
    stored = outbox.add("order-1", "POST", "/v1/payments?a=1&b=2", json=PAYMENT)
    assert outbox.add("order-1", "POST", "/v1/payments?b=2&a=1", json=PAYMENT) == stored
    with pytest.raises(OutboxConflict):
        outbox.add("order-1", "POST", "/v1/payments?a=2&b=2", json=PAYMENT)


def test_only_volatile_headers_are_left_out_of_the_comparison(outbox: Outbox) -> None:
    """A request id changes per call; a header such as an account may change the request."""
    first = {"X-Account": "a", "X-Request-Id": "r-1"}
    stored = outbox.add("order-1", "POST", "/v1/payments", json=PAYMENT, headers=first)
    again = {"X-Account": "a", "X-Request-Id": "r-2"}
    assert outbox.add("order-1", "POST", "/v1/payments", json=PAYMENT, headers=again) == stored
    other = {"X-Account": "b", "X-Request-Id": "r-1"}
    with pytest.raises(OutboxConflict):
        outbox.add("order-1", "POST", "/v1/payments", json=PAYMENT, headers=other)


@pytest.mark.parametrize(
    "header", ["Authorization", "cookie", "Proxy-Authorization", "X-Api-Key", "X-Auth-Token"]
)
def test_credentials_are_never_stored(outbox: Outbox, header: str) -> None:
    with pytest.raises(ValueError, match="credentials are not stored") as info:
        outbox.add("order-1", "POST", "/v1/payments", json=PAYMENT, headers={header: "s3cr3t"})
    assert header.lower() in str(info.value) and "s3cr3t" not in str(info.value)
    assert outbox.get("order-1") is None


@pytest.mark.parametrize(
    "url",
    [
        "https://user:s3cr3t@api.example.com/v1/payments",
        "https://s3cr3t@api.example.com/v1/payments",
        "/v1/payments?api_key=s3cr3t",
        "/v1/payments?currency=usd&ACCESS_TOKEN=s3cr3t",
    ],
)
def test_credentials_in_the_url_are_never_stored(outbox: Outbox, url: str) -> None:
    with pytest.raises(ValueError, match="credentials are not stored") as info:
        outbox.add("order-1", "POST", url, json=PAYMENT)
    assert "s3cr3t" not in str(info.value) and outbox.get("order-1") is None


def test_the_credential_headers_are_configurable(engine: sa.Engine) -> None:
    outbox = Outbox(engine, credential_headers=CREDENTIAL_HEADERS | {"X-Shop-Secret"})
    outbox.create_table()
    with pytest.raises(ValueError, match="x-shop-secret"):
        outbox.add("order-1", "POST", "/v1/payments", headers={"X-Shop-Secret": "s3cr3t"})
    assert outbox.get("order-1") is None


def test_the_table_can_live_in_the_applications_metadata(api: Api, engine: sa.Engine) -> None:
    metadata = sa.MetaData()
    table = outbox_table(metadata, "payments_outbox")
    metadata.create_all(engine)  # what the application's own migration does
    outbox = Outbox(engine, table=table)
    entry = outbox.send(
        api.client(), "order-1", "POST", "/v1/payments", json=PAYMENT, headers={"X-Trace": "t"}
    )
    assert entry.done and entry.headers == {"x-trace": "t", "content-type": "application/json"}
    assert api.sent[0].headers["X-Trace"] == "t"
    assert sa.inspect(engine).get_table_names() == ["payments_outbox"]
