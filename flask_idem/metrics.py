"""Prometheus metrics (the ``metrics`` extra): counters and histograms fed by the transition
signals, and gauges read from the table when scraped.

``IDEMPOTENCY_METRICS = True`` (or ``Idempotency(metrics=Metrics(registry=...))``) subscribes
:class:`Metrics` to the signals of :mod:`flask_idem.signals`; nothing in the request flow knows
about Prometheus. Labels are the endpoint as records spell it (``POST /v1/payments``), the
outcome and the status; never the key. ``IDEMPOTENCY_METRICS_TENANT_LABEL = True`` adds a
``tenant`` label to the counters (one series per tenant: only for a handful of tenants).

==========================================  ===================================================
``idempotency_requests_total``              one per protected request or job run that reached
                                            the claim, by ``outcome``: ``executed``,
                                            ``unstored``, ``replayed``, ``in_progress`` (409),
                                            ``outcome_pending`` (409), ``not_stored`` (409),
                                            ``mismatch`` (422), ``released``, ``unknown``,
                                            ``lease_lost`` (409), ``store_unavailable`` (503)
``idempotency_claims_total``                keys taken, by ``kind``: ``claimed``,
                                            ``taken_over``
``idempotency_settled_total``               stuck records settled, by ``actor`` and ``action``
``idempotency_claim_duration_seconds``      from the start of the claim to its decision
``idempotency_view_duration_seconds``       from the claim to the end of the view or job
==========================================  ===================================================

A request whose answer could not be stored (503) counts ``store_unavailable`` and then the
``released`` or ``unknown`` its key was left in; every other request counts once.

Gauges that describe the table (``idempotency_in_progress_records``,
``idempotency_lease_expired_records``, ``idempotency_unknown_records``,
``idempotency_reopened_records``, ``idempotency_oldest_in_progress_age_seconds``,
``idempotency_partitions_ahead``, ``idempotency_archived_partitions`` (with
``IDEMPOTENCY_ARCHIVE_RETENTION``), ``idempotency_table_up``) are computed by one query when
:func:`view` is scraped or ``flask idem metrics`` runs, never kept per process.

Under gunicorn with several workers, set ``PROMETHEUS_MULTIPROC_DIR`` to an empty directory
before the workers start, and before anything imports prometheus_client (``init_app`` refuses
it set later), and call :func:`child_exit` from gunicorn's ``child_exit`` hook (see
``sample_app/gunicorn_conf.py``): :func:`view` then adds up the files of every worker.
"""

from __future__ import annotations

import os
import typing as t

from flask import Flask, Response, current_app

from . import signals
from .config import Settings
from .errors import ConfigurationError, StoreUnavailable
from .events import event_name
from .state import AppState
from .store import Store

try:
    import prometheus_client as prometheus
    from prometheus_client import multiprocess, values
    from prometheus_client.core import GaugeMetricFamily
except ImportError as exc:  # pragma: no cover - the extra is missing
    raise ConfigurationError(
        "IDEMPOTENCY_METRICS needs prometheus_client: pip install 'flask-idem[metrics]'"
    ) from exc

#: Seconds; claims take milliseconds, views up to the lease.
CLAIM_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)
VIEW_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)

#: Signal -> the ``outcome`` of ``idempotency_requests_total`` it counts.
OUTCOMES = {
    signals.completed: "executed",
    signals.replayed: "replayed",
    signals.conflict: "in_progress",
    signals.pending: "outcome_pending",
    signals.not_stored: "not_stored",
    signals.mismatch: "mismatch",
    signals.released: "released",
    signals.unknown: "unknown",
    signals.lease_lost: "lease_lost",
    signals.store_unavailable: "store_unavailable",
}
#: Decisions taken at the claim (their duration is the claim's) ...
_AT_CLAIM = {
    signals.claimed,
    signals.taken_over,
    signals.replayed,
    signals.conflict,
    signals.pending,
    signals.not_stored,
    signals.mismatch,
}
#: ... and those that end a view or job that held the key.
_AT_END = {signals.completed, signals.released, signals.unknown, signals.lease_lost}


class Metrics:
    """The instruments flask_idem feeds, on one registry.

    :param registry: where they are registered (the default registry by default, which is
        also what multiprocess mode reads back).
    :param tenant_label: add a ``tenant`` label to the counters.
    """

    def __init__(
        self, registry: prometheus.CollectorRegistry | None = None, *, tenant_label: bool = False
    ) -> None:
        self.registry = registry or prometheus.REGISTRY
        self.tenant_label = tenant_label
        tenant = ("tenant",) if tenant_label else ()
        self.requests = prometheus.Counter(
            "idempotency_requests",
            "Protected requests and job runs that reached the claim, by outcome.",
            ("endpoint", "outcome", "status", *tenant),
            registry=self.registry,
        )
        self.claims = prometheus.Counter(
            "idempotency_claims",
            "Keys taken: new claims and takeovers of records nobody owned.",
            ("endpoint", "kind", *tenant),
            registry=self.registry,
        )
        self.settled = prometheus.Counter(
            "idempotency_settled",
            "Stuck records settled by a reconciler or an operator.",
            ("endpoint", "actor", "action"),
            registry=self.registry,
        )
        self.claim_duration = prometheus.Histogram(
            "idempotency_claim_duration_seconds",
            "From the start of the claim (body read, fingerprint, store) to its decision.",
            ("endpoint", "outcome"),
            buckets=CLAIM_BUCKETS,
            registry=self.registry,
        )
        self.view_duration = prometheus.Histogram(
            "idempotency_view_duration_seconds",
            "From the claim to the end of the view or job that held the key.",
            ("endpoint", "outcome"),
            buckets=VIEW_BUCKETS,
            registry=self.registry,
        )

    def receive(self, signal: t.Any, **event: t.Any) -> None:
        """Count one transition (the receiver of every signal)."""
        endpoint = event["endpoint"]
        tenant = (event["tenant"],) if self.tenant_label else ()
        outcome = OUTCOMES.get(signal)
        if outcome == "executed" and event.get("stored") is False:
            outcome = "unstored"
        if outcome is not None:
            status = "" if event.get("status") is None else str(event["status"])
            self.requests.labels(endpoint, outcome, status, *tenant).inc()
        if signal is signals.claimed or signal is signals.taken_over:
            self.claims.labels(endpoint, event_name(signal), *tenant).inc()
        elif signal is signals.settled:
            self.settled.labels(endpoint, event["actor"], event["action"]).inc()
        duration = event.get("duration")
        if duration is None:
            return
        if signal in _AT_CLAIM or event.get("stage") == "claim":
            self.claim_duration.labels(endpoint, outcome or event_name(signal)).observe(duration)
        elif signal in _AT_END or event.get("stage") == "complete":
            self.view_duration.labels(endpoint, outcome).observe(duration)


