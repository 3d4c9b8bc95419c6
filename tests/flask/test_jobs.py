"""``@idem.job``: the outcome model of a view for worker functions, in-process on both databases.

Redelivered messages replay the stored result, failures after contact never free a key, a
message still running elsewhere raises ``JobInProgress``, reconcilers and ``flask idem stuck``
see job records. Real processes killed mid-job are ``tests/e2e/test_job_processes.py``.
"""

from __future__ import annotations

import threading
import time
import typing as t

import flask
import pytest
import sqlalchemy as sa

from flask_idem import ConfigurationError, Idempotency, Record, Scope, State, Verdict, signals
from flask_idem.core.errors import (
    JobInProgress,
    JobKeyReused,
    JobOutcomePending,
    JobResultNotStored,
)
from flask_idem.core.idempotency_keys import InvalidKey
from flask_idem.store import SQLStore
from tests.flask.test_outcomes import FakeProvider
from tests.support.helpers import Counter, shift, with_tables

ENDPOINT = "JOB charge-order"
orders = sa.Table(
    "job_orders",
    sa.MetaData(),
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("order_id", sa.String(64), nullable=False),
)


@pytest.fixture
def app(store: SQLStore) -> t.Iterator[flask.Flask]:
    with with_tables(store, orders):
        app = flask.Flask("jobs")
        app.config.update(IDEMPOTENCY_LEASE=1)
        app.extensions["test_idem"] = Idempotency(app, store=store)
        yield app


def _idem(app: flask.Flask) -> Idempotency:
    return t.cast(Idempotency, app.extensions["test_idem"])


def _rows(store: SQLStore) -> int:
    with store.engine.connect() as conn:
        return int(conn.execute(sa.select(sa.func.count()).select_from(orders)).scalar_one())


def _record(store: SQLStore, key: str = "order-1") -> Record | None:
    return store.get(Scope("alpha", ENDPOINT, key))


def test_a_redelivered_message_gets_the_stored_result(app: flask.Flask, store: SQLStore) -> None:
    idem, runs = _idem(app), Counter()

    @idem.job("charge-order", key="order_id", tenant="merchant")
    def charge_order(merchant: str, order_id: str, amount: int) -> dict[str, t.Any]:
        idem.connection().execute(orders.insert().values(order_id=order_id))
        return {"run": runs.bump(), "amount": amount, "parts": (1, 2)}

    with app.app_context():
        first = charge_order("alpha", "order-1", 4200)
        again = charge_order("alpha", "order-1", amount=4200.0)  # the same arguments
        other_tenant = charge_order("beta", "order-1", 4200)
    assert first == {"run": 1, "amount": 4200, "parts": (1, 2)}
    assert again == {"run": 1, "amount": 4200, "parts": [1, 2]}, "replayed from JSON"
    assert other_tenant["run"] == 2, "tenants never share keys"
    assert runs.calls == 2 and _rows(store) == 2
    record = _record(store)
    assert record is not None and record.state is State.COMPLETED


def test_the_same_key_with_other_arguments_is_refused(app: flask.Flask) -> None:
    idem = _idem(app)

    @idem.job("charge-order", key="order_id", tenant=lambda order_id, amount: "alpha")
    def charge_order(order_id: str, amount: int) -> int:
        return amount

    with app.app_context():
        assert charge_order("order-1", 4200) == 4200
        with pytest.raises(JobKeyReused) as refused:
            charge_order("order-1", 9900)
    assert not refused.value.retryable
    assert "order-1" not in str(refused.value), "messages name the key hash, not the key"


def test_a_failure_before_contact_releases_and_after_contact_is_unknown(
    app: flask.Flask, store: SQLStore
) -> None:
    idem, provider = _idem(app), FakeProvider()
    fail = {"before": True}

    @idem.job("charge-order", key="order_id", tenant="merchant", release_before_contact=True)
    def charge_order(merchant: str, order_id: str) -> int:
        if fail["before"]:
            raise RuntimeError("the order could not be read")
        idem.connection().execute(orders.insert().values(order_id=order_id))
        return provider.charge(idem.downstream_key("charge"))

    with app.app_context():
        with pytest.raises(RuntimeError):
            charge_order("alpha", "order-1")
        assert _record(store) is None, "released: nothing had happened"
        fail["before"] = False
        with pytest.raises(TimeoutError):
            charge_order("alpha", "order-1")  # the provider charged, then its answer was lost
        record = _record(store)
        assert record is not None and record.state is State.UNKNOWN
        with pytest.raises(JobOutcomePending) as pending:
            charge_order("alpha", "order-1")
    assert pending.value.retryable
    assert provider.calls == 1 and _rows(store) == 0, "the business write rolled back"


