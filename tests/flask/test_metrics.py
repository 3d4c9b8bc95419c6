"""Metrics and events: every transition counted once, by endpoint and outcome, never by key;
structured log records with the documented fields; gauges read from the table."""

from __future__ import annotations

import logging
import typing as t

import flask
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from flask_idem import ConfigurationError, Idempotency, Scope
from flask_idem.ops.metrics import Metrics, TableCollector
from flask_idem.store import SQLStore
from tests.support.answers import post
from tests.support.helpers import shift

SECRET = "metrics-secret-key-77"


def _app(store: SQLStore, registry: CollectorRegistry, **config: t.Any) -> flask.Flask:
    app = flask.Flask("metrics-test")
    app.config.update(TESTING=True, PROPAGATE_EXCEPTIONS=False, **config)
    idem = Idempotency(
        store=store,
        tenant=lambda: flask.request.headers.get("X-Tenant", "alpha"),
        metrics=Metrics(registry, tenant_label=bool(config.get("tenant_label"))),
    )
    idem.init_app(app)

    @app.post("/pay")
    @idem.idempotent(release_before_contact=True)
    def pay() -> t.Any:
        body = flask.request.get_json()
        if body.get("crash"):
            raise RuntimeError("before any contact")
        if body.get("unknown"):
            idem.side_effect()
            raise RuntimeError("after contact")
        return {"ok": True}, 201

    return app


