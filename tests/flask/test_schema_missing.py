"""A database whose flask_idem schema is missing or older than the code: every store failure
still fails closed, and says how to migrate instead of looking like an outage."""

from __future__ import annotations

import logging
import typing as t

import flask
import pytest
import sqlalchemy as sa

from flask_idem import Idempotency, SchemaMissing, Scope, StoreUnavailable, create_store
from flask_idem.ops.migrate import upgrade
from flask_idem.store import SQLStore

FP = b"\x01" * 32
SCOPE = Scope("alpha", "POST /payments", "schema-secret-key")
HINTS = ("flask idem db upgrade", "flask db upgrade heads")


@pytest.fixture
def blank_store(unmigrated_url: str) -> t.Iterator[SQLStore]:
    store = create_store(unmigrated_url)
    yield store
    store.engine.dispose()


def _missing(call: t.Callable[[], object]) -> SchemaMissing:
    with pytest.raises(SchemaMissing) as raised:
        call()
    return raised.value


def test_an_unmigrated_database_fails_closed_saying_how_to_migrate(
    blank_store: SQLStore, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.ERROR, logger="flask_idem"):
        missing = _missing(lambda: blank_store.claim(SCOPE, FP, ttl=60, lease=30))
    assert isinstance(missing, StoreUnavailable), "callers fail closed on it as before"
    # PostgreSQL misses the claim function, SQLite the table: the database's words.
    assert "idempotency_" in missing.reason
    for hint in HINTS:
        assert hint in str(missing) and hint in caplog.text
        assert missing.detail is not None and hint in missing.detail
    assert SCOPE.key not in caplog.text and SCOPE.key not in str(missing)
    for call in (
        lambda: blank_store.get(SCOPE),
        lambda: blank_store.find("alpha", SCOPE.key),
        lambda: blank_store.stuck(),
    ):
        assert "idempotency_keys" in _missing(call).reason


def test_a_schema_older_than_the_code_says_how_to_migrate(unmigrated_url: str) -> None:
    upgrade(unmigrated_url, "0004")  # before the audit trail (0005) and the reserving claim (0007)
    store = create_store(unmigrated_url)
    try:
        store.use_audit(True)
        audited = _missing(lambda: store.claim(SCOPE, FP, ttl=60, lease=30))
        assert "idempotency_audit" in audited.reason
        if store.dialect == "postgresql":
            connection = store.begin()
            try:
                atomic = _missing(lambda: store.claim_atomic(connection, SCOPE, FP, ttl=60))
            finally:
                connection.close()
            assert "idempotency_claim_reserve" in atomic.reason
    finally:
        store.engine.dispose()


def test_a_missing_column_says_how_to_migrate(unmigrated_url: str) -> None:
    upgrade(unmigrated_url)
    store = create_store(unmigrated_url)
    try:
        with store.engine.begin() as conn:
            conn.execute(sa.text("ALTER TABLE idempotency_keys DROP COLUMN completed_at"))
        assert "completed_at" in _missing(lambda: store.get(SCOPE)).reason
    finally:
        store.engine.dispose()


def test_a_protected_request_answers_503_and_the_log_says_how_to_migrate(
    blank_store: SQLStore, caplog: pytest.LogCaptureFixture
) -> None:
    app = flask.Flask("unmigrated")
    idem = Idempotency(app, store=blank_store, tenant=lambda: "alpha")
    calls: list[int] = []

    @app.post("/payments")
    @idem.idempotent
    def pay() -> tuple[str, int]:
        calls.append(1)
        return "paid", 201

    with caplog.at_level(logging.ERROR, logger="flask_idem"):
        response = app.test_client().post("/payments", headers={"Idempotency-Key": SCOPE.key})
    assert response.status_code == 503 and calls == [], "fail closed: the view never ran"
    assert response.json is not None and response.json["type"].endswith("/store-unavailable")
    for hint in HINTS:
        assert hint in caplog.text and hint in response.json["detail"]
