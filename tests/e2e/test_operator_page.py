"""The operator page of the sample app, in a real headless Chromium under gunicorn: stuck and
unknown records of the operator's tenants only, a key's timeline found through a POST form
(never in a URL), 403 without an operator session, 404 when the application gives no
authorization, and what the authorization callable may return. A screenshot goes to
tests/artifacts/operator-page.png."""

from __future__ import annotations

import logging
import typing as t
from pathlib import Path

import flask
import pytest

from flask_idem import Idempotency, Scope
from flask_idem.core.idempotency_keys import key_hash
from flask_idem.store import SQLStore, create_store
from tests.support import browser
from tests.support.sample_server import ALPHA, SampleServer, served

ENDPOINT = "POST /v1/payments"
BODY = {"amount": 4200, "currency": "eur", "customer": "cus_42"}
PAGE = "/idempotency/operator"


@pytest.fixture(scope="session")
def chromium() -> t.Iterator[t.Any]:
    try:
        binaries = browser.ensure_binaries()
        session = browser.start(*binaries)
    except Exception as exc:  # the suite's own setup failed: a failure, never a skip
        pytest.fail(f"cannot start headless Chromium: {exc}")
    yield session
    browser.stop(session)


@pytest.fixture
def server(fresh_pg_database: t.Callable[[], str], tmp_path: Path) -> t.Iterator[SampleServer]:
    # Threads: a browser keeps idle connections open, which would hold a sync worker.
    with served(
        fresh_pg_database(), tmp_path, workers=1, threads=4, FLASK_IDEMPOTENCY_AUDIT="true"
    ) as s:
        yield s


def _unknown(store: SQLStore, tenant: str, key: str) -> Scope:
    """A record whose request died after contacting the provider (as a crash leaves it)."""
    scope = Scope(tenant, ENDPOINT, key)
    store.mark_unknown(scope, store.claim(scope, b"\x01" * 32, ttl=3600, lease=30).token)
    return scope


def test_the_operator_page_in_a_browser(chromium: t.Any, server: SampleServer) -> None:
    from selenium.webdriver.common.by import By

    paid = "browser-paid-4f1d"
    assert server.pay(paid, BODY).status == 201
    assert server.pay(paid, BODY).headers["Idempotent-Replayed"] == "true"
    store = create_store(server.url)
    store.use_audit(True)
    try:
        mine = _unknown(store, "alpha", "browser-stuck-alpha")
        theirs = _unknown(store, "beta", "browser-stuck-beta")
        beta_paid = _unknown(store, "beta", paid)  # the same key value, another tenant
    finally:
        store.engine.dispose()
    base = f"http://127.0.0.1:{server.port}"

    # No operator session: 403, and nothing of any tenant on the page.
    assert server.request("GET", PAGE, api_key=None).status == 403
    assert server.request("GET", PAGE, api_key=ALPHA).status == 403, "API keys do not open it"
    chromium.get(base + PAGE)
    assert "Forbidden" in chromium.page_source and "browser-stuck" not in chromium.page_source
    assert key_hash(mine) not in chromium.page_source

    chromium.add_cookie({"name": "sample_operator", "value": "op_alpha", "path": "/"})
    chromium.get(base + PAGE)
    stuck = chromium.find_element(By.ID, "stuck").text
    assert key_hash(mine) in stuck and "unknown" in stuck
    assert key_hash(theirs) not in chromium.page_source and "beta" not in stuck

    key_input = chromium.find_element(By.NAME, "key")
    key_input.send_keys(paid)
    key_input.submit()
    timeline = chromium.find_element(By.ID, "timeline").text
    assert "claimed" in timeline and "completed" in timeline and "201" in timeline
    records = chromium.find_element(By.ID, "records").text
    assert "completed" in records and key_hash(Scope("alpha", ENDPOINT, paid)) in records
    assert key_hash(beta_paid) not in chromium.page_source, "beta's record of the same key"
    assert chromium.current_url == base + PAGE, "the key never goes into a URL"
    assert paid not in chromium.page_source, "the page shows key hashes, not keys"
    assert "cus_42" not in chromium.page_source, "no stored body without INSPECT_BODIES"
    shot = browser.screenshot(chromium, "operator-page.png")
    assert shot.stat().st_size > 10_000

    # Beta's operator sees beta's record of the same key and nothing of alpha's.
    chromium.add_cookie({"name": "sample_operator", "value": "op_beta", "path": "/"})
    chromium.get(base + PAGE)
    assert key_hash(theirs) in chromium.page_source and key_hash(mine) not in chromium.page_source
    reply = server.request(
        "POST",
        PAGE,
        api_key=None,
        raw=f"key={paid}&tenant=alpha".encode(),
        headers={
            "Cookie": "sample_operator=op_beta",
            "Content-Type": "application/x-www-form-urlencoded",
        },
    )
    assert (
        reply.status == 200 and key_hash(Scope("alpha", ENDPOINT, paid)).encode() not in reply.body
    )
    assert b"No live record" in reply.body and reply.headers["Cache-Control"] == "no-store"
    assert server.request("GET", PAGE + "/" + paid, api_key=ALPHA).status == 404