def _samples(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = generate_latest(registry).decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_outcomes_are_counted_by_endpoint_outcome_and_status(store: SQLStore) -> None:
    registry = CollectorRegistry()
    client = _app(store, registry).test_client()
    assert post(client, SECRET, {}, path="/pay").status_code == 201
    assert post(client, SECRET, {}, path="/pay").status_code == 201  # replayed
    assert post(client, SECRET, {"other": 1}, path="/pay").status_code == 422
    assert post(client, "crash", {"crash": True}, path="/pay").status_code == 500  # released
    assert post(client, "unknown", {"unknown": True}, path="/pay").status_code == 500
    assert (
        post(client, "unknown", {"unknown": True}, path="/pay").status_code == 409
    )  # outcome-pending
    scope = Scope("alpha", "POST /pay", "held")
    store.claim(scope, b"x" * 32, ttl=60, lease=60)
    assert post(client, "held", {}, path="/pay").status_code in (409, 422)
    samples = _samples(registry)

    def requests(outcome: str, status: str) -> float:
        labels = (("endpoint", "POST /pay"), ("outcome", outcome), ("status", status))
        return samples.get(("idempotency_requests_total", labels), 0.0)

    assert requests("executed", "201") == 1
    assert requests("replayed", "201") == 1
    assert requests("mismatch", "422") == 2  # the held record has another fingerprint
    assert requests("released", "") == 1
    assert requests("unknown", "") == 1
    assert requests("outcome_pending", "409") == 1
    claims = samples[("idempotency_claims_total", (("endpoint", "POST /pay"), ("kind", "claimed")))]
    assert claims == 3
    views = [
        value
        for (name, labels), value in samples.items()
        if name == "idempotency_view_duration_seconds_count"
    ]
    assert sum(views) == 3  # executed, released, unknown
    claim_count = sum(
        value
        for (name, _), value in samples.items()
        if name == "idempotency_claim_duration_seconds_count"
    )
    assert claim_count == 3 + 1 + 2 + 1  # claims, replay, mismatches, pending
    exposed = generate_latest(registry).decode()
    assert SECRET not in exposed and "tenant" not in exposed


def test_tenant_labels_only_when_switched_on(store: SQLStore) -> None:
    registry = CollectorRegistry()
    client = _app(store, registry, tenant_label=True).test_client()
    client.post("/pay", json={}, headers={"Idempotency-Key": "k", "X-Tenant": "beta"})
    assert 'tenant="beta"' in generate_latest(registry).decode()


def test_takeovers_count_as_takeovers(store: SQLStore) -> None:
    registry = CollectorRegistry()
    app = _app(store, registry)
    idem = app.extensions["idempotency"].extension

    @app.post("/again")
    @idem.idempotent(recovery="reexecute")
    def again() -> t.Any:
        return "ok", 201

    client = app.test_client()
    assert client.post("/again", headers={"Idempotency-Key": "k"}).status_code == 201
    with store.engine.begin() as conn:  # as if its outcome had been lost
        conn.exec_driver_sql(
            "UPDATE idempotency_keys SET state = 'unknown', response_status = NULL, "
            "response_body = NULL, response_headers = NULL, completed_at = NULL"
        )
    assert client.post("/again", headers={"Idempotency-Key": "k"}).status_code == 201
    samples = _samples(registry)
    kinds = {
        dict(labels)["kind"]: value
        for (name, labels), value in samples.items()
        if name == "idempotency_claims_total"
    }
    assert kinds == {"claimed": 1, "taken_over": 1}


def test_one_log_record_per_transition_with_the_documented_fields(
    store: SQLStore, caplog: pytest.LogCaptureFixture
) -> None:
    client = _app(store, CollectorRegistry()).test_client()
    caplog.set_level(logging.INFO, logger="flask_idem.events")
    post(client, SECRET, {}, path="/pay")
    post(client, SECRET, {}, path="/pay")
    post(client, "unknown", {"unknown": True}, path="/pay")
    events = [r for r in caplog.records if r.name == "flask_idem.events"]
    assert [(r.event, r.levelname) for r in events] == [  # type: ignore[attr-defined]
        ("claimed", "INFO"),
        ("completed", "INFO"),
        ("replayed", "INFO"),
        ("claimed", "INFO"),
        ("unknown", "WARNING"),
    ]
    for record in events:
        fields = record.__dict__
        for name in ("tenant", "endpoint", "key_hash", "fingerprint", "state", "replayed"):
            assert name in fields
        assert fields["duration_ms"] is not None and fields["duration_ms"] >= 0
        assert len(fields["fingerprint"]) == 12
        assert SECRET not in repr(fields) and SECRET not in record.getMessage()
    assert events[2].replayed is True and events[2].status == 201  # type: ignore[attr-defined]


def test_table_gauges(store: SQLStore) -> None:
    store.claim(Scope("alpha", "POST /pay", "a"), b"x" * 32, ttl=60, lease=60)
    old = Scope("alpha", "POST /pay", "b")
    claim = store.claim(old, b"x" * 32, ttl=600, lease=60)
    shift(store, old, 120, "created_at", "lease_expires_at")
    other = Scope("beta", "POST /pay", "c")
    store.mark_unknown(other, store.claim(other, b"x" * 32, ttl=60, lease=60).token)
    assert claim.claimed
    registry = CollectorRegistry(auto_describe=False)
    registry.register(TableCollector(store))  # type: ignore[arg-type]
    values = {
        sample.name: sample.value
        for family in text_string_to_metric_families(generate_latest(registry).decode())
        for sample in family.samples
    }
    assert values["idempotency_table_up"] == 1
    assert values["idempotency_in_progress_records"] == 2
    assert values["idempotency_lease_expired_records"] == 1
    assert values["idempotency_unknown_records"] == 1
    assert 119 < values["idempotency_oldest_in_progress_age_seconds"] < 180
    if store.dialect == "postgresql":
        assert values["idempotency_partitions_ahead"] >= 7
    else:
        assert "idempotency_partitions_ahead" not in values


def test_the_metrics_command_prints_the_gauges(store: SQLStore) -> None:
    app = _app(store, CollectorRegistry())
    result = app.test_cli_runner().invoke(args=["idem", "metrics"])
    assert result.exit_code == 0, result.output
    assert "idempotency_unknown_records 0.0" in result.output


def test_a_directory_set_after_prometheus_client_was_imported_fails_in_init_app(
    store: SQLStore, monkeypatch: pytest.MonkeyPatch, tmp_path: t.Any
) -> None:
    """This process imported prometheus_client without ``PROMETHEUS_MULTIPROC_DIR``: its
    values are per-process, and ``/metrics`` would read a directory nobody writes to (no
    counter at all, silently). ``init_app`` says so instead."""
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    with pytest.raises(ConfigurationError, match="set after prometheus_client was imported"):
        _app(store, CollectorRegistry())
