"""``flask idem audit-downstream``: a day of records against a downstream service's own ledger,
on both databases. The "provider" here does not deduplicate, so every finding can be made."""

from __future__ import annotations

import datetime as dt
import json
import typing as t

import flask
import pytest
from click.testing import Result

from flask_idem import DownstreamRecord, Idempotency, Scope, derive_key
from flask_idem.core.idempotency_keys import key_hash
from flask_idem.ops.downstream import DiscrepancyKind, check_downstream
from flask_idem.store import SQLStore
from tests.support.helpers import shift

Factory = t.Callable[..., tuple[flask.Flask, Idempotency, t.Any]]
PATH = "/charges"


class Ledger:
    """A provider that records every call, with the key it was sent (no deduplication)."""

    def __init__(self) -> None:
        self.entries: list[DownstreamRecord] = []
        #: The next call charges, then its answer is lost (the view raises).
        self.lose_next = False

    def charge(self, tenant: str, key: str | None, when: dt.datetime | None = None) -> None:
        created = when or dt.datetime.now(dt.timezone.utc)
        self.entries.append(DownstreamRecord(f"ch_{len(self.entries)}", tenant, key, created))

    def between(self, start: dt.datetime, end: dt.datetime) -> list[DownstreamRecord]:
        return [entry for entry in self.entries if start <= entry.created < end]


@pytest.fixture
def charging(app_factory: Factory) -> tuple[flask.Flask, Ledger]:
    return _charging(app_factory)


def _charging(app_factory: Factory, **config: t.Any) -> tuple[flask.Flask, Ledger]:
    app, idem, _ = app_factory(**config)
    ledger = Ledger()

    @app.post(PATH)
    @idem.idempotent(recovery="reexecute", release_before_contact=True)
    def create_charge() -> t.Any:
        ledger.charge("alpha", idem.downstream_key("charge"))
        if ledger.lose_next:
            ledger.lose_next = False
            raise TimeoutError("charged, answer lost")
        return {"ok": True}, 201

    idem.downstream_lookup(create_charge, step="charge")(ledger.between)
    return app, ledger


def _charge(app: flask.Flask, key: str) -> int:
    return app.test_client().post(PATH, headers={"Idempotency-Key": key}).status_code


def _audit(app: flask.Flask, *args: str) -> Result:
    today = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d")
    return app.test_cli_runner().invoke(args=["idem", "audit-downstream", "--day", today, *args])


def test_a_clean_day_reports_nothing(charging: tuple[flask.Flask, Ledger]) -> None:
    app, ledger = charging
    for key in ("k1", "k2"):
        assert _charge(app, key) == 201
    assert _charge(app, "k1") == 201  # a replay charges nothing
    result = _audit(app)
    assert result.exit_code == 0, result.output
    assert "2 records, 2 downstream operations; 0 unmatched, 0 duplicate" in result.output


def test_records_of_principals_and_account_wide_keys_are_checked(app_factory: Factory) -> None:
    """Per-principal and account-wide records are matched by the endpoint they ran on: a
    clean day is clean, and a charge behind the extension's back is still found."""
    app, ledger = _charging(
        app_factory,
        IDEMPOTENCY_SCOPE="account",
        IDEMPOTENCY_PRINCIPAL=lambda: flask.request.headers.get("X-User", "nobody"),
    )
    for user in ("alice", "bob"):
        response = app.test_client().post(
            PATH, headers={"Idempotency-Key": "shared", "X-User": user}
        )
        assert response.status_code == 201
    result = _audit(app)
    assert result.exit_code == 0, result.output
    assert "2 records, 2 downstream operations; 0 unmatched, 0 duplicate" in result.output
    ledger.charge("alpha", "a-key-no-record-derives")
    assert "1 unmatched" in _audit(app).output


def test_every_kind_of_discrepancy_is_reported(
    charging: tuple[flask.Flask, Ledger], store: SQLStore
) -> None:
    app, ledger = charging
    assert _charge(app, "clean") == 201
    ledger.charge("alpha", "a-key-no-record-derives")  # behind the extension's back
    ledger.charge("alpha", None)  # a charge sent without any key
    ledger.lose_next = True
    assert _charge(app, "twice") == 500  # unknown, charged
    assert _charge(app, "twice") == 201  # re-run: this provider charges again
    ledger.lose_next = True
    assert _charge(app, "lost") == 500  # unknown, charged, not retried yet
    result = _audit(app, "--json")
    assert result.exit_code == 1, result.output
    report = json.loads(result.output)
    assert (report["records"], report["operations"]) == (3, 6)
    assert (report["unmatched"], report["duplicate"], report["unknown"]) == (2, 1, 1)
    by_finding = {d["finding"]: d for d in report["discrepancies"] if d["record"]}
    twice = by_finding["duplicate"]
    assert twice["record"]["key_hash"] == key_hash(Scope("alpha", f"POST {PATH}", "twice"))
    assert len(twice["operations"]) == 2
    assert by_finding["unknown"]["record"]["state"] == "unknown"
    assert "twice" not in result.output and "lost" not in result.output, "no raw keys"
    text = _audit(app)
    assert text.exit_code == 1
    assert "2 unmatched, 1 duplicate, 1 unknown but done" in text.output
    assert "ch_1" in text.output and "made behind the extension" in text.output


def test_a_charge_just_after_midnight_matches_its_record_of_the_day_before(
    charging: tuple[flask.Flask, Ledger], store: SQLStore
) -> None:
    app, ledger = charging
    assert _charge(app, "late") == 201
    now = dt.datetime.now(dt.timezone.utc)
    midnight = now.replace(hour=0, minute=0, second=0, microsecond=0)
    # The record claimed at 23:59:59.5 yesterday; the provider charged at 00:00:00.2.
    scope = Scope("alpha", f"POST {PATH}", "late")
    shift(store, scope, (now - midnight).total_seconds() + 0.5)
    record = store.get(scope)
    assert record is not None
    # (Moving the record moved its downstream key with it: derived from its creation time.)
    late = midnight + dt.timedelta(seconds=0.2)
    ledger.entries[0] = DownstreamRecord("ch_0", "alpha", derive_key(record, "charge"), late)
    with app.app_context():
        today = check_downstream(midnight, midnight + dt.timedelta(days=1))
        yesterday = check_downstream(midnight - dt.timedelta(days=1), midnight)
        narrow = check_downstream(midnight, midnight + dt.timedelta(days=1), margin=0)
    assert (today.records, today.operations, today.discrepancies) == (0, 1, ())
    assert (yesterday.records, yesterday.operations, yesterday.discrepancies) == (1, 0, ())
    assert narrow.count(DiscrepancyKind.UNMATCHED) == 1, (
        "without the margin it would look unmatched"
    )


def test_an_old_day_warns_that_records_may_be_purged(
    charging: tuple[flask.Flask, Ledger],
) -> None:
    app, _ = charging
    result = app.test_cli_runner().invoke(args=["idem", "audit-downstream", "--day", "2020-01-01"])
    assert result.exit_code == 0
    assert "older than IDEMPOTENCY_TTL" in result.output
    assert "audited 2020-01-01: 0 records" in result.output
