"""A protected request's body is read whole and bounded before anything is claimed.

In-process, with WSGI environments shaped like gunicorn's (``wsgi.input_terminated``, a short
read for a cut ``Content-Length`` body, an ``IOError`` for broken chunking); the same faults
over real sockets against gunicorn are in ``test_faults.py``.
"""

from __future__ import annotations

import io
import json
import typing as t

import flask
import pytest

from flask_idem import Idempotency
from flask_idem.store import SQLStore
from tests.support.answers import assert_problem, post
from tests.support.helpers import Counter, record_count

Factory = t.Callable[..., tuple[flask.Flask, Idempotency, Counter]]


class _Broken(io.RawIOBase):
    """A chunked body whose connection breaks after ``good`` bytes (gunicorn's NoMoreData)."""

    def __init__(self, good: bytes) -> None:
        self.good = io.BytesIO(good)

    def readable(self) -> bool:
        return True

    def read(self, size: int = -1) -> bytes:
        chunk = self.good.read(size)
        if not chunk:
            raise OSError("No more data after: b''")
        return chunk


BODY = json.dumps({"amount": 4200, "currency": "eur"}).encode()
#: The type of a body the WSGI environ hands over (``wsgi.input``) rather than the test client.
JSON: t.Final = {"Content-Type": "application/json"}


def test_a_short_content_length_body_is_400_and_the_full_retry_runs(
    store: SQLStore, app_factory: Factory
) -> None:
    app, _, counter = app_factory()
    client = app.test_client()
    cut = post(
        client,
        "cut",
        None,
        environ={
            "wsgi.input": io.BytesIO(BODY[:10]),
            "wsgi.input_terminated": True,
            "CONTENT_LENGTH": str(len(BODY)),
        },
        **JSON,
    )
    assert_problem(cut, 400, "request-body-incomplete")
    assert cut.headers["Idempotency-Key"] == "cut"
    assert (counter.calls, record_count(store)) == (0, 0), "refused before any claim"
    full = post(client, "cut", BODY)
    assert full.status_code == 201, full.data
    assert full.get_json()["amount"] == 4200


def test_a_broken_chunked_body_is_400_not_500(store: SQLStore, app_factory: Factory) -> None:
    app, _, counter = app_factory()
    cut = post(
        app.test_client(),
        "chunked",
        None,
        environ={"wsgi.input": _Broken(BODY[:10]), "wsgi.input_terminated": True},
        **JSON,
    )
    assert_problem(cut, 400, "request-body-incomplete")
    assert (counter.calls, record_count(store)) == (0, 0)


@pytest.mark.parametrize("declared", [True, False])
def test_a_body_over_the_limit_is_413(
    store: SQLStore, app_factory: Factory, declared: bool
) -> None:
    app, _, counter = app_factory(IDEMPOTENCY_MAX_REQUEST_BODY=100)
    big = json.dumps({"amount": 1, "note": "x" * 200}).encode()
    environ: dict[str, t.Any] = {"wsgi.input": io.BytesIO(big), "wsgi.input_terminated": True}
    if declared:
        environ["CONTENT_LENGTH"] = str(len(big))
    assert_problem(
        post(app.test_client(), "big", None, environ=environ, **JSON), 413, "request-body-too-large"
    )
    assert (counter.calls, record_count(store)) == (0, 0)
    exact = json.dumps({"amount": 1, "note": "x" * (100 - 25)}).encode()
    assert len(exact) == 100
    assert post(app.test_client(), "exact", exact).status_code == 201


def test_the_view_reads_the_same_body_and_form_data(app_factory: Factory) -> None:
    app, idem, _ = app_factory()

    @app.post("/form")
    @idem.idempotent
    def form() -> t.Any:
        return {"form": flask.request.form.to_dict(), "raw": flask.request.get_data(as_text=True)}

    response = app.test_client().post(
        "/form",
        data={"a": "1", "b": "2"},
        headers={"Idempotency-Key": "form"},
        environ_overrides={"wsgi.input_terminated": True},
    )
    assert response.get_json() == {"form": {"a": "1", "b": "2"}, "raw": "a=1&b=2"}


