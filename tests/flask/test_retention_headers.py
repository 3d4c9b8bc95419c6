"""What the first caller learns about retries: ``Idempotent-Stored: false`` on every answer of a
request that held the key and that no retry will get back (released, left ``unknown``, lost to
a takeover), and on stored answers and replays ``Idempotency-Retention``, the whole seconds the
key still replays the answer. ``<prefix>/policy`` advertises the defaults to anyone."""

from __future__ import annotations

import typing as t

import flask
import pytest
import sqlalchemy as sa

from flask_idem import Idempotency, Scope
from flask_idem.store import SQLStore
from flask_idem.store.table import idempotency_keys
from flask_idem.testing import age_record
from tests.support.answers import assert_problem, post
from tests.support.helpers import Counter

Factory = t.Callable[..., tuple[flask.Flask, Idempotency, Counter]]


@pytest.fixture
def views(app_factory: Factory, store: SQLStore) -> tuple[flask.Flask, Counter]:
    """The payments app and views ending each way a first answer can end unreplayed."""
    app, idem, counter = app_factory()

    @app.post("/crash")
    @idem.idempotent
    def crash() -> t.Any:
        counter.bump()
        raise RuntimeError("the provider's SDK blew up")

    @app.post("/refuse")
    @idem.idempotent
    def refuse() -> t.Any:
        counter.bump()
        idem.refuse(({"error": "daily limit reached"}, 429))

    @app.post("/short")
    @idem.idempotent(ttl=120)
    def short() -> t.Any:
        counter.bump()
        return {"ok": True}, 201

    @app.post("/taken")
    @idem.idempotent
    def taken() -> t.Any:
        counter.bump()
        # A retry took the record over meanwhile (its lease ran out): the claim token changes.
        with store.engine.begin() as conn:
            conn.execute(
                sa.update(idempotency_keys)
                .where(idempotency_keys.c.key == store.keys.stored("alpha", "taken-1"))
                .values(claim_token="taken-by-a-retry")
            )
        return {"paid": True}, 201

    return app, counter


def test_a_stored_answer_and_its_replays_say_how_long_the_key_is_kept(
    views: tuple[flask.Flask, Counter], store: SQLStore
) -> None:
    app, _ = views
    client = app.test_client()
    first = post(client, "kept-1")
    assert first.status_code == 201 and "Idempotent-Stored" not in first.headers
    assert first.headers["Idempotency-Retention"] == "86400"
    replay = post(client, "kept-1")
    assert replay.headers["Idempotent-Replayed"] == "true"
    assert 86390 <= int(replay.headers["Idempotency-Retention"]) <= 86400
    age_record(store, Scope("alpha", "POST /payments", "kept-1"), 3600)
    later = post(client, "kept-1")
    assert 82790 <= int(later.headers["Idempotency-Retention"]) <= 82800, "the time left"


def test_a_views_own_ttl_is_the_retention_it_announces(
    views: tuple[flask.Flask, Counter],
) -> None:
    app, _ = views
    client = app.test_client()
    assert post(client, "short-1", path="/short").headers["Idempotency-Retention"] == "120"
    assert 110 <= int(post(client, "short-1", path="/short").headers["Idempotency-Retention"])


def test_a_stored_4xx_is_replayed_and_says_so(views: tuple[flask.Flask, Counter]) -> None:
    app, counter = views
    client = app.test_client()
    first = post(client, "bad-1", path="/status/400")
    assert first.status_code == 400 and "Idempotent-Stored" not in first.headers
    assert first.headers["Idempotency-Retention"] == "86400"
    assert post(client, "bad-1", path="/status/400").headers["Idempotent-Replayed"] == "true"
    assert counter.calls == 1


@pytest.mark.parametrize(
    ("path", "status", "retry"),
    [
        ("/crash", 500, "outcome-pending"),  # unknown: the crash may have charged
        ("/refuse", 429, None),  # released: the retry runs the view again
        ("/status/503", 503, None),  # a never-stored status, released before contact
        ("/taken", 409, "request-in-progress"),  # the taker's record
    ],
)
def test_an_answer_no_retry_gets_back_says_so(
    views: tuple[flask.Flask, Counter], path: str, status: int, retry: str | None
) -> None:
    app, counter = views
    client = app.test_client()
    key = "taken-1" if path == "/taken" else "once-1"
    first = post(client, key, path=path)
    assert first.status_code == status, first.data
    assert first.headers["Idempotent-Stored"] == "false"
    assert "Idempotency-Retention" not in first.headers
    second = post(client, key, path=path)
    assert "Idempotent-Replayed" not in second.headers
    if retry is None:
        assert second.status_code == status and counter.calls == 2, "released: it ran again"
    else:
        assert_problem(second, 409, retry)
        assert counter.calls == 1
        if retry == "outcome-pending":
            assert second.headers["Retry-After"] == "300", "the reconcile cron's period"


def test_answers_before_any_claim_make_no_promise(views: tuple[flask.Flask, Counter]) -> None:
    """A 400 for a missing key or a 422 for a reused one is no first answer: nothing to say
    about replays."""
    app, _ = views
    client = app.test_client()
    missing = post(client, None)
    assert missing.status_code == 400
    post(client, "k-1")
    reused = post(client, "k-1", body={"amount": 1})
    assert reused.status_code == 422
    for answer in (missing, reused):
        assert "Idempotent-Stored" not in answer.headers
        assert "Idempotency-Retention" not in answer.headers


def test_the_policy_document_is_public_and_names_no_tenant(app_factory: Factory) -> None:
    app, _, _ = app_factory(
        tenant=None, IDEMPOTENCY_TTL=3600.5, IDEMPOTENCY_KEY_RATE_LIMIT="100/minute"
    )
    response = app.test_client().get("/idempotency/policy")
    assert response.status_code == 200, response.data
    assert response.get_json() == {
        "header": "Idempotency-Key",
        "methods": ["PATCH", "POST"],
        "key_required": True,
        "retention_seconds": 3600,
        "key_rate_limit": "100/minute",
    }
    assert response.headers["Cache-Control"] == "public, max-age=300"


def test_the_policy_document_follows_the_blueprint_prefix(app_factory: Factory) -> None:
    app, _, _ = app_factory(IDEMPOTENCY_BLUEPRINT_PREFIX="/_idem")
    assert app.test_client().get("/_idem/policy").get_json()["key_rate_limit"] is None
    off, _, _ = app_factory(IDEMPOTENCY_BLUEPRINT_PREFIX=None)
    assert off.test_client().get("/idempotency/policy").status_code == 404