def test_reexecute_reruns_an_unknown_message_with_the_same_downstream_key(
    app: flask.Flask, store: SQLStore
) -> None:
    idem, provider = _idem(app), FakeProvider()
    keys: list[str] = []

    @idem.job(
        "charge-order", key="order_id", tenant="merchant", recovery="reexecute",
        release_before_contact=True,
    )  # fmt: skip
    def charge_order(merchant: str, order_id: str) -> dict[str, int]:
        keys.append(idem.downstream_key("charge"))
        idem.connection().execute(orders.insert().values(order_id=order_id))
        return {"charge": provider.charge(keys[-1])}

    with app.app_context():
        with pytest.raises(TimeoutError):
            charge_order("alpha", "order-1")
        assert charge_order("alpha", "order-1") == {"charge": 1}
        assert charge_order("alpha", "order-1") == {"charge": 1}
    assert keys[0] == keys[1] and len(keys) == 2
    assert len(provider.charges) == 1 and _rows(store) == 1


@pytest.mark.parametrize("exception", [SystemExit, KeyboardInterrupt])
def test_a_worker_told_to_stop_mid_job_leaves_it_unknown(
    app: flask.Flask, store: SQLStore, exception: type[BaseException]
) -> None:
    idem = _idem(app)

    @idem.job("charge-order", key="order_id", tenant="merchant", release_before_contact=True)
    def charge_order(merchant: str, order_id: str) -> None:
        idem.side_effect()
        raise exception()

    with app.app_context(), pytest.raises(exception):
        charge_order("alpha", "order-1")
    record = _record(store)
    assert record is not None and record.state is State.UNKNOWN


def test_a_message_running_elsewhere_raises_job_in_progress_and_its_lease_is_renewed(
    app: flask.Flask, store: SQLStore
) -> None:
    """Lease 1 s, a job of 1.6 s: the redelivery at 1.3 s still finds a live owner."""
    idem, runs = _idem(app), Counter()
    started = threading.Event()

    @idem.job("charge-order", key="order_id", tenant="merchant", recovery="reexecute")
    def charge_order(merchant: str, order_id: str) -> int:
        started.set()
        time.sleep(1.6)
        return runs.bump()

    def first() -> None:
        with app.app_context():
            charge_order("alpha", "order-1")

    worker = threading.Thread(target=first)
    worker.start()
    assert started.wait(10)
    time.sleep(1.3)
    with app.app_context(), pytest.raises(JobInProgress) as busy:
        charge_order("alpha", "order-1")
    worker.join()
    assert busy.value.retryable and busy.value.retry_after >= 1
    with app.app_context():
        assert charge_order("alpha", "order-1") == 1
    assert runs.calls == 1


def test_a_dead_workers_message_is_taken_over_once_its_lease_ran_out(
    app: flask.Flask, store: SQLStore
) -> None:
    idem, runs = _idem(app), Counter()

    @idem.job("charge-order", key="order_id", tenant="merchant", recovery="reexecute")
    def charge_order(merchant: str, order_id: str) -> int:
        return runs.bump()

    scope = Scope("alpha", ENDPOINT, "order-1")
    with app.app_context():
        charge_order("alpha", "order-1")
    record = _record(store)
    assert record is not None
    # Claimed again with the same arguments by a worker that then died (no renewal).
    store.evict(scope)
    assert store.claim(scope, record.fingerprint, ttl=60, lease=1).claimed
    with app.app_context(), pytest.raises(JobInProgress):
        charge_order("alpha", "order-1")
    shift(store, scope, 2, "lease_expires_at")
    with app.app_context():
        assert charge_order("alpha", "order-1") == 2
    assert runs.calls == 2


def test_a_result_that_is_no_json_is_not_stored_and_never_reruns(app: flask.Flask) -> None:
    idem, runs = _idem(app), Counter()

    @idem.job("charge-order", key="order_id", tenant="merchant")
    def charge_order(merchant: str, order_id: str) -> t.Any:
        runs.bump()
        return object()

    with app.app_context():
        charge_order("alpha", "order-1")
        with pytest.raises(JobResultNotStored):
            charge_order("alpha", "order-1")
    assert runs.calls == 1


