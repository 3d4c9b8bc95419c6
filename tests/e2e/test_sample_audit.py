"""The next-day check on the sample app: a duplicate charge made behind the extension's back
and a payment whose outcome is unknown are reported by ``flask idem audit-downstream``, which
asks the fake provider for its charges of the day (under gunicorn, on PostgreSQL)."""

from __future__ import annotations

import datetime as dt
import json
import secrets
import time
import typing as t
import uuid

import pytest

from tests.e2e.test_sample_app import assert_executed, assert_problem, new_customer, payment
from tests.support.sample_server import SampleServer, served

pytestmark = [pytest.mark.postgresql, pytest.mark.slow]


@pytest.fixture(scope="module")
def server(
    fresh_pg_database: t.Callable[[], str], tmp_path_factory: pytest.TempPathFactory
) -> t.Iterator[SampleServer]:
    with served(fresh_pg_database(), tmp_path_factory.mktemp("audit")) as sample:
        yield sample


def _audit(server: SampleServer) -> tuple[int, dict[str, t.Any]]:
    today = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d")
    done = server.flask("idem", "audit-downstream", "--day", today, "--json")
    assert done.returncode in (0, 1), done.stderr
    return done.returncode, json.loads(done.stdout)


def test_a_duplicate_behind_the_extensions_back_is_reported(server: SampleServer) -> None:
    customer = new_customer()
    paid = server.pay(str(uuid.uuid4()), payment(customer))
    assert_executed(paid)
    status, report = _audit(server)
    assert status == 0 and report["unmatched"] == 0, report
    # Someone charges the same customer again straight at the provider, with a fresh key
    # (a script, a support tool, a record deleted by hand and the payment retried).
    duplicate = f"ch_{secrets.token_hex(12)}"
    server.sql(
        "INSERT INTO provider_charges (id, tenant, downstream_key, amount, currency, customer, "
        "status, created) VALUES (:id, 'alpha', :key, 4200, 'eur', :customer, 'succeeded', :now)",
        id=duplicate,
        key=str(uuid.uuid4()),
        customer=customer,
        now=int(time.time()),
    )
    status, report = _audit(server)
    assert status == 1 and report["unmatched"] == 1, report
    (found,) = report["discrepancies"]
    assert found["finding"] == "unmatched" and found["record"] is None
    assert [op["id"] for op in found["operations"]] == [duplicate]
    assert customer in found["operations"][0]["detail"]
    server.sql("DELETE FROM provider_charges WHERE id = :id", id=duplicate)  # refunded


def test_an_unknown_payment_the_provider_charged_is_reported_until_finished(
    server: SampleServer,
) -> None:
    key = str(uuid.uuid4())
    assert_problem(server.pay(key, payment("cus_timeout")), 504, "provider-timeout")
    status, report = _audit(server)
    assert status == 1 and report["unknown"] == 1, report
    (found,) = [d for d in report["discrepancies"] if d["finding"] == "unknown"]
    assert found["record"]["state"] == "unknown"
    assert found["record"]["endpoint"] == "POST /v1/payments"
    assert_executed(server.pay(key, payment("cus_timeout")))  # the retry finishes it
    status, report = _audit(server)
    assert status == 0 and report["discrepancies"] == [], report
