"""Stored rows altered in the database (by hand, a bad restore, an attacker with write access)
are never replayed as they stand and never answer 500: a retry gets 503
``stored-response-unreadable``, and the view does not run again (the operation happened)."""

from __future__ import annotations

import base64
import json
import os
import struct
import typing as t
import zlib

import flask
import pytest
import sqlalchemy as sa

from flask_idem import ConfigurationError, Idempotency, Verdict
from flask_idem.core.key_digest import unkeyed
from flask_idem.core.sealing import MAGIC
from flask_idem.store import SQLStore
from tests.support.answers import BASE, post
from tests.support.helpers import Counter

KEYS = {"k1": base64.b64encode(os.urandom(32)).decode()}
#: A compressed envelope whose headers JSON is nested 100,000 levels deep.
DEEP_HEADERS = b"[" * 100_000 + b"]" * 100_000
DEEP_ENVELOPE = (
    MAGIC
    + b"\x01\x01"
    + b"\0" * 16
    + zlib.compress(struct.pack(">I", len(DEEP_HEADERS)) + DEEP_HEADERS + b"{}")
)

App = tuple[flask.Flask, Idempotency, Counter]


def _tamper(store: SQLStore, assignments: str, **values: t.Any) -> None:
    with store.engine.begin() as conn:
        updated = conn.execute(
            sa.text(f"UPDATE idempotency_keys SET {assignments} WHERE key = :stored_key"),
            {**values, "stored_key": unkeyed("alpha", "tampered-1")},
        )
        assert updated.rowcount == 1


def _headers_json(store: SQLStore) -> str:
    """How a statement writes JSON text into ``response_headers`` on this dialect."""
    return "CAST(:headers AS jsonb)" if store.engine.dialect.name == "postgresql" else ":headers"


def _retry_is_unreadable(app: flask.Flask, counter: Counter) -> None:
    for _ in range(2):
        retry = post(app, "tampered-1")
        assert retry.status_code == 503, retry.data
        assert retry.mimetype == "application/problem+json"
        assert retry.json["type"] == BASE + "stored-response-unreadable"
        assert "Idempotent-Replayed" not in retry.headers
    assert counter.calls == 1


@pytest.mark.parametrize("column", ["response_status", "response_body"])
def test_an_encrypted_row_missing_its_status_or_body_is_unreadable(
    app_factory: t.Callable[..., App], store: SQLStore, column: str
) -> None:
    app, _, counter = app_factory(IDEMPOTENCY_ENCRYPTION_KEYS=KEYS)
    assert post(app, "tampered-1").status_code == 201
    _tamper(store, f"{column} = NULL")
    _retry_is_unreadable(app, counter)


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"Location": "/payments/pay_1"},
        5,
        "Location",
        [["a"]],
        [["Location", "/payments/pay_1", "extra"]],
        [["Location", 5]],
        [[None, "x"]],
        [["Location", "/payments/pay_1\r\nSet-Cookie: session=stolen"]],
        [["Location", "/payments/pay_1\nX-Injected: 1"]],
        [["X-Injected\r\nSet-Cookie", "session=stolen"]],
        [["Bad Name", "x"]],
        [["", "x"]],
    ],
    ids=repr,
)
def test_a_plain_row_with_malformed_headers_is_unreadable(
    app_factory: t.Callable[..., App], store: SQLStore, headers: t.Any
) -> None:
    app, _, counter = app_factory()
    assert post(app, "tampered-1").status_code == 201
    _tamper(store, f"response_headers = {_headers_json(store)}", headers=json.dumps(headers))
    _retry_is_unreadable(app, counter)


@pytest.mark.parametrize("status", [0, -1, 99, 100, 101, 199, 600, 1000])
def test_a_plain_row_with_an_impossible_status_is_unreadable(
    app_factory: t.Callable[..., App], store: SQLStore, status: int
) -> None:
    app, _, counter = app_factory()
    assert post(app, "tampered-1").status_code == 201
    _tamper(store, "response_status = :status", status=status)
    _retry_is_unreadable(app, counter)


def test_a_plain_row_replays_only_the_headers_a_completion_stores(
    app_factory: t.Callable[..., App], store: SQLStore
) -> None:
    """Headers outside ``IDEMPOTENCY_STORED_HEADERS`` in a row (a per-request cookie, a
    connection upgrade, framing) were written by something else: the replay drops them."""
    app, _, counter = app_factory()
    assert post(app, "tampered-1").status_code == 201
    forged = [
        ["Location", "/payments/pay_1"],
        ["Set-Cookie", "session=attacker"],
        ["Connection", "upgrade"],
        ["Upgrade", "websocket"],
        ["Transfer-Encoding", "chunked"],
        ["Content-Length", "99"],
        ["X-Request-Id", "forged"],
    ]
    _tamper(store, f"response_headers = {_headers_json(store)}", headers=json.dumps(forged))
    retry = post(app, "tampered-1")
    assert retry.status_code == 201 and retry.headers["Idempotent-Replayed"] == "true"
    assert retry.headers["Location"] == "/payments/pay_1"
    for name in ("Set-Cookie", "Connection", "Upgrade", "Transfer-Encoding", "X-Request-Id"):
        assert name not in retry.headers
    assert retry.headers["Content-Length"] == str(len(retry.get_data()))
    assert counter.calls == 1


