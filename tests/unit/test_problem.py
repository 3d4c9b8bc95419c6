"""problem+json documents (RFC 9457) and key handling, without a database."""

from __future__ import annotations

import datetime as dt
import json
import string
import urllib.parse

import flask
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from werkzeug.datastructures import EnvironHeaders, Headers

from flask_idem import Problem, Record, Scope, State, derive_key
from flask_idem.core.idempotency_keys import (
    KEY_PATTERN,
    InvalidKey,
    echo_of_invalid,
    normalize,
    read_key,
)
from flask_idem.core.problem import KeyReused, RequestInProgress, StoreUnavailableProblem

ALPHABET = string.ascii_letters + string.digits + "-_.:~+/="
NAMES = ("Idempotency-Key", "X-Idempotency-Key")


def test_problem_renders_rfc9457_without_a_handler() -> None:
    app = flask.Flask("problem-test")

    @app.post("/x")
    def x() -> str:
        raise RequestInProgress("still running", retry_after=7)

    response = app.test_client().post("/x")
    assert response.status_code == 409
    assert response.headers["Content-Type"] == "application/problem+json"
    assert response.headers["Retry-After"] == "7"
    document = json.loads(response.data)
    assert document == {
        "type": "tag:flask-idem.readthedocs.io,2026:problems/request-in-progress",
        "title": "Request in progress",
        "status": 409,
        "detail": "still running",
        "instance": "/x",
    }


def test_application_problems_carry_extension_members() -> None:
    problem = Problem(
        "Card declined by the issuer.",
        problem="card-declined",
        status=402,
        title="Card declined",
        extensions={"errors": {"card": ["declined"]}},
    )
    document = json.loads(problem.get_body())
    assert document["type"].endswith("/card-declined") and document["status"] == 402
    assert document["errors"] == {"card": ["declined"]}
    assert problem.get_response().status_code == 402


def test_problem_types_are_absolute_uris_ending_in_their_name() -> None:
    for problem in (KeyReused("x"), StoreUnavailableProblem("y")):
        document = json.loads(problem.get_body())
        # Absolute, and a tag URI (RFC 4151) by default: an identifier the project can mint
        # without owning a web domain, which RFC 9457 allows as a non-resolvable type.
        uri = urllib.parse.urlsplit(document["type"])
        assert uri.scheme == "tag", document["type"]
        assert document["type"].rsplit("/", 1)[1] == problem.problem


@given(st.text(ALPHABET, min_size=1, max_size=255), st.booleans())
@settings(max_examples=200, deadline=None)
def test_every_valid_key_is_read_quoted_or_not(key: str, quoted: bool) -> None:
    value = f'"{key}"' if quoted else key
    assert read_key(Headers({"idempotency-key": value}), NAMES) == key


@given(st.text(min_size=0, max_size=300))
@settings(max_examples=300, deadline=None)
def test_invalid_keys_are_rejected(value: str) -> None:
    stripped = value.strip(" \t")
    inner = (
        stripped[1:-1] if len(stripped) >= 2 and stripped[0] == stripped[-1] == '"' else stripped
    )
    if KEY_PATTERN.fullmatch(inner):
        assert normalize(value) == inner
    else:
        with pytest.raises(InvalidKey):
            normalize(value)


def test_conflicting_headers_are_rejected_and_equal_ones_accepted() -> None:
    assert read_key(Headers([("Idempotency-Key", "a"), ("X-Idempotency-Key", '"a"')]), NAMES) == "a"
    with pytest.raises(InvalidKey, match="different keys"):
        read_key(Headers([("Idempotency-Key", "a"), ("X-Idempotency-Key", "b")]), NAMES)
    with pytest.raises(InvalidKey):
        read_key(Headers([("Idempotency-Key", "a"), ("Idempotency-Key", "b")]), NAMES)
    assert read_key(Headers(), NAMES) is None


def test_request_headers_are_read_from_the_environ_as_the_server_joined_them() -> None:
    # A WSGI server joins a repeated header into one value: two keys never pass as one.
    environ = {"HTTP_IDEMPOTENCY_KEY": "a,b", "HTTP_X_IDEMPOTENCY_KEY": '"c"'}
    with pytest.raises(InvalidKey):
        read_key(EnvironHeaders(environ), NAMES)
    environ = {"HTTP_IDEMPOTENCY_KEY": " a ", "HTTP_X_IDEMPOTENCY_KEY": '"a"'}
    assert read_key(EnvironHeaders(environ), NAMES) == "a"
    with pytest.raises(InvalidKey, match="different keys"):
        read_key(
            EnvironHeaders({"HTTP_IDEMPOTENCY_KEY": "a", "HTTP_X_IDEMPOTENCY_KEY": "b"}), NAMES
        )
    assert read_key(EnvironHeaders({"CONTENT_TYPE": "text/plain"}), NAMES) is None
    assert echo_of_invalid(EnvironHeaders({"HTTP_IDEMPOTENCY_KEY": "a b"}), NAMES) == "a b"
    # Names the environ spells differently are read as before: an underscore never matches
    # the dash-spelled header, and an absent Content-Type (empty in the environ) is no key.
    environ = {"HTTP_IDEMPOTENCY_KEY": "abc", "CONTENT_TYPE": "", "CONTENT_LENGTH": ""}
    assert read_key(EnvironHeaders(environ), ("Idempotency_Key",)) is None
    assert read_key(EnvironHeaders(environ), ("Content-Type", "content-length")) is None


def _record(tenant: str, key: str, created: dt.datetime) -> Record:
    return Record(
        scope=Scope(tenant, "POST /v1/payments", key),
        fingerprint=b"",
        state=State.IN_PROGRESS,
        claim_token="t",
        lease_expires_at=None,
        response=None,
        created_at=created,
        completed_at=None,
        expires_at=created,
        now=created,
    )


@given(st.text(ALPHABET, min_size=1), st.text(ALPHABET, min_size=1), st.text(min_size=1))
@settings(max_examples=100, deadline=None)
def test_derived_keys_depend_on_every_part(key: str, other: str, step: str) -> None:
    created = dt.datetime(2026, 11, 30, 12, tzinfo=dt.timezone.utc)
    record = _record("alpha", key, created)
    derived = derive_key(record, step)
    assert derived == derive_key(record, step)
    assert KEY_PATTERN.fullmatch(derived)
    assert derived != derive_key(_record("beta", key, created), step)
    assert derived != derive_key(record, step + "x")
    elsewhere = created.astimezone(dt.timezone(dt.timedelta(hours=5)))
    assert derived == derive_key(_record("alpha", key, elsewhere), step), "same instant"
    later = created + dt.timedelta(microseconds=1)
    assert derived != derive_key(_record("alpha", key, later), step), "a reused key is new"
    if other != key:
        assert derived != derive_key(_record("alpha", other, created), step)