def test_a_job_needs_an_app_context_a_tenant_and_a_valid_key(app: flask.Flask) -> None:
    idem = _idem(app)

    @idem.job("charge-order", key="order_id", tenant="merchant")
    def charge_order(merchant: str | None, order_id: str) -> None:
        return None

    with pytest.raises(RuntimeError, match="app context"):
        charge_order("alpha", "order-1")
    with app.app_context():
        with pytest.raises(ConfigurationError, match="no tenant"):
            charge_order(None, "order-1")
        with pytest.raises(InvalidKey):
            charge_order("alpha", "order 1")
        with pytest.raises(ConfigurationError, match="not JSON"):
            idem.job("other", key="order_id", tenant="merchant")(
                lambda merchant, order_id, when: None
            )("alpha", "order-2", object())
    with pytest.raises(ConfigurationError, match="no parameter"):
        idem.job("charge-order", key="missing", tenant="merchant")(charge_order)
    with pytest.raises(ConfigurationError, match="job name"):
        idem.job("charge order", key="order_id", tenant="merchant")


def test_a_job_run_from_a_view_keeps_the_views_claim(app: flask.Flask, store: SQLStore) -> None:
    idem = _idem(app)
    idem.tenant_resolver(lambda: "alpha")

    @idem.job("notify", key="order_id", tenant="merchant")
    def notify(merchant: str, order_id: str) -> str:
        idem.connection().execute(orders.insert().values(order_id=f"notified-{order_id}"))
        return "sent"

    @app.post("/orders")
    @idem.idempotent
    def create_order() -> t.Any:
        # The job first: SQLite has one writer, and the view's transaction would hold it.
        sent = notify("alpha", "order-1")
        idem.connection().execute(orders.insert().values(order_id="order-1"))
        return {"notify": sent, "key": idem.downstream_key("x")}, 201

    client = app.test_client()
    first = client.post("/orders", headers={"Idempotency-Key": "k"})
    assert first.status_code == 201 and first.get_json()["notify"] == "sent"
    assert client.post("/orders", headers={"Idempotency-Key": "k"}).headers["Idempotent-Replayed"]
    assert _rows(store) == 2
    assert store.get(Scope("alpha", "POST /orders", "k")) is not None


def test_signals_stuck_and_reconcilers_see_job_records(app: flask.Flask, store: SQLStore) -> None:
    idem = _idem(app)
    seen: list[tuple[str, str]] = []

    @idem.job("charge-order", key="order_id", tenant="merchant")
    def charge_order(merchant: str, order_id: str) -> dict[str, str]:
        idem.side_effect()
        raise TimeoutError("the provider's answer was lost")

    @idem.reconciler(charge_order)
    def charge_outcome(record: Record) -> Verdict:
        return Verdict.happened({"charge": "ch_1"})

    def listen(sender: flask.Flask, **extra: t.Any) -> None:
        seen.append((extra["endpoint"], extra.get("reason", "")))

    with signals.unknown.connected_to(listen, app), app.app_context():
        with pytest.raises(TimeoutError):
            charge_order("alpha", "order-1")
    assert seen == [(ENDPOINT, "the job raised an exception")]
    runner = app.test_cli_runner()
    stuck = runner.invoke(args=["idem", "stuck"])
    assert ENDPOINT in stuck.output and "1 unknown" in stuck.output
    reconciled = runner.invoke(args=["idem", "reconcile"])
    assert reconciled.exit_code == 0 and "1 completed" in reconciled.output
    with app.app_context():
        assert charge_order("alpha", "order-1") == {"charge": "ch_1"}


@pytest.mark.parametrize("key", [None, ""])
def test_a_message_without_a_key_is_refused_before_any_claim(
    app: flask.Flask, store: SQLStore, key: str | None
) -> None:
    idem = _idem(app)

    @idem.job("charge-order", key="order_id", tenant=lambda order_id: "alpha")
    def charge_order(order_id: str | None) -> int:
        return 1

    with app.app_context(), pytest.raises(ConfigurationError, match="resolved no key"):
        charge_order(key)
    with store.engine.connect() as conn:
        assert conn.exec_driver_sql("SELECT count(*) FROM idempotency_keys").scalar() == 0


