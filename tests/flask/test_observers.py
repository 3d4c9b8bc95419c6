"""Observers never change an outcome: a blinker receiver or an OpenTelemetry span processor
that raises leaves a request's stored 201 answered 201 and replayed, and a job completed with
its lease released (never renewed for as long as the worker lives), on both databases. The
failure is logged once, by the exception's class, never with the key or the body."""

from __future__ import annotations

import functools
import logging
import typing as t

import flask
import pytest
from blinker import NamedSignal
from opentelemetry.context import Context
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor, TracerProvider

from flask_idem import Idempotency, JobOutcomePending, Scope, State, signals
from flask_idem.ops.otel import Telemetry
from flask_idem.store import SQLStore
from tests.support.answers import post

SECRET = "observer-secret-key-9d2e"
BODY_SECRET = "card-4242-observer-body"
JOB_SCOPE = Scope("alpha", "JOB charge-order", SECRET)


class Boom(RuntimeError):
    """What the observers raise; its message quotes the key, as a careless one would."""


class FailingProcessor(SpanProcessor):
    """A span processor whose ``hook`` (``on_start`` or ``on_end``) raises for ``span_name``."""

    def __init__(self, hook: str, span_name: str) -> None:
        self.hook, self.span_name = hook, span_name
        self.raised = 0

    def _maybe_raise(self, hook: str, name: str) -> None:
        if hook == self.hook and name.startswith(self.span_name):
            self.raised += 1
            raise Boom(f"processor saw {SECRET}")

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        self._maybe_raise("on_start", span.name)

    def on_end(self, span: ReadableSpan) -> None:
        self._maybe_raise("on_end", span.name)


def _app(store: SQLStore, telemetry: Telemetry | None = None) -> tuple[flask.Flask, Idempotency]:
    app = flask.Flask("observers-test")
    app.config.update(TESTING=True, PROPAGATE_EXCEPTIONS=False)
    idem = Idempotency(app, store=store, tenant=lambda: "alpha", telemetry=telemetry)
    app.config["runs"] = []

    @app.post("/pay")
    @idem.idempotent(release_before_contact=True)
    def pay() -> t.Any:
        app.config["runs"].append(flask.request.get_json()["card"])
        return {"ok": True}, 201

    return app, idem


def _telemetry(processor: FailingProcessor) -> Telemetry:
    provider = TracerProvider()
    provider.add_span_processor(processor)
    return Telemetry(tracer_provider=provider)


_post = functools.partial(post, key=SECRET, body={"card": BODY_SECRET}, path="/pay")


def _assert_request_stored_and_replayed(app: flask.Flask) -> None:
    client = app.test_client()
    first = _post(client)
    assert first.status_code == 201, first.get_data(as_text=True)
    replay = _post(client)
    assert replay.status_code == 201 and replay.headers.get("Idempotent-Replayed") == "true"
    assert app.config["runs"] == [BODY_SECRET], "the view ran once"


def _job(app: flask.Flask, idem: Idempotency) -> t.Callable[[str], dict[str, str]]:
    @idem.job("charge-order", key="order_id", tenant=lambda order_id: "alpha", lease=1)
    def charge_order(order_id: str) -> dict[str, str]:
        app.config["runs"].append(order_id)
        return {"charged": order_id}

    return charge_order


def _assert_job_completed_and_replayed(
    app: flask.Flask, idem: Idempotency, store: SQLStore
) -> None:
    charge_order = _job(app, idem)
    with app.app_context():
        assert charge_order(SECRET) == {"charged": SECRET}
        record = store.get(JOB_SCOPE)
        assert record is not None and record.state is State.COMPLETED, "never a zombie lease"
        assert charge_order(SECRET) == {"charged": SECRET}, "the redelivery replays"
    assert app.config["runs"] == [SECRET], "the job ran once"


@pytest.fixture
def raising_receiver(request: pytest.FixtureRequest) -> t.Iterator[NamedSignal]:
    """A receiver of ``request.param`` (a signal) that raises."""
    signal: NamedSignal = request.param

    def boom(sender: flask.Flask, **event: t.Any) -> None:
        raise Boom(f"receiver saw {SECRET}")

    signal.connect(boom)
    yield signal
    signal.disconnect(boom)


SIGNALS = [signals.claimed, signals.completed]


