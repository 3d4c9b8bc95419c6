"""OpenTelemetry (the ``opentelemetry`` extra): one span per protected request or job attempt,
and the counters of :mod:`flask_idem.ops.metrics` through the OpenTelemetry metrics API.

``IDEMPOTENCY_OPENTELEMETRY = True`` uses the global tracer and meter providers (set by the
application, or by ``opentelemetry-instrument``); ``Idempotency(telemetry=Telemetry(...))``
names providers of its own. Without either, this module is never imported and an attempt
costs one attribute test.

The span ``idempotency <endpoint>`` is a child of the current span (Flask's instrumentation,
a Celery task's) and holds one child span per phase, each current while it runs, so the
view's own spans (SQL, HTTP calls) nest in ``idempotency.view``:

``idempotency.claim``     from the start of the claim to its decision;
``idempotency.view``      the view (``idempotency.job`` for a job) that holds the key;
``idempotency.complete``  storing the result, or giving the key up.

Every transition is an event of the attempt's span. Its attributes are
``idempotency.endpoint``, ``idempotency.tenant``, ``idempotency.key_hash`` (as in the logs and
``flask idem``), and at its end ``idempotency.outcome`` (the outcome the request counts in
``idempotency_requests_total``), ``idempotency.replayed``, ``idempotency.status`` (when
known) and ``idempotency.state``; never the raw key, a body, or an exception's message
(it may quote the request): an exception in the view is recorded by its type only.
"""

from __future__ import annotations

import typing as t

from blinker import NamedSignal
from flask import Flask

from ..attempt import Attempt
from ..core import __version__, signals
from ..core.config import EXTENSION_NAME, Settings
from ..core.errors import ConfigurationError
from ..core.idempotency_keys import key_hash
from ..core.options import JobOptions
from ..core.scopes import split
from . import counting
from .counting import AT_CLAIM, CLAIM_BUCKETS, DESCRIPTIONS, VIEW_BUCKETS, Recorder

try:
    from opentelemetry import context, metrics, trace
except ImportError as exc:  # pragma: no cover - the extra is missing
    raise ConfigurationError(
        "IDEMPOTENCY_OPENTELEMETRY needs opentelemetry-api: pip install 'flask-idem[opentelemetry]'"
    ) from exc

#: The instrumentation scope of flask_idem's spans and instruments.
SCOPE = "flask_idem"
#: Event fields that become attributes of the transition's span event (all from a fixed
#: vocabulary: never a key, a body or a message).
_EVENT_FIELDS = ("state", "status", "reason", "stage", "actor", "action", "stored")


class Telemetry(Recorder):
    """A tracer and the counters flask_idem feeds, from the given or the global providers.

    :param tracer_provider: where spans go (the global one by default).
    :param meter_provider: where the counters go (the global one by default).
    :param tenant_label: add a ``tenant`` attribute to the counters.
    """

    def __init__(
        self,
        *,
        tracer_provider: trace.TracerProvider | None = None,
        meter_provider: metrics.MeterProvider | None = None,
        tenant_label: bool = False,
    ) -> None:
        super().__init__(tenant_label=tenant_label)
        self.tracer = trace.get_tracer(SCOPE, __version__, tracer_provider=tracer_provider)
        meter = metrics.get_meter(SCOPE, __version__, meter_provider=meter_provider)
        self.requests = meter.create_counter(
            "idempotency.requests", "{request}", DESCRIPTIONS["requests"]
        )
        self.claims = meter.create_counter("idempotency.claims", "{claim}", DESCRIPTIONS["claims"])
        self.settled = meter.create_counter(
            "idempotency.settled", "{record}", DESCRIPTIONS["settled"]
        )
        self.claim_duration = meter.create_histogram(
            "idempotency.claim.duration",
            "s",
            DESCRIPTIONS["claim_duration"],
            explicit_bucket_boundaries_advisory=CLAIM_BUCKETS,
        )
        self.view_duration = meter.create_histogram(
            "idempotency.view.duration",
            "s",
            DESCRIPTIONS["view_duration"],
            explicit_bucket_boundaries_advisory=VIEW_BUCKETS,
        )

    # -- the counters (the Prometheus labels, as attributes) ----------------------------

    def add_request(
        self, endpoint: str, outcome: str, status: int | None, tenant: str | None
    ) -> None:
        attributes: dict[str, str | int] = {"endpoint": endpoint, "outcome": outcome}
        if status is not None:
            attributes["status"] = status
        self.requests.add(1, _with_tenant(attributes, tenant))

    def add_claim(self, endpoint: str, kind: str, tenant: str | None) -> None:
        self.claims.add(1, _with_tenant({"endpoint": endpoint, "kind": kind}, tenant))

    def add_settled(self, endpoint: str, actor: str, action: str) -> None:
        self.settled.add(1, {"endpoint": endpoint, "actor": actor, "action": action})

    def observe_claim(self, endpoint: str, outcome: str, seconds: float) -> None:
        self.claim_duration.record(seconds, {"endpoint": endpoint, "outcome": outcome})

    def observe_view(self, endpoint: str, outcome: str, seconds: float) -> None:
        self.view_duration.record(seconds, {"endpoint": endpoint, "outcome": outcome})

    # -- the spans ------------------------------------------------------------------------

    def begin(self, state: Attempt) -> AttemptSpan:
        """The trace of a claimed attempt (``AppState.tracer``)."""
        return AttemptSpan(self.tracer, state)

    def receive(self, signal: NamedSignal, **event: t.Any) -> None:
        """Count one transition, and add it to the span of the attempt it belongs to."""
        super().receive(signal, **event)
        current = Attempt.current()
        span = None if current is None else current.trace
        if isinstance(span, AttemptSpan) and span.follows(event):
            span.transition(signal, event)


