"""OpenTelemetry: one span per protected request or job attempt, with its claim, view and
completion inside, the outcome on it and never the raw key; the counters of the Prometheus
metrics through the OpenTelemetry metrics API. Read back with the SDK's in-memory exporters,
on both databases."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import typing as t

import flask
import pytest
import sqlalchemy as sa
from opentelemetry import trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from flask_idem import Idempotency, Scope
from flask_idem.core.idempotency_keys import key_hash
from flask_idem.ops.migrate import upgrade
from flask_idem.ops.otel import Telemetry
from flask_idem.store import SQLStore, create_store
from tests.support.answers import post

SECRET = "otel-secret-key-4f8c2a1e"
BODY_SECRET = "card-4242-body-secret"
#: The body every request here sends (plus what a test adds): a secret that must stay out of spans.
CARD: t.Final = {"card": BODY_SECRET}


class Recorded:
    """A tracer and a meter provider whose spans and points the test reads back."""

    def __init__(self) -> None:
        self.exporter = InMemorySpanExporter()
        self.tracer_provider = TracerProvider()
        self.tracer_provider.add_span_processor(SimpleSpanProcessor(self.exporter))
        self.reader = InMemoryMetricReader()
        self.meter_provider = MeterProvider(metric_readers=[self.reader])
        self.telemetry = Telemetry(
            tracer_provider=self.tracer_provider, meter_provider=self.meter_provider
        )

    def spans(self) -> list[ReadableSpan]:
        return list(self.exporter.get_finished_spans())

    def attempts(self) -> list[ReadableSpan]:
        return [span for span in self.spans() if span.name.startswith("idempotency ")]

    def children(self, parent: ReadableSpan) -> list[str]:
        assert parent.context is not None
        return [
            span.name
            for span in sorted(self.spans(), key=lambda span: span.start_time or 0)
            if span.parent is not None and span.parent.span_id == parent.context.span_id
        ]

    def points(self, name: str) -> dict[tuple[tuple[str, t.Any], ...], t.Any]:
        data = self.reader.get_metrics_data()
        assert data is not None
        return {
            tuple(sorted(point.attributes.items())): point
            for resource in data.resource_metrics
            for scoped in resource.scope_metrics
            for metric in scoped.metrics
            if metric.name == name
            for point in metric.data.data_points
        }

    def assert_no_secret(self) -> None:
        """Neither the key nor the body in flask_idem's spans (the test's own span around
        the provider call records its exception as the SDK does, message included)."""
        ours = [span for span in self.spans() if span.instrumentation_scope.name == "flask_idem"]
        assert ours
        everything = repr(
            [
                (
                    span.name,
                    dict(span.attributes or {}),
                    [dict(e.attributes or {}) for e in span.events],
                )
                for span in ours
            ]
        ) + repr(self.reader.get_metrics_data())
        assert SECRET not in everything and BODY_SECRET not in everything


@pytest.fixture
def recorded() -> t.Iterator[Recorded]:
    recorded = Recorded()
    yield recorded
    recorded.tracer_provider.shutdown()
    recorded.meter_provider.shutdown()


def _app(store: SQLStore, recorded: Recorded) -> tuple[flask.Flask, Idempotency]:
    app = flask.Flask("otel-test")
    app.config.update(TESTING=True, PROPAGATE_EXCEPTIONS=False)
    idem = Idempotency(
        app,
        store=store,
        tenant=lambda: flask.request.headers.get("X-Tenant", "alpha"),
        telemetry=recorded.telemetry,
    )
    inside = trace.get_tracer("the-view", tracer_provider=recorded.tracer_provider)

    @app.post("/pay")
    @idem.idempotent(release_before_contact=True)
    def pay() -> t.Any:
        body = flask.request.get_json()
        with inside.start_as_current_span("provider call"):
            if body.get("crash"):
                raise ValueError(f"refused {BODY_SECRET}")
        return {"ok": True}, 201

    return app, idem


def _attrs(span: ReadableSpan) -> dict[str, t.Any]:
    return dict(span.attributes or {})


def test_a_new_key_and_its_replay_are_spans_with_claim_view_and_completion(
    store: SQLStore, recorded: Recorded
) -> None:
    app, _ = _app(store, recorded)
    client = app.test_client()
    outer = trace.get_tracer("flask", tracer_provider=recorded.tracer_provider)
    with outer.start_as_current_span("POST /pay") as http_span:  # as Flask's instrumentation
        assert post(client, SECRET, CARD, path="/pay").status_code == 201
    assert post(client, SECRET, CARD, path="/pay").status_code == 201
    first, replay = recorded.attempts()
    assert first.name == "idempotency POST /pay"
    assert first.parent is not None and first.parent.span_id == http_span.get_span_context().span_id
    assert recorded.children(first) == [
        "idempotency.claim",
        "idempotency.view",
        "idempotency.complete",
    ]
    (view,) = [span for span in recorded.spans() if span.name == "idempotency.view"]
    (call,) = [span for span in recorded.spans() if span.name == "provider call"]
    assert call.parent is not None and view.context is not None
    assert call.parent.span_id == view.context.span_id, "the view's own spans nest in it"
    expected_hash = key_hash(Scope("alpha", "POST /pay", SECRET))
    assert _attrs(first) == {
        "idempotency.endpoint": "POST /pay",
        "idempotency.tenant": "alpha",
        "idempotency.key_hash": expected_hash,
        "idempotency.outcome": "executed",
        "idempotency.replayed": False,
        "idempotency.status": 201,
        "idempotency.state": "completed",
    }
    assert [event.name for event in first.events] == ["claimed", "completed"]
    assert recorded.children(replay) == ["idempotency.claim"]
    assert _attrs(replay)["idempotency.outcome"] == "replayed"
    assert _attrs(replay)["idempotency.replayed"] is True
    assert _attrs(replay)["idempotency.status"] == 201
    assert first.status.status_code is trace.StatusCode.UNSET
    recorded.assert_no_secret()


def test_mismatch_crash_and_the_counters(store: SQLStore, recorded: Recorded) -> None:
    app, _ = _app(store, recorded)
    client = app.test_client()
    assert post(client, SECRET, CARD, path="/pay").status_code == 201
    assert post(client, SECRET, {**CARD, "amount": 1}, path="/pay").status_code == 422
    assert post(client, "crash-key", {**CARD, "crash": True}, path="/pay").status_code == 500
    _, mismatch, crash = recorded.attempts()
    assert _attrs(mismatch)["idempotency.outcome"] == "mismatch"
    assert _attrs(mismatch)["idempotency.status"] == 422
    assert recorded.children(mismatch) == ["idempotency.claim"]
    assert _attrs(crash)["idempotency.outcome"] == "released"
    assert crash.status.status_code is trace.StatusCode.ERROR
    assert crash.status.description == "builtins.ValueError"
    (exception,) = [event for event in crash.events if event.name == "exception"]
    assert dict(exception.attributes or {}) == {"exception.type": "builtins.ValueError"}
    assert recorded.children(crash) == [
        "idempotency.claim",
        "idempotency.view",
        "idempotency.complete",
    ]
    requests = recorded.points("idempotency.requests")
    assert {key: point.value for key, point in requests.items()} == {
        (("endpoint", "POST /pay"), ("outcome", "executed"), ("status", 201)): 1,
        (("endpoint", "POST /pay"), ("outcome", "mismatch"), ("status", 422)): 1,
        (("endpoint", "POST /pay"), ("outcome", "released")): 1,
    }
    claims = recorded.points("idempotency.claims")
    assert {key: point.value for key, point in claims.items()} == {
        (("endpoint", "POST /pay"), ("kind", "claimed")): 2
    }
    views = recorded.points("idempotency.view.duration")
    assert sum(point.count for point in views.values()) == 2
    claim_durations = recorded.points("idempotency.claim.duration")
    assert sum(point.count for point in claim_durations.values()) == 3
    recorded.assert_no_secret()


def test_a_concurrent_duplicate_is_a_409_span(store: SQLStore, recorded: Recorded) -> None:
    """A real second thread holds the key while the duplicate arrives."""
    app, idem = _app(store, recorded)
    entered, release = threading.Event(), threading.Event()

    @app.post("/slow")
    @idem.idempotent
    def slow() -> t.Any:
        entered.set()
        release.wait(10)
        return {"ok": True}, 201

    statuses: list[int] = []

    def first() -> None:
        answer = app.test_client().post("/slow", headers={"Idempotency-Key": SECRET})
        statuses.append(answer.status_code)

    worker = threading.Thread(target=first)
    worker.start()
    try:
        assert entered.wait(10)
        duplicate = app.test_client().post("/slow", headers={"Idempotency-Key": SECRET})
        assert duplicate.status_code == 409
    finally:
        release.set()
        worker.join(10)
    assert statuses == [201]
    by_outcome = {_attrs(span)["idempotency.outcome"]: span for span in recorded.attempts()}
    assert set(by_outcome) == {"executed", "in_progress"}
    assert _attrs(by_outcome["in_progress"])["idempotency.status"] == 409
    assert by_outcome["in_progress"].status.status_code is trace.StatusCode.UNSET
    recorded.assert_no_secret()


def test_a_store_that_cannot_be_reached_is_a_503_span_and_the_view_never_runs(
    pg_url: str, recorded: Recorded
) -> None:
    """The suite's PostgreSQL URL on a port nobody listens on: fail closed, traced."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        free_port = probe.getsockname()[1]
    down = sa.make_url(pg_url).set(host="127.0.0.1", port=free_port)
    store = create_store(down.render_as_string(hide_password=False))
    try:
        app, idem = _app(store, recorded)
        ran: list[int] = []

        @app.post("/charge")
        @idem.idempotent
        def charge() -> t.Any:
            ran.append(1)
            return {"ok": True}, 201

        answer = app.test_client().post("/charge", headers={"Idempotency-Key": SECRET})
    finally:
        store.engine.dispose()
    assert answer.status_code == 503 and ran == []
    (span,) = recorded.attempts()
    assert _attrs(span)["idempotency.outcome"] == "store_unavailable"
    assert _attrs(span)["idempotency.status"] == 503
    assert span.status.status_code is trace.StatusCode.ERROR
    assert recorded.children(span) == ["idempotency.claim"]
    unavailable = recorded.points("idempotency.requests")
    assert [point.value for point in unavailable.values()] == [1]
    recorded.assert_no_secret()


