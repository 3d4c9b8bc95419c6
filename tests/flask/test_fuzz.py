"""Property-based fuzzing (hypothesis) of keys, header combinations and bodies: never a 500,
never a second run.

Against the extension (the conftest payments app) and the sample app, both in-process on
SQLite files so that hundreds of examples stay fast. Two properties:

* never a 5xx: hostile input is a 4xx problem or a normal answer;
* never a claim for refused input: a request answered 400 (key, body) or 413 before the view
  left no record behind.
"""

from __future__ import annotations

import json
import typing as t
from pathlib import Path

import flask
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flask_idem import Idempotency
from flask_idem.ops.migrate import upgrade
from flask_idem.store import create_store
from tests.support.helpers import record_count

FUZZ = settings(
    max_examples=120,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
REFUSED_BEFORE_CLAIM = {
    "idempotency-key-missing",
    "idempotency-key-invalid",
    "request-body-incomplete",
    "request-body-too-large",
}

# -- strategies -------------------------------------------------------------------------------

valid_keys = st.from_regex(r"[A-Za-z0-9\-_.:~+/=]{1,40}", fullmatch=True)
hostile_keys = st.one_of(
    st.text(max_size=300),
    st.text(alphabet=st.characters(codec="latin-1"), max_size=300),
    st.sampled_from(["", " ", '""', '"a', "a" * 256, "a\x00b", "\u00b2", "k\r\nX-Evil: 1"]),
)
keys = st.one_of(valid_keys, hostile_keys)
header_names = st.sampled_from(["Idempotency-Key", "X-Idempotency-Key", "idempotency-key"])


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


json_values = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(min_value=-(10**40), max_value=10**40),
        st.floats(allow_nan=False, allow_infinity=False),
        st.text(max_size=20),
    ),
    lambda children: st.one_of(
        st.lists(children, max_size=5), st.dictionaries(st.text(max_size=8), children, max_size=5)
    ),
    max_leaves=30,
)
raw_numbers = st.sampled_from(
    [b"1e999999999", b"-0.0", b"4.2e3", b"1" * 5000, b"NaN", b"Infinity", b"0x10", b"1e-400"]
)
bodies = st.one_of(
    json_values.map(lambda value: json.dumps(value).encode()),
    st.integers(min_value=1, max_value=3000).map(lambda depth: nested(depth).encode()),
    raw_numbers.map(lambda number: b'{"amount": ' + number + b', "currency": "eur"}'),
    st.binary(max_size=2000),
    st.text(max_size=200).map(lambda text: json.dumps({"customer": text}).encode("utf-16")),
    st.text(max_size=200).map(lambda text: text.encode("utf-8", "surrogatepass")),
    st.integers(min_value=0, max_value=30_000).map(lambda n: b"[" + b"1," * n + b"1]"),
)
content_types = st.sampled_from(
    [
        "application/json",
        "application/merge-patch+json",
        "application/x-www-form-urlencoded",
        "multipart/form-data; boundary=x",
        "text/plain",
        "application/json; charset=latin-1",
        None,
    ]
)


def _headers(draw_keys: list[tuple[str, str]], content_type: str | None) -> list[tuple[str, str]]:
    headers = list(draw_keys)
    if content_type is not None:
        headers.append(("Content-Type", content_type))
    return headers


key_headers = st.lists(st.tuples(header_names, keys), max_size=3)

# -- the extension ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def extension_app(tmp_path_factory: pytest.TempPathFactory) -> flask.Flask:
    url = f"sqlite:///{tmp_path_factory.mktemp('fuzz')}/extension.sqlite3"
    upgrade(url)
    app = flask.Flask("fuzz")
    app.config.update(PROPAGATE_EXCEPTIONS=False, IDEMPOTENCY_MAX_REQUEST_BODY=64 * 1024)
    idem = Idempotency(app, store=create_store(url), tenant=lambda: "alpha")

    @app.post("/payments/<id>")
    @idem.idempotent(exclude=["client_ts"])
    def pay(id: str) -> t.Any:
        try:
            body = flask.request.get_json(silent=True)
        except RecursionError:
            # The json module on a body nested deeper than the interpreter's recursion limit
            # (which the extension's own parse of it survives): the view's crash, not the
            # extension's answer, and silent=True does not cover it.
            body = None
        return {"id": id, "kind": type(body).__name__}, 201

    return app


def _records(app: flask.Flask) -> int:
    return record_count(app.extensions["idempotency"].store)


