"""A COMMIT that outlives the client-side deadline: the answer and the log both say the result
may or may not be recorded, and the retry finds out which, once.

PostgreSQL's ``statement_timeout`` does not bound deferred trigger work at COMMIT, so only the
client-side deadline (:mod:`flask_idem.store.engines`) ends the wait; the server may still
commit afterwards. The log once said the store failed "before the commit", which tells an
operator the payment was not recorded when it was.
"""

from __future__ import annotations

import logging
import time
import typing as t

import flask
import pytest

from flask_idem import Idempotency
from flask_idem.store import SQLStore, engines

pytestmark = [pytest.mark.postgresql, pytest.mark.slow, pytest.mark.usefixtures("sqlalchemy_path")]

#: The trigger outlasts the client-side deadline by a margin.
COMMIT_SECONDS = engines.STATEMENT_TIMEOUT + engines.DEADLINE_GRACE + 2
SLOW_AMOUNT = 13

SLOW_COMMIT_DDL = f"""
CREATE TABLE deadline_payments (id serial PRIMARY KEY, amount integer NOT NULL);
CREATE FUNCTION deadline_payments_slow() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.amount = {SLOW_AMOUNT} THEN PERFORM pg_sleep({COMMIT_SECONDS}); END IF;
    RETURN NULL;
END $$;
CREATE CONSTRAINT TRIGGER deadline_payments_slow AFTER INSERT ON deadline_payments
    DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION deadline_payments_slow();
"""


@pytest.fixture
def slow_commit_app(pg_store: SQLStore) -> t.Iterator[flask.Flask]:
    with pg_store.engine.begin() as connection:
        connection.exec_driver_sql("DROP TABLE IF EXISTS deadline_payments")
        connection.exec_driver_sql("DROP FUNCTION IF EXISTS deadline_payments_slow()")
        connection.exec_driver_sql(SLOW_COMMIT_DDL)
    app = flask.Flask("slow-commit")
    idem = Idempotency(app, store=pg_store, tenant=lambda: "alpha")

    @app.post("/payments")
    @idem.idempotent
    def pay() -> t.Any:
        amount = flask.request.get_json()["amount"]
        idem.connection().exec_driver_sql(
            f"INSERT INTO deadline_payments (amount) VALUES ({int(amount)})"
        )
        return {"amount": amount}, 201

    yield app
    with pg_store.engine.begin() as connection:
        connection.exec_driver_sql("DROP TABLE deadline_payments")
        connection.exec_driver_sql("DROP FUNCTION deadline_payments_slow()")


def _rows(store: SQLStore) -> int:
    with store.engine.connect() as connection:
        return int(connection.exec_driver_sql("SELECT count(*) FROM deadline_payments").scalar())


def test_a_commit_past_the_deadline_is_reported_as_uncertain(
    slow_commit_app: flask.Flask, pg_store: SQLStore, caplog: pytest.LogCaptureFixture
) -> None:
    client = slow_commit_app.test_client()
    headers = {"Idempotency-Key": "slow-commit-1"}
    with caplog.at_level(logging.INFO, logger="flask_idem"):
        first = client.post("/payments", json={"amount": SLOW_AMOUNT}, headers=headers)
    assert first.status_code == 503, first.get_data(as_text=True)
    assert first.json is not None and "may or may not have been recorded" in first.json["detail"]
    assert "Idempotent-Stored" not in first.headers, "it may be stored: no promise either way"
    logged = " | ".join(record.getMessage() for record in caplog.records)
    assert "before the commit" not in logged, logged
    assert "may or may not be recorded" in logged, logged
    # The server finishes the trigger on its own time; then the retry learns the truth.
    time.sleep(COMMIT_SECONDS - engines.STATEMENT_TIMEOUT - engines.DEADLINE_GRACE + 1)
    retry = client.post("/payments", json={"amount": SLOW_AMOUNT}, headers=headers)
    rows = _rows(pg_store)
    assert rows <= 1, "never two payments for one key"
    if rows == 1:
        assert retry.status_code == 201 and retry.headers["Idempotent-Replayed"] == "true"
    else:
        assert retry.status_code in {201, 409}, retry.get_data(as_text=True)
    assert _rows(pg_store) <= 1


def test_an_ordinary_commit_is_not_held_by_the_trigger(
    slow_commit_app: flask.Flask, pg_store: SQLStore
) -> None:
    """The trigger sleeps for its one amount only: the fixture is not what makes the 503."""
    client = slow_commit_app.test_client()
    reply = client.post("/payments", json={"amount": 1}, headers={"Idempotency-Key": "fast-1"})
    assert reply.status_code == 201
    assert _rows(pg_store) == 1