def test_a_job_claims_under_its_own_lease_else_the_applications(
    app: flask.Flask, store: SQLStore
) -> None:
    """``lease=`` of a job (else ``IDEMPOTENCY_LEASE``, here 1 s) is what its claim holds."""
    idem, held = _idem(app), []

    @idem.job("charge-order", key="order_id", tenant="merchant", lease=120)
    def charge_order(merchant: str, order_id: str) -> None:
        record = _record(store, order_id)
        assert record is not None
        held.append(record.lease_remaining)

    @idem.job("refund-order", key="order_id", tenant="merchant")
    def refund_order(merchant: str, order_id: str) -> None:
        record = store.get(Scope("alpha", "JOB refund-order", order_id))
        assert record is not None
        held.append(record.lease_remaining)

    with app.app_context():
        charge_order("alpha", "order-1")
        refund_order("alpha", "order-1")
    assert 100 < held[0] <= 120 and 0 < held[1] <= 1, held


def test_a_jobs_takeover_holds_its_own_lease(app: flask.Flask, store: SQLStore) -> None:
    """A redelivery that takes over a job's unknown record (``recovery="reexecute"``) holds
    the job's ``lease=``, as its first claim did, not ``IDEMPOTENCY_LEASE`` (1 s here)."""
    idem, held = _idem(app), []

    @idem.job("charge-order", key="order_id", tenant="merchant", lease=120, recovery="reexecute")
    def charge_order(merchant: str, order_id: str) -> None:
        record = _record(store, order_id)
        assert record is not None
        held.append(record.lease_remaining)
        idem.downstream_key("charge")
        if len(held) == 1:
            raise RuntimeError("the provider timed out after the charge")

    with app.app_context():
        with pytest.raises(RuntimeError):
            charge_order("alpha", "order-1")
        assert _record(store).state is State.UNKNOWN  # type: ignore[union-attr]
        charge_order("alpha", "order-1")  # taken over
    assert len(held) == 2 and all(100 < lease <= 120 for lease in held), held


@pytest.mark.parametrize("release_before_contact", [False, True])
def test_a_job_interrupted_between_its_claim_and_its_run_gives_its_key_up(
    app: flask.Flask, store: SQLStore, release_before_contact: bool
) -> None:
    """An interrupt (SIGINT: KeyboardInterrupt) between the claim and the job's first line
    gives the key up, released when nothing can have happened yet, else ``unknown``: never left
    in progress under a lease the worker's keeper renews for as long as the worker lives,
    which would refuse every redelivery."""
    idem, runs = _idem(app), []

    @idem.job(
        "charge-order",
        key="order_id",
        tenant="merchant",
        release_before_contact=release_before_contact,
    )
    def charge_order(merchant: str, order_id: str) -> None:
        runs.append(order_id)

    def interrupt(_sender: t.Any, **_: t.Any) -> None:
        raise KeyboardInterrupt  # the observers swallow an Exception, not this

    with app.app_context():
        with signals.claimed.connected_to(interrupt), pytest.raises(KeyboardInterrupt):
            charge_order("alpha", "order-1")
        record = _record(store)
        if release_before_contact:
            assert record is None
            charge_order("alpha", "order-1")  # the redelivery runs
            assert runs == ["order-1"]
        else:
            assert record is not None and record.state is State.UNKNOWN
            with pytest.raises(JobOutcomePending):
                charge_order("alpha", "order-1")
            assert runs == []


class _Unencodable(dict):  # type: ignore[type-arg]
    """A job result whose encoding raises what the result snapshot does not catch."""

    def items(self) -> t.Any:
        raise OSError("encoding failed")

    def __iter__(self) -> t.Any:
        raise OSError("encoding failed")


def test_a_job_failing_after_its_end_is_left_to_its_lease(
    app: flask.Flask, store: SQLStore
) -> None:
    """A job that ran to its end and then failed while its result was recorded (the lease
    no longer renewed) keeps the key in progress until that lease runs out: it may have
    done everything, so no redelivery runs it meanwhile (``JobInProgress``)."""
    idem = _idem(app)

    @idem.job("charge-order", key="order_id", tenant="merchant", lease=120)
    def charge_order(merchant: str, order_id: str) -> t.Any:
        return _Unencodable(charged=True)

    with app.app_context():
        with pytest.raises(OSError):
            charge_order("alpha", "order-1")
        record = _record(store)
        assert record is not None and record.state is State.IN_PROGRESS
        with pytest.raises(JobInProgress):
            charge_order("alpha", "order-1")