@pytest.mark.parametrize("name", ["Connection", "upgrade", "Transfer-Encoding", "Content-Length"])
def test_connection_and_framing_headers_cannot_be_configured_as_stored(
    store: SQLStore, name: str
) -> None:
    app = flask.Flask("stored-headers")
    app.config["IDEMPOTENCY_STORED_HEADERS"] = ("Location", name)
    with pytest.raises(ConfigurationError, match=name.lower()):
        Idempotency(app, store=store, tenant=lambda: "alpha")


@pytest.mark.parametrize("status", [101, 103])
def test_an_interim_status_is_never_stored(
    app_factory: t.Callable[..., App], store: SQLStore, status: int
) -> None:
    """A 1xx never ends a request: a view answering one is given up as for
    ``IDEMPOTENCY_NEVER_STORE``, never replayed."""
    app, _, counter = app_factory()
    client = app.test_client()
    answers = [
        client.post(f"/status/{status}", headers={"Idempotency-Key": "interim"}) for _ in range(2)
    ]
    assert [answer.status_code for answer in answers] == [status, status]
    assert "Idempotent-Replayed" not in answers[1].headers
    assert counter.calls == 2


def test_a_forged_envelope_with_deeply_nested_headers_is_unreadable(
    app_factory: t.Callable[..., App], store: SQLStore
) -> None:
    app, _, counter = app_factory()
    assert post(app, "tampered-1").status_code == 201
    _tamper(store, "response_headers = NULL, response_body = :body", body=DEEP_ENVELOPE)
    _retry_is_unreadable(app, counter)


#: SQLite only: PostgreSQL's jsonb accepts only JSON (nested less than its stack allows) and
#: timestamptz only timestamps, so these rows cannot exist there.
only_sqlite = pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)


@only_sqlite
@pytest.mark.parametrize(
    "text", ["[" * 100_000 + "]" * 100_000, "not json", '[["Location"'], ids=["deep", "text", "cut"]
)
def test_sqlite_header_text_that_is_no_json_is_unreadable(
    app_factory: t.Callable[..., App], store: SQLStore, text: str
) -> None:
    """SQLite keeps whatever text a statement wrote in the JSON column (PostgreSQL's jsonb
    refuses it, nesting that deep included): reading it must not fail mid-fetch."""
    app, _, counter = app_factory()
    assert post(app, "tampered-1").status_code == 201
    _tamper(store, "response_headers = :headers", headers=text)
    _retry_is_unreadable(app, counter)


#: Timestamp columns the claim's SQL does not compare with the clock.
TIMESTAMPS = ("created_at", "lease_expires_at", "completed_at")


@pytest.mark.parametrize(
    ("column", "value"),
    [
        *((column, value) for column in TIMESTAMPS for value in ("garbage", "", 5)),
        # What sorts before the clock is an expired expires_at (a new record), as in SQL.
        ("expires_at", "garbage"),
    ],
    ids=repr,
)
@pytest.mark.parametrize("state", ["completed", "unknown", "in_progress"])
@only_sqlite
def test_a_sqlite_timestamp_that_is_no_timestamp_is_unreadable(
    app_factory: t.Callable[..., App], store: SQLStore, state: str, column: str, value: t.Any
) -> None:
    """SQLite keeps any value in a timestamp column: the claim that finds the row answers
    503, never 500, and neither replays nor takes over the record."""
    app, _, counter = app_factory()
    assert post(app, "tampered-1").status_code == 201
    _tamper(store, f"state = :state, {column} = :value", state=state, value=value)
    _retry_is_unreadable(app, counter)


@only_sqlite
def test_one_sqlite_row_with_a_broken_timestamp_stops_no_other_tenants_reconciliation(
    app_factory: t.Callable[..., App], store: SQLStore
) -> None:
    """``flask idem reconcile`` reports the damaged row and settles every other record; the
    operator page lists the stuck records."""
    app, idem, _ = app_factory()
    settled: list[str] = []

    def reconcile(record: t.Any) -> t.Any:
        settled.append(record.scope.tenant)
        return Verdict.not_happened()

    idem.reconciler("POST /payments")(reconcile)
    idem.operator_access(lambda: True)
    client = app.test_client()
    for tenant in ("alpha", "beta"):
        headers = {"Idempotency-Key": "tampered-1", "X-Tenant": tenant}
        assert client.post("/payments", json={"amount": 1}, headers=headers).status_code == 201
    with store.engine.begin() as conn:
        conn.execute(sa.text("UPDATE idempotency_keys SET state = 'unknown'"))
        damage = "UPDATE idempotency_keys SET lease_expires_at = 'garbage' WHERE tenant = 'alpha'"
        conn.execute(sa.text(damage))
    assert client.get("/idempotency/operator").status_code == 200
    result = app.test_cli_runner().invoke(args=["idem", "reconcile", "--json"])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.output
    answer = json.loads(result.stdout)
    actions = {r["tenant"]: (r["action"], r["reason"]) for r in answer["records"]}
    assert actions["alpha"][0] == "unknown" and "lease_expires_at" in actions["alpha"][1]
    assert actions["beta"][0] != "unknown"
    assert settled == ["beta"], "the damaged row never reaches the reconciler"
