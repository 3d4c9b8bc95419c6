"""Answers larger than ``IDEMPOTENCY_MAX_BODY``. A 4xx of an attempt that provably committed
nothing is not kept as ``unstored`` (every retry would get 409 for a request that only needs
fixing): the key is given back and a retry gets the same 4xx again. Any other such answer
(a 2xx, or a 4xx after contact) is ``unstored``: the first caller's answer says it will not
be replayed (``Idempotent-Stored: false``) and retries get 409 ``response-not-stored`` saying
that the operation ran."""

from __future__ import annotations

import functools
import json
import os
import typing as t
from pathlib import Path

import flask
import pytest

from flask_idem import Idempotency, Scope, State
from flask_idem.store import SQLStore
from tests.support.answers import BASE, post
from tests.support.helpers import Counter

LIMIT = 4096
HUGE = "x" * (LIMIT * 2)

App = tuple[flask.Flask, Idempotency, Counter]


@pytest.fixture
def oversized(app_factory: t.Callable[..., App]) -> App:
    """Views answering more than ``IDEMPOTENCY_MAX_BODY``, each with another claim."""
    app, idem, counter = app_factory(IDEMPOTENCY_MAX_BODY=LIMIT)

    def answer(status: int) -> t.Any:
        counter.bump()
        return flask.jsonify(errors=HUGE), status

    @app.post("/validated")
    @idem.idempotent(release_before_contact=True)
    def validated() -> t.Any:
        return answer(int(flask.request.args.get("status", "400")))

    @app.post("/atomic")
    @idem.idempotent(atomic=True)
    def atomic() -> t.Any:
        return answer(400)

    @app.post("/contacted")
    @idem.idempotent(release_before_contact=True)
    def contacted() -> t.Any:
        idem.downstream_key("charge")
        return answer(int(flask.request.args.get("status", "402")))

    return app, idem, counter


_post = functools.partial(post, key="big-1", body={})


def _record_state(store: SQLStore, path: str) -> State | None:
    record = store.get(Scope("alpha", f"POST {path}", "big-1"))
    return None if record is None else record.state


@pytest.mark.parametrize("path", ["/validated", "/atomic"])
def test_a_4xx_too_large_to_store_frees_the_key_and_the_retry_gets_it_again(
    oversized: App, store: SQLStore, path: str
) -> None:
    app, _, counter = oversized
    for attempt in range(1, 4):
        response = _post(app, path=path)
        assert response.status_code == 400, response.data
        assert response.json == {"errors": HUGE}
        assert "Idempotent-Replayed" not in response.headers
        assert response.headers["Idempotent-Stored"] == "false", "given back, never replayed"
        assert counter.calls == attempt, "the retry ran the view again: nothing was kept"
    assert _record_state(store, path) is None


@pytest.mark.parametrize(
    ("path", "status"),
    [("/validated?status=201", 201), ("/contacted", 402), ("/contacted?status=201", 201)],
)
def test_an_answer_too_large_to_store_after_it_ran_says_so_to_everyone(
    oversized: App, store: SQLStore, path: str, status: int
) -> None:
    app, _, counter = oversized
    first = _post(app, path=path)
    assert first.status_code == status and first.json == {"errors": HUGE}
    assert first.headers["Idempotent-Stored"] == "false"
    for _ in range(2):
        retry = _post(app, path=path)
        assert retry.status_code == 409 and retry.mimetype == "application/problem+json"
        assert retry.json["type"] == BASE + "response-not-stored"
        assert "IDEMPOTENCY_MAX_BODY" in retry.json["detail"]
        assert "not executed again" in retry.json["detail"]
    assert counter.calls == 1
    assert _record_state(store, path.partition("?")[0]) is State.UNSTORED


@pytest.fixture(scope="module")
def sample_app(tmp_path_factory: pytest.TempPathFactory) -> flask.Flask:
    from tests.support.sample_server import migrate

    path: Path = tmp_path_factory.mktemp("oversized-sample") / "sample.sqlite3"
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


def _charge(app: flask.Flask, key: str, body: bytes) -> t.Any:
    return app.test_client().post(
        "/v1/payments",
        data=body,
        content_type="application/json",
        headers={"Authorization": "Bearer sk_test_alpha", "Idempotency-Key": key},
    )


def test_the_sample_answers_a_huge_invalid_request_with_its_400_every_time(
    sample_app: flask.Flask,
) -> None:
    """A 1 MB body with 60,000 invalid fields: its 400 lists them all (over 1 MiB, more than
    the sample stores), and the retry gets the same 400 again instead of 409 forever."""
    body = json.dumps({f"f{n}": 0 for n in range(60_000)} | {"pad": "x" * 150_000}).encode()
    assert 900_000 < len(body) < 1024 * 1024
    first = _charge(sample_app, "huge-invalid-1", body)
    assert first.status_code == 400 and len(first.get_data()) > 1024 * 1024
    for _ in range(2):
        retry = _charge(sample_app, "huge-invalid-1", body)
        assert retry.status_code == 400, retry.data[:300]
        assert retry.get_data() == first.get_data()


def test_the_sample_bounds_the_description_its_201_echoes_so_that_it_always_replays(
    sample_app: flask.Flask,
) -> None:
    """A 300 KB description got 201, then every retry 409 response-not-stored. The sample now
    bounds the description its 201 echoes: at the bound, every character escaped to 12 bytes,
    the 201 is stored and replays; past it, a 400 before any charge, and the same 400 on the
    retry."""
    from sample_app import schemas

    wide = "\U0001f600"
    widest = {
        "amount": 4200,
        "currency": "eur",
        "customer": wide * 255,
        "description": wide * schemas.DESCRIPTION_MAX,
    }
    first = _charge(sample_app, "widest-1", json.dumps(widest).encode())
    assert first.status_code == 201, first.data[:300]
    assert len(first.get_data()) > 12 * schemas.DESCRIPTION_MAX
    assert "Idempotent-Stored" not in first.headers
    retry = _charge(sample_app, "widest-1", json.dumps(widest).encode())
    assert retry.status_code == 201 and retry.headers["Idempotent-Replayed"] == "true"
    assert retry.get_data() == first.get_data()
    for length in (schemas.DESCRIPTION_MAX + 1, 300_000):
        body = json.dumps({**widest, "description": "d" * length}).encode()
        for _ in range(2):
            response = _charge(sample_app, f"too-long-{length}", body)
            assert response.status_code == 400, response.data[:300]
            assert response.json["type"].endswith("/invalid-request")
            assert "description" in response.json["errors"]
