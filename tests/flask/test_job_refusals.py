"""``idem.refuse()`` in a job raises ``JobRefused``: the run rolls back, its key is given
back and nothing is stored, so the redelivery runs the job.
"""

from __future__ import annotations

import typing as t

import flask
import pytest
import sqlalchemy as sa

from flask_idem import Idempotency, JobRefused, Scope
from flask_idem.store import SQLStore
from tests.support.helpers import Counter, with_tables

ledger = sa.Table(
    "refuse_job_ledger",
    sa.MetaData(),
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("note", sa.String(64)),
)


@pytest.fixture
def app(store: SQLStore) -> t.Iterator[flask.Flask]:
    with with_tables(store, ledger):
        app = flask.Flask("refuse-job")
        app.extensions["test_idem"] = Idempotency(app, store=store)
        yield app


def _rows(store: SQLStore) -> list[str]:
    with store.engine.connect() as conn:
        return list(conn.scalars(sa.select(ledger.c.note)))


def test_a_job_that_refuses_runs_again_on_redelivery(app: flask.Flask, store: SQLStore) -> None:
    idem = t.cast(Idempotency, app.extensions["test_idem"])
    runs = Counter()
    quota = {"left": 0}

    @idem.job("renew", key="order_id", tenant="merchant")
    def renew(merchant: str, order_id: str) -> dict[str, t.Any]:
        runs.bump()
        idem.connection().execute(ledger.insert().values(note="half work"))
        if quota["left"] == 0:
            return idem.refuse({"error": "daily limit, try later"})
        idem.connection().execute(ledger.insert().values(note="renewed"))
        return {"renewed": True}

    with app.app_context():
        with pytest.raises(JobRefused) as refused:
            renew("alpha", "o-1")
        assert refused.value.value == {"error": "daily limit, try later"}
        assert refused.value.retryable, "the queue redelivers it"
        assert _rows(store) == [], "a refusal rolls its business transaction back"
        record = store.get(Scope("alpha", "JOB renew", "o-1"))
        assert record is None, f"the refusal was stored as the job's result: {record}"
        quota["left"] = 1
        assert renew("alpha", "o-1") == {"renewed": True}, "the redelivery runs the job"
    assert runs.calls == 2