_default: dict[bool, Metrics] = {}


def default_metrics(tenant_label: bool) -> Metrics:
    """The instruments on the default registry, made once per process."""
    if tenant_label not in _default:
        if _default:
            raise ConfigurationError(
                "IDEMPOTENCY_METRICS_TENANT_LABEL differs between two applications of this "
                "process; give one of them Idempotency(metrics=Metrics(registry=...))"
            )
        _default[tenant_label] = Metrics(tenant_label=tenant_label)
    return _default[tenant_label]


def install(app: Flask, metrics: Metrics | None, settings: Settings) -> None:
    """Subscribe ``metrics`` (or the default ones) to every transition signal of ``app``.

    :raises ConfigurationError: ``PROMETHEUS_MULTIPROC_DIR`` was set only after
        prometheus_client was imported, so nothing would ever be counted where :func:`view`
        reads.
    """
    check_multiprocess_mode()
    chosen = metrics or default_metrics(settings.metrics_tenant_label)
    for signal in (*OUTCOMES, signals.claimed, signals.taken_over, signals.settled):

        def receive(sender: Flask, _signal: t.Any = signal, **event: t.Any) -> None:
            chosen.receive(_signal, **event)

        signal.connect(receive, app, weak=False)
    app.extensions["idempotency.metrics"] = chosen


def check_multiprocess_mode() -> None:
    """Refuse counters that would never show: prometheus_client chooses between per-process
    values and multiprocess files once, when it is imported. Imported before
    ``PROMETHEUS_MULTIPROC_DIR`` was set, every worker counts in its own memory while
    :func:`view` reads the directory's files, and ``/metrics`` shows no counter at all.

    :raises ConfigurationError: the directory is set but the values are per-process.
    """
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR") and values.ValueClass is values.MutexValue:
        raise ConfigurationError(
            "PROMETHEUS_MULTIPROC_DIR was set after prometheus_client was imported, so no "
            "counter would reach /metrics: set it before anything imports prometheus_client "
            "(export it before the server starts, or set it first thing in the gunicorn "
            "config, before importing the application)"
        )


class TableCollector:
    """Gauges read from the table at collection time (one query per scrape)."""

    def __init__(self, store: Store) -> None:
        self.store = store

    def collect(self) -> t.Iterator[GaugeMetricFamily]:
        up = GaugeMetricFamily("idempotency_table_up", "1 when the table could be read.")
        try:
            health = self.store.health()
        except StoreUnavailable:
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        yield up
        for name, help_text, value in (
            ("in_progress_records", "Live records in progress.", health.in_progress),
            (
                "lease_expired_records",
                "Records in progress whose owner stopped renewing its lease.",
                health.lease_expired,
            ),
            ("unknown_records", "Records whose outcome is unknown.", health.unknown),
            ("reopened_records", "Records an operator reopened.", health.reopened),
            (
                "oldest_in_progress_age_seconds",
                "Age of the oldest record in progress (0 when there is none).",
                health.oldest_in_progress_age or 0.0,
            ),
            (
                "partitions_ahead",
                "Partitions ready after the current one.",
                health.partitions_ahead,
            ),
            (
                "archived_partitions",
                "Expired partitions detached into the archive schema, not dropped yet.",
                health.archived_partitions,
            ),
        ):
            if value is not None:
                yield GaugeMetricFamily(f"idempotency_{name}", help_text, value=value)


def exposition(store: Store, metrics: Metrics | None) -> bytes:
    """The text exposition: the counters and histograms (of every worker in multiprocess
    mode), then the table's gauges."""
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        registry = prometheus.CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
        body = prometheus.generate_latest(registry)
    elif metrics is not None:
        body = prometheus.generate_latest(metrics.registry)
    else:
        body = b""
    table = prometheus.CollectorRegistry(auto_describe=False)
    table.register(TableCollector(store))
    return body + prometheus.generate_latest(table)


def view() -> Response:
    """A ``/metrics`` view for the application to route (it decides who may reach it)."""
    state = AppState.current()
    metrics = current_app.extensions.get("idempotency.metrics")
    return Response(
        exposition(state.store, metrics),
        content_type=prometheus.CONTENT_TYPE_LATEST,
        headers={"Cache-Control": "no-store"},
    )


def child_exit(pid: int) -> None:
    """For gunicorn's ``child_exit`` hook: forget a dead worker's live-gauge files (its counters
    stay, so totals never go down)."""
    multiprocess.mark_process_dead(pid)  # type: ignore[no-untyped-call]