def _with_tenant(attributes: dict[str, str | int], tenant: str | None) -> dict[str, str | int]:
    if tenant is not None:
        attributes["tenant"] = tenant
    return attributes


class AttemptSpan:
    """The span of one attempt and the span of its current phase (see the module)."""

    def __init__(self, tracer: trace.Tracer, state: Attempt) -> None:
        assert state.scope is not None
        self._tracer = tracer
        self.scope = state.scope
        self.key_hash = key_hash(state.scope)
        self._runs = "job" if isinstance(state.options, JobOptions) else "view"
        # Never the principal (a span name per user): it is the key's, as the key is.
        self.endpoint = state.endpoint or split(state.scope.endpoint)[1]
        self.span = tracer.start_span(
            f"idempotency {self.endpoint}",
            attributes={
                "idempotency.endpoint": self.endpoint,
                "idempotency.tenant": state.scope.tenant,
                "idempotency.key_hash": self.key_hash,
            },
        )
        self._outcome: str | None = None
        self._status: int | None = None
        self._state: str | None = None
        self._error: str | None = None
        self._phase: trace.Span | None = None
        self._phase_name = ""
        self._token: object = None
        self._enter("claim")

    def follows(self, event: t.Mapping[str, t.Any]) -> bool:
        """Whether ``event`` is about this attempt's scope."""
        return bool(
            event["key_hash"] == self.key_hash
            and event["endpoint"] == self.endpoint
            and event["tenant"] == self.scope.tenant
        )

    def transition(self, signal: NamedSignal, event: t.Mapping[str, t.Any]) -> None:
        fields = {f"idempotency.{name}": event.get(name) for name in _EVENT_FIELDS}
        self.span.add_event(
            event["event"], {name: value for name, value in fields.items() if value is not None}
        )
        outcome = counting.outcome_of(signal, event)
        if outcome is not None and self._outcome is None:
            # The answer the client got; a 503 then counts the released or unknown it left,
            # which the span keeps as its state.
            self._outcome, self._status = outcome, event.get("status")
        self._state = event.get("state")
        if signal is signals.claimed or signal is signals.taken_over:
            self._enter(self._runs)
        elif signal in AT_CLAIM:
            self._leave()  # answered from the record: nothing runs

    def completing(self) -> None:
        if self._phase_name == self._runs:
            self._enter("complete")

    def failed(self, error: BaseException) -> None:
        # The type only: a message may quote the request's body.
        self._error = f"{type(error).__module__}.{type(error).__qualname__}"
        for span in (self._phase, self.span):
            if span is not None:
                span.add_event("exception", {"exception.type": self._error})
                span.set_status(trace.Status(trace.StatusCode.ERROR, self._error))

    def end(self) -> None:
        self._leave()
        self.span.set_attribute("idempotency.replayed", self._outcome == "replayed")
        for name, value in (
            ("outcome", self._outcome),
            ("status", self._status),
            ("state", self._state),
        ):
            if value is not None:
                self.span.set_attribute(f"idempotency.{name}", value)
        if self._error is None and (
            self._outcome == "store_unavailable" or (self._status or 0) >= 500
        ):
            self.span.set_status(trace.Status(trace.StatusCode.ERROR, self._outcome or ""))
        self.span.end()

    def _enter(self, phase: str) -> None:
        """Start ``phase`` as the current span (its parent: the attempt's span)."""
        self._leave()
        self._phase_name = phase
        self._phase = self._tracer.start_span(
            f"idempotency.{phase}", context=trace.set_span_in_context(self.span)
        )
        self._token = context.attach(trace.set_span_in_context(self._phase))

    def _leave(self) -> None:
        phase, self._phase = self._phase, None
        if phase is not None:
            context.detach(t.cast(t.Any, self._token))
            phase.end()  # last: a span processor that raises leaves nothing half-done


_default = counting.PerProcess(
    lambda label: Telemetry(tenant_label=label), "Idempotency(telemetry=Telemetry(...))"
)


def default_telemetry(tenant_label: bool) -> Telemetry:
    """The instruments on the global providers, made once per process (a second set would
    be a duplicate instrument)."""
    return _default.get(tenant_label)


def install(app: Flask, telemetry: Telemetry | None, settings: Settings) -> None:
    """Trace every attempt of ``app`` and subscribe ``telemetry`` (or the default one) to its
    transition signals."""
    chosen = telemetry or default_telemetry(settings.metrics_tenant_label)
    counting.subscribe(app, chosen.receive)
    app.extensions[EXTENSION_NAME].tracer = chosen.begin
    app.extensions["idempotency.telemetry"] = chosen