def test_a_whole_chunked_body_reaches_the_fingerprint_and_the_view(app_factory: Factory) -> None:
    app, _, counter = app_factory()
    client = app.test_client()

    def chunked(body: bytes) -> t.Any:
        environ = {
            "wsgi.input": io.BytesIO(body),
            "wsgi.input_terminated": True,
            "HTTP_TRANSFER_ENCODING": "chunked",
            "CONTENT_LENGTH": None,
        }
        return post(client, "whole-chunked", None, environ=environ, **JSON)

    first = chunked(BODY)
    assert first.status_code == 201 and first.get_json()["amount"] == 4200, "the view saw it"
    other = json.dumps({"amount": 9999, "currency": "usd"}).encode()
    assert_problem(chunked(other), 422, "idempotency-key-reused")
    assert chunked(BODY).headers["Idempotent-Replayed"] == "true"
    assert counter.calls == 1


@pytest.mark.parametrize("then_raw", [False, True])
@pytest.mark.parametrize("chunked", [False, True])
def test_a_form_parsed_by_a_hook_before_the_claim_is_still_fingerprinted(
    store: SQLStore, app_factory: Factory, chunked: bool, then_raw: bool
) -> None:
    """CSRF protection reads ``request.form`` in ``before_request``: werkzeug keeps the
    fields and spends the stream. The retry replays, another form is 422, never a replay of
    an empty body's fingerprint."""
    app, idem, counter = app_factory(IDEMPOTENCY_MAX_REQUEST_BODY=1000)

    @app.before_request
    def csrf() -> None:
        flask.request.form.get("csrf_token")
        if then_raw:
            flask.request.get_data()  # a signing or logging hook after it: b"" by now

    @app.post("/transfers")
    @idem.idempotent
    def transfer() -> t.Any:
        counter.bump()
        return {"to": flask.request.form["to"]}, 201

    client = app.test_client()

    def send(body: bytes) -> t.Any:
        environ: dict[str, t.Any] = {"wsgi.input": io.BytesIO(body), "wsgi.input_terminated": True}
        if chunked:
            environ |= {"HTTP_TRANSFER_ENCODING": "chunked", "CONTENT_LENGTH": None}
        return client.post(
            "/transfers",
            data=body,
            content_type="application/x-www-form-urlencoded",
            headers={"Idempotency-Key": f"form-{chunked}"},
            environ_overrides=environ,
        )

    # 603 bytes, well within the limit; escaped again, 1,803 ("/" is "%2F").
    to = b"https://bank.example/" + b"/" * 580
    first = send(b"amount=100&csrf_token=t&to=" + to)
    assert (first.status_code, first.get_json()) == (201, {"to": to.decode()}), first.data
    again = send(b"to=" + to + b"&amount=100&csrf_token=t")
    assert again.headers["Idempotent-Replayed"] == "true"
    assert_problem(send(b"amount=999999&to=mallory&csrf_token=t"), 422, "idempotency-key-reused")
    assert counter.calls == 1


@pytest.mark.parametrize("then_raw", [False, True])
def test_a_multipart_form_parsed_before_the_claim_is_refused(
    store: SQLStore, app_factory: Factory, then_raw: bool
) -> None:
    app, idem, counter = app_factory()

    @app.before_request
    def csrf() -> None:
        flask.request.form.get("csrf_token")
        if then_raw:
            flask.request.get_data()

    @app.post("/uploads")
    @idem.idempotent
    def upload() -> t.Any:
        counter.bump()
        return "stored", 201

    response = app.test_client().post(
        "/uploads",
        data={"csrf_token": "t", "file": (io.BytesIO(b"invoice"), "invoice.pdf")},
        headers={"Idempotency-Key": "multipart"},
    )
    assert_problem(response, 500, "internal-error")
    assert (counter.calls, record_count(store)) == (0, 0)


@pytest.mark.parametrize("where", ["config", "request"])
def test_the_applications_own_body_limit_still_holds_with_a_key(
    store: SQLStore, app_factory: Factory, where: str
) -> None:
    """``MAX_CONTENT_LENGTH`` (or Flask 3.1's per-request ``max_content_length``) is the
    application's limit: reading the body for the fingerprint must enforce it as werkzeug
    does, before any claim."""
    config = {"MAX_CONTENT_LENGTH": 16} if where == "config" else {}
    app, _, counter = app_factory(**config)
    if where == "request":

        @app.before_request
        def limit() -> None:
            flask.request.max_content_length = 16

    big = json.dumps({"amount": 1, "note": "x" * 64}).encode()
    assert post(app.test_client(), "big", big).status_code == 413
    assert (counter.calls, record_count(store)) == (0, 0)