@pytest.mark.parametrize("raising_receiver", SIGNALS, indirect=True, ids=lambda s: s.name)
def test_a_raising_receiver_leaves_the_stored_201_answered_and_replayed(
    store: SQLStore, raising_receiver: NamedSignal
) -> None:
    app, _ = _app(store)
    _assert_request_stored_and_replayed(app)


@pytest.mark.parametrize("raising_receiver", SIGNALS, indirect=True, ids=lambda s: s.name)
def test_a_raising_receiver_leaves_the_job_completed_and_its_lease_released(
    store: SQLStore, raising_receiver: NamedSignal
) -> None:
    app, idem = _app(store)
    _assert_job_completed_and_replayed(app, idem, store)


PROCESSOR_FAILURES = [
    ("on_start", "idempotency "),  # the attempt's span: no trace at all
    ("on_start", "idempotency.view"),
    ("on_start", "idempotency.complete"),
    ("on_end", "idempotency.view"),
    ("on_end", "idempotency.complete"),
    ("on_end", "idempotency "),
]
JOB_PROCESSOR_FAILURES = [
    (hook, "idempotency.job" if name == "idempotency.view" else name)
    for hook, name in PROCESSOR_FAILURES
]


@pytest.mark.parametrize(("hook", "span_name"), PROCESSOR_FAILURES)
def test_a_raising_span_processor_leaves_the_stored_201_answered_and_replayed(
    store: SQLStore, hook: str, span_name: str
) -> None:
    processor = FailingProcessor(hook, span_name)
    app, _ = _app(store, _telemetry(processor))
    _assert_request_stored_and_replayed(app)
    assert processor.raised, "the processor did raise"


@pytest.mark.parametrize(("hook", "span_name"), JOB_PROCESSOR_FAILURES)
def test_a_raising_span_processor_leaves_the_job_completed_and_its_lease_released(
    store: SQLStore, hook: str, span_name: str
) -> None:
    processor = FailingProcessor(hook, span_name)
    app, idem = _app(store, _telemetry(processor))
    _assert_job_completed_and_replayed(app, idem, store)
    assert processor.raised, "the processor did raise"


def test_a_raising_receiver_is_logged_once_by_its_class_never_with_the_key(
    store: SQLStore, caplog: pytest.LogCaptureFixture
) -> None:
    app, _ = _app(store)

    def failing_audit_receiver(sender: flask.Flask, **event: t.Any) -> None:
        raise Boom(f"receiver saw {SECRET} {BODY_SECRET}")

    # Logged once per process: a receiver of its own per database.
    failing_audit_receiver.__qualname__ += f"_{store.engine.dialect.name}"
    signals.replayed.connect(failing_audit_receiver)
    try:
        with caplog.at_level(logging.ERROR, logger="flask_idem.observers"):
            client = app.test_client()
            assert [_post(client).status_code for _ in range(3)] == [201, 201, 201]
    finally:
        signals.replayed.disconnect(failing_audit_receiver)
    (logged,) = [r for r in caplog.records if r.name == "flask_idem.observers"]
    assert "failing_audit_receiver" in logged.getMessage()
    assert "test_observers.Boom" in logged.getMessage()
    assert SECRET not in caplog.text and BODY_SECRET not in caplog.text
    assert logged.exc_info is None, "no traceback: its frames may hold the key"


def test_a_worker_stopped_during_the_claimed_signal_gives_the_jobs_key_up(
    store: SQLStore,
) -> None:
    """``SystemExit`` (a worker told to stop) is no observer failure and ends the job, between
    its claim and its run: the key is given up (``unknown``, as for any job that raised after
    its claim without ``release_before_contact``) and its lease no longer renewed, so a
    redelivery gets ``JobOutcomePending`` for a reconciler, never ``JobInProgress`` for as
    long as the worker process lives."""
    app, idem = _app(store)
    charge_order = _job(app, idem)

    def stop_the_worker(sender: flask.Flask, **event: t.Any) -> None:
        raise SystemExit(1)

    signals.claimed.connect(stop_the_worker)
    try:
        with app.app_context(), pytest.raises(SystemExit):
            charge_order(SECRET)
    finally:
        signals.claimed.disconnect(stop_the_worker)
    record = store.get(JOB_SCOPE)
    assert record is not None and record.state is State.UNKNOWN, "never a zombie lease"
    with app.app_context(), pytest.raises(JobOutcomePending):
        charge_order(SECRET)
    assert app.config["runs"] == []
