"""Prometheus metrics (the ``metrics`` extra): counters and histograms fed by the transition
signals, and gauges read from the table when scraped.

``IDEMPOTENCY_METRICS = True`` (or ``Idempotency(metrics=Metrics(registry=...))``) subscribes
:class:`Metrics` to the signals of :mod:`flask_idem.core.signals`; nothing in the request flow knows
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

from ..core.config import Settings
from ..core.errors import ConfigurationError, StoreUnavailable
from ..state import AppState
from ..store import OperatorStore, RequestStore
from . import counting
from .counting import CLAIM_BUCKETS, DESCRIPTIONS, VIEW_BUCKETS, Recorder

try:
    import prometheus_client as prometheus
    from prometheus_client import multiprocess, values
    from prometheus_client.core import GaugeMetricFamily
except ImportError as exc:  # pragma: no cover - the extra is missing
    raise ConfigurationError(
        "IDEMPOTENCY_METRICS needs prometheus_client: pip install 'flask-idem[metrics]'"
    ) from exc


class Metrics(Recorder):
    """The instruments flask_idem feeds, on one registry.

    :param registry: where they are registered (the default registry by default, which is
        also what multiprocess mode reads back).
    :param tenant_label: add a ``tenant`` label to the counters.
    """

    def __init__(
        self, registry: prometheus.CollectorRegistry | None = None, *, tenant_label: bool = False
    ) -> None:
        super().__init__(tenant_label=tenant_label)
        self.registry = registry or prometheus.REGISTRY
        tenant = ("tenant",) if tenant_label else ()
        self.requests = prometheus.Counter(
            "idempotency_requests",
            DESCRIPTIONS["requests"],
            ("endpoint", "outcome", "status", *tenant),
            registry=self.registry,
        )
        self.claims = prometheus.Counter(
            "idempotency_claims",
            DESCRIPTIONS["claims"],
            ("endpoint", "kind", *tenant),
            registry=self.registry,
        )
        self.settled = prometheus.Counter(
            "idempotency_settled",
            DESCRIPTIONS["settled"],
            ("endpoint", "actor", "action"),
            registry=self.registry,
        )
        self.claim_duration = prometheus.Histogram(
            "idempotency_claim_duration_seconds",
            DESCRIPTIONS["claim_duration"],
            ("endpoint", "outcome"),
            buckets=CLAIM_BUCKETS,
            registry=self.registry,
        )
        self.view_duration = prometheus.Histogram(
            "idempotency_view_duration_seconds",
            DESCRIPTIONS["view_duration"],
            ("endpoint", "outcome"),
            buckets=VIEW_BUCKETS,
            registry=self.registry,
        )

    def add_request(
        self, endpoint: str, outcome: str, status: int | None, tenant: str | None
    ) -> None:
        self.requests.labels(
            endpoint, outcome, "" if status is None else str(status), *_opt(tenant)
        ).inc()

    def add_claim(self, endpoint: str, kind: str, tenant: str | None) -> None:
        self.claims.labels(endpoint, kind, *_opt(tenant)).inc()

    def add_settled(self, endpoint: str, actor: str, action: str) -> None:
        self.settled.labels(endpoint, actor, action).inc()

    def observe_claim(self, endpoint: str, outcome: str, seconds: float) -> None:
        self.claim_duration.labels(endpoint, outcome).observe(seconds)

    def observe_view(self, endpoint: str, outcome: str, seconds: float) -> None:
        self.view_duration.labels(endpoint, outcome).observe(seconds)


def _opt(tenant: str | None) -> tuple[str, ...]:
    return () if tenant is None else (tenant,)


_default = counting.PerProcess(
    lambda label: Metrics(tenant_label=label), "Idempotency(metrics=Metrics(registry=...))"
)


def default_metrics(tenant_label: bool) -> Metrics:
    """The instruments on the default registry, made once per process."""
    return _default.get(tenant_label)


def install(app: Flask, metrics: Metrics | None, settings: Settings) -> None:
    """Subscribe ``metrics`` (or the default ones) to every transition signal of ``app``.

    :raises ConfigurationError: ``PROMETHEUS_MULTIPROC_DIR`` was set only after
        prometheus_client was imported, so nothing would ever be counted where :func:`view`
        reads.
    """
    check_multiprocess_mode()
    chosen = metrics or default_metrics(settings.metrics_tenant_label)
    counting.subscribe(app, chosen.receive)
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

    def __init__(self, store: OperatorStore) -> None:
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


def exposition(store: RequestStore, metrics: Metrics | None) -> bytes:
    """The text exposition: the counters and histograms (of every worker in multiprocess
    mode), then the table's gauges (read through the operator interface: none from a store
    with the request primitives only)."""
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        registry = prometheus.CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
        body = prometheus.generate_latest(registry)
    elif metrics is not None:
        body = prometheus.generate_latest(metrics.registry)
    else:
        body = b""
    if not isinstance(store, OperatorStore):
        return body
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