def test_a_job_attempt_is_a_span_and_its_redelivery_a_replay(
    store: SQLStore, recorded: Recorded
) -> None:
    app, idem = _app(store, recorded)

    @idem.job("charge-order", key="order_id", tenant=lambda order_id: "alpha")
    def charge_order(order_id: str) -> dict[str, str]:
        return {"charged": order_id}

    with app.app_context():
        assert charge_order(SECRET) == {"charged": SECRET}
        assert charge_order(SECRET) == {"charged": SECRET}
    run, redelivery = recorded.attempts()
    assert run.name == "idempotency JOB charge-order"
    assert recorded.children(run) == [
        "idempotency.claim",
        "idempotency.job",
        "idempotency.complete",
    ]
    assert _attrs(run)["idempotency.outcome"] == "executed"
    assert _attrs(redelivery)["idempotency.outcome"] == "replayed"
    assert _attrs(run)["idempotency.key_hash"] == key_hash(
        Scope("alpha", "JOB charge-order", SECRET)
    )
    spans = repr([dict(span.attributes or {}) for span in recorded.spans()])
    assert SECRET not in spans


def test_off_nothing_of_opentelemetry_is_imported_or_traced(tmp_path: t.Any) -> None:
    """Without the option, a protected request imports nothing of OpenTelemetry and its
    state carries no trace; with it, the same request is traced (global providers)."""
    url = f"sqlite:///{tmp_path}/off.sqlite3"
    upgrade(url)
    program = f"""
import json, sys
import flask
from flask_idem import Idempotency
from flask_idem.state import AppState

def build(name, **config):
    app = flask.Flask(name)
    app.config.update(IDEMPOTENCY_DATABASE_URL={url!r}, **config)
    idem = Idempotency(app, tenant=lambda: "alpha")

    @app.post("/pay")
    @idem.idempotent
    def pay():
        return "ok", 201

    return app

off = build("off")
status = off.test_client().post("/pay", headers={{"Idempotency-Key": "k"}}).status_code
with off.app_context():
    tracer = AppState.current().tracer
imported = sorted(name for name in sys.modules if name.startswith("opentelemetry"))
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
exporter = InMemorySpanExporter()
provider = TracerProvider()
provider.add_span_processor(SimpleSpanProcessor(exporter))
trace.set_tracer_provider(provider)
on = build("on", IDEMPOTENCY_OPENTELEMETRY=True)
on.test_client().post("/pay", headers={{"Idempotency-Key": "k2"}})
print(json.dumps([status, tracer is None, imported,
                  [span.name for span in exporter.get_finished_spans()]]))
"""
    output = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, check=True
    ).stdout
    status, no_tracer, imported, traced = json.loads(output)
    assert status == 201 and no_tracer and imported == []
    assert "idempotency POST /pay" in traced


def test_tenant_attributes_on_the_counters_only_when_asked(store: SQLStore) -> None:
    counted: dict[bool, list[dict[str, t.Any]]] = {}
    for tenant_label in (False, True):
        recorded = Recorded()
        recorded.telemetry = Telemetry(
            tracer_provider=recorded.tracer_provider,
            meter_provider=recorded.meter_provider,
            tenant_label=tenant_label,
        )
        app, _ = _app(store, recorded)
        app.test_client().post(
            "/pay", json={}, headers={"Idempotency-Key": f"k{tenant_label}", "X-Tenant": "beta"}
        )
        counted[tenant_label] = [dict(key) for key in recorded.points("idempotency.requests")]
        recorded.tracer_provider.shutdown()
        recorded.meter_provider.shutdown()
    assert counted[False] == [{"endpoint": "POST /pay", "outcome": "executed", "status": 201}]
    assert counted[True] == [
        {"endpoint": "POST /pay", "outcome": "executed", "status": 201, "tenant": "beta"}
    ]