def test_no_authorization_no_page(store: SQLStore) -> None:
    app = flask.Flask("no-operator")
    Idempotency(app, store=store, tenant=lambda: "alpha")
    assert app.test_client().get(PAGE).status_code == 404
    allowed = flask.Flask("operator")
    idem = Idempotency(store=store, tenant=lambda: "alpha")

    @idem.operator_access
    def nobody() -> None:
        return None

    idem.init_app(allowed)
    assert allowed.test_client().get(PAGE).status_code == 403


def _page_with(store: SQLStore, access: object) -> flask.Flask:
    """An application whose operator authorization returns ``access``."""
    app = flask.Flask("operator-contract")
    idem = Idempotency(store=store, tenant=lambda: "alpha")
    idem.operator_access(lambda: access)  # type: ignore[arg-type,return-value]
    idem.init_app(app)
    return app


@pytest.mark.parametrize(
    ("access", "status", "listed"),
    [
        (True, 200, {"alpha", "beta"}),
        ("alpha", 200, {"alpha"}),
        (["alpha", "beta"], 200, {"alpha", "beta"}),
        (frozenset({"beta"}), 200, {"beta"}),
        (None, 403, set()),
        (False, 403, set()),
        ("", 403, set()),
        ([], 403, set()),
    ],
)
def test_what_the_authorization_may_return(
    store: SQLStore, access: object, status: int, listed: set[str]
) -> None:
    scopes = {tenant: _unknown(store, tenant, f"contract-{tenant}") for tenant in ("alpha", "beta")}
    answer = _page_with(store, access).test_client().get(PAGE)
    assert answer.status_code == status
    page = answer.get_data(as_text=True)
    assert {tenant for tenant, scope in scopes.items() if key_hash(scope) in page} == listed


@pytest.mark.parametrize(
    ("access", "named"),
    [
        (1, "int"),
        (0, "int"),
        (2.5, "float"),
        (b"alpha", "bytes"),
        ({"alpha": True}, "dict"),
        (["alpha", 7], "list of int, str"),
        ({"alpha", ""}, "set of str"),
        (object(), "object"),
    ],
)
def test_anything_else_is_a_logged_configuration_error_and_a_500(
    store: SQLStore, caplog: pytest.LogCaptureFixture, access: object, named: str
) -> None:
    scope = _unknown(store, "alpha", "contract-misconfigured")
    with caplog.at_level(logging.ERROR, logger="flask_idem"):
        answer = _page_with(store, access).test_client().get(PAGE)
    assert answer.status_code == 500
    assert answer.content_type == "application/problem+json"
    assert answer.json is not None and answer.json["type"].endswith("/internal-error")
    assert key_hash(scope) not in answer.get_data(as_text=True), "nothing of any tenant"
    assert f"the operator_access callable returned {named}: return None or False" in caplog.text


@pytest.mark.parametrize(
    ("tenant", "says"),
    [
        ("al\x00pha", "without control characters"),
        ("alpha\x1b[2J", "without control characters"),
        ("a" * 256, "at most 255 characters"),
    ],
)
def test_a_lookup_no_record_can_match_is_a_400_that_says_why(
    store: SQLStore, tenant: str, says: str
) -> None:
    """A NUL in the tenant field reached PostgreSQL, which refuses it: a 500. A tenant no
    record can hold is the form's error, answered 400 on the page, on both dialects (the key
    field was checked already: outside the key alphabet, 400)."""
    answer = _page_with(store, True).test_client().post(PAGE, data={"tenant": tenant, "key": "k"})
    assert answer.status_code == 400
    assert says in answer.get_data(as_text=True)
    assert answer.headers["Cache-Control"] == "no-store"
