"""A job's result is stored only when JSON gives it back as it was returned (tuples come back
as lists): a result too deeply nested to encode, or a mapping whose keys JSON would turn into
strings, completes ``unstored``; the job's effect never runs a second time."""

from __future__ import annotations

import typing as t

import flask
import pytest
import sqlalchemy as sa

from flask_idem import Idempotency, Scope, State
from flask_idem.core.errors import JobResultNotStored, JobResultUnreadable
from flask_idem.core.key_digest import unkeyed
from flask_idem.store import SQLStore
from tests.support.helpers import Counter

ENDPOINT = "JOB settle-order"


def _nested(depth: int) -> list[t.Any]:
    value: list[t.Any] = []
    for _ in range(depth):
        value = [value]
    return value


@pytest.fixture
def app(store: SQLStore) -> flask.Flask:
    app = flask.Flask("job-results")
    app.config.update(IDEMPOTENCY_LEASE=1)
    app.extensions["test_idem"] = Idempotency(app, store=store)
    return app


@pytest.mark.parametrize(
    "result",
    [
        _nested(1_000),
        {1: "a", "1": "b"},
        {1: "a"},
        {"order": {None: "x"}},
        [{"ok": True}, {2.5: "x"}],
        ({True: 1},),
    ],
    ids=["nested-1000", "colliding-keys", "int-key", "none-key", "float-key", "bool-key"],
)
def test_a_result_json_cannot_give_back_is_unstored_and_never_reruns(
    app: flask.Flask, store: SQLStore, result: t.Any
) -> None:
    idem: Idempotency = app.extensions["test_idem"]
    runs = Counter()

    @idem.job("settle-order", key="order_id", tenant="merchant")
    def settle_order(merchant: str, order_id: str) -> t.Any:
        runs.bump()
        return result

    with app.app_context():
        assert settle_order("alpha", "order-1") is result, "the first call gets its value"
        for _ in range(2):
            with pytest.raises(JobResultNotStored):
                settle_order("alpha", "order-1")
    assert runs.calls == 1
    record = store.get(Scope("alpha", ENDPOINT, "order-1"))
    assert record is not None and record.state is State.UNSTORED


def test_a_stored_result_altered_into_deeply_nested_json_is_not_replayed(
    app: flask.Flask, store: SQLStore
) -> None:
    """A row altered in the database to JSON deeper than the decoder's stack raises
    ``JobResultNotStored`` on redelivery, never a ``RecursionError``, and never a second run."""
    idem: Idempotency = app.extensions["test_idem"]
    runs = Counter()

    @idem.job("settle-order", key="order_id", tenant="merchant")
    def settle_order(merchant: str, order_id: str) -> t.Any:
        runs.bump()
        return {"settled": True}

    with app.app_context():
        settle_order("alpha", "order-1")
    with store.engine.begin() as conn:
        conn.execute(
            sa.text("UPDATE idempotency_keys SET response_body = :body WHERE key = :key"),
            {"body": b"[" * 100_000 + b"]" * 100_000, "key": unkeyed("alpha", "order-1")},
        )
    with app.app_context(), pytest.raises(JobResultNotStored):
        settle_order("alpha", "order-1")
    assert runs.calls == 1


@pytest.mark.parametrize("state", ["completed", "unknown", "in_progress"])
@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)  # timestamptz takes only timestamps
def test_a_sqlite_row_whose_timestamp_is_no_timestamp_is_neither_replayed_nor_run_again(
    app: flask.Flask, store: SQLStore, state: str
) -> None:
    """SQLite keeps any text in a timestamp column: a redelivery raises
    ``JobResultUnreadable`` (retryable), never a ``ValueError``, and never runs the job."""
    idem: Idempotency = app.extensions["test_idem"]
    runs = Counter()

    @idem.job("settle-order", key="order_id", tenant="merchant", recovery="reexecute")
    def settle_order(merchant: str, order_id: str) -> t.Any:
        runs.bump()
        return {"settled": True}

    with app.app_context():
        settle_order("alpha", "order-1")
    with store.engine.begin() as conn:
        conn.execute(
            sa.text(
                "UPDATE idempotency_keys SET state = :state, lease_expires_at = 'garbage' "
                "WHERE key = :key"
            ),
            {"state": state, "key": unkeyed("alpha", "order-1")},
        )
    with app.app_context(), pytest.raises(JobResultUnreadable, match="damaged"):
        settle_order("alpha", "order-1")
    assert runs.calls == 1