def _check(app: flask.Flask, response: t.Any, before: int) -> None:
    assert response.status_code < 500, (response.status_code, response.data[:300])
    if response.status_code in (400, 413) and response.is_json:
        name = str(response.get_json().get("type", "")).rsplit("/", 1)[-1]
        if name in REFUSED_BEFORE_CLAIM:
            assert _records(app) == before, f"{name} left a record behind"


@FUZZ
@given(
    sent=key_headers,
    body=bodies,
    content_type=content_types,
    path_id=st.text(min_size=1, max_size=30).filter(lambda s: "/" not in s),
)
def test_the_extension_never_answers_5xx_nor_claims_refused_input(
    extension_app: flask.Flask,
    sent: list[tuple[str, str]],
    body: bytes,
    content_type: str | None,
    path_id: str,
) -> None:
    client = extension_app.test_client()
    before = _records(extension_app)
    try:
        response = client.post(
            f"/payments/{path_id}", data=body, headers=_headers(sent, content_type)
        )
    except (ValueError, UnicodeError):
        return  # the test client itself refuses this header (not something a server sees)
    _check(extension_app, response, before)


@FUZZ
@given(endpoint=st.text(max_size=80), key=keys, via=st.sampled_from(["header", "body"]))
def test_the_inspection_endpoint_never_answers_5xx(
    extension_app: flask.Flask, endpoint: str, key: str, via: str
) -> None:
    client = extension_app.test_client()
    try:
        if via == "header":
            response = client.get(
                "/idempotency/requests",
                query_string={"endpoint": endpoint},
                headers={"Idempotency-Key": key},
            )
        else:
            response = client.post("/idempotency/requests", json={"key": key, "endpoint": endpoint})
    except (ValueError, UnicodeError):
        return
    assert response.status_code < 500, response.data[:300]


# -- the sample app ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sample_app(tmp_path_factory: pytest.TempPathFactory) -> flask.Flask:
    import os

    from tests.support.sample_server import migrate

    path: Path = tmp_path_factory.mktemp("fuzz-sample") / "sample.sqlite3"
    url = f"sqlite:///{path}"
    migrate(url)
    previous = os.environ.get("DATABASE_URL")
    os.environ["DATABASE_URL"] = url
    try:
        from sample_app import create_app

        app = create_app()
    finally:
        if previous is None:
            os.environ.pop("DATABASE_URL")
        else:
            os.environ["DATABASE_URL"] = previous
    app.config["PROPAGATE_EXCEPTIONS"] = False
    return app


@FUZZ
@given(
    sent=key_headers,
    body=bodies,
    content_type=content_types,
    path=st.sampled_from(["/v1/payments", "/v1/payments/{id}/refunds"]),
    payment_id=st.text(min_size=1, max_size=30).filter(lambda s: "/" not in s),
)
def test_the_sample_app_never_answers_5xx_nor_claims_refused_input(
    sample_app: flask.Flask,
    sent: list[tuple[str, str]],
    body: bytes,
    content_type: str | None,
    path: str,
    payment_id: str,
) -> None:
    headers = [("Authorization", "Bearer sk_test_alpha"), *_headers(sent, content_type)]
    client = sample_app.test_client()
    before = _records(sample_app)
    try:
        response = client.post(path.format(id=payment_id), data=body, headers=headers)
        read = client.get(f"/v1/payments/{payment_id}", headers=headers[:1])
    except (ValueError, UnicodeError):
        return
    _check(sample_app, response, before)
    assert read.status_code < 500, read.data[:300]


def test_the_reported_inputs_of_the_attack(sample_app: flask.Flask) -> None:
    """A NUL in a path id and JSON nested 1,000 deep are 4xx, not 500."""
    client = sample_app.test_client()
    auth = {"Authorization": "Bearer sk_test_alpha"}
    assert client.get("/v1/payments/%00", headers=auth).status_code == 404
    refund = client.post(
        "/v1/payments/%00/refunds", json={"amount": 1}, headers={**auth, "Idempotency-Key": "nul"}
    )
    assert refund.status_code == 404
    deep = client.post(
        "/v1/payments",
        data=nested(1000),
        content_type="application/json",
        headers={**auth, "Idempotency-Key": "deep"},
    )
    assert deep.status_code == 400, deep.data
    inspect = client.get(
        "/idempotency/requests?endpoint=%00", headers={**auth, "Idempotency-Key": "deep"}
    )
    assert inspect.status_code == 400, inspect.data
