"""Extension conventions: init_app, configuration, per-view, blueprint and app-wide modes."""

from __future__ import annotations

import typing as t

import flask
import pytest

from flask_idem import ConfigurationError, Idempotency
from flask_idem.store import SQLStore


def _app(**config: t.Any) -> flask.Flask:
    app = flask.Flask("ext-test")
    app.config.update(config)
    return app


def test_init_app_registers_once_and_keeps_no_app(store: SQLStore) -> None:
    idem = Idempotency(store=store, tenant=lambda: "t")
    first, second = _app(), _app()
    idem.init_app(first)
    idem.init_app(second)
    assert first.extensions["idempotency"].extension is idem
    assert not hasattr(idem, "app")
    with pytest.raises(RuntimeError, match="already registered"):
        idem.init_app(first)


def test_missing_database_says_what_to_do() -> None:
    with pytest.raises(ConfigurationError, match="IDEMPOTENCY_DATABASE_URL"):
        Idempotency(_app())


def test_database_url_config_builds_the_store(db_url: str) -> None:
    app = _app(IDEMPOTENCY_DATABASE_URL=db_url)
    Idempotency(app, tenant=lambda: "t")
    state = app.extensions["idempotency"]
    assert state.store.dialect == ("sqlite" if db_url.startswith("sqlite") else "postgresql")
    state.store.engine.dispose()


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("IDEMPOTENCY_TTL", 0, "IDEMPOTENCY_TTL must be at least"),
        ("IDEMPOTENCY_TTL", "soon", "IDEMPOTENCY_TTL must be a number"),
        ("IDEMPOTENCY_METHODS", ["FETCH"], "IDEMPOTENCY_METHODS"),
        ("IDEMPOTENCY_HEADER", "Bad Header", "not an HTTP header name"),
        ("IDEMPOTENCY_NEVER_STORE", [700], "IDEMPOTENCY_NEVER_STORE"),
        ("IDEMPOTENCY_PROBLEM_BASE", "problems", "absolute URI"),
        ("IDEMPOTENCY_MAX_BODY", 1.5, "whole number"),
        ("IDEMPOTENCY_KEY_REQUIRED", "maybe", "true or false"),
        ("IDEMPOTENCY_WAIT", -1, "IDEMPOTENCY_WAIT must be at least"),
        ("IDEMPOTENCY_ENGINE", "sqlite://", "Engine"),
        # Non-finite or huge values never reach the database's intervals.
        ("IDEMPOTENCY_TTL", "nan", "IDEMPOTENCY_TTL must be a finite number"),
        ("IDEMPOTENCY_TTL", float("nan"), "IDEMPOTENCY_TTL must be a finite number"),
        ("IDEMPOTENCY_TTL", "inf", "IDEMPOTENCY_TTL must be a finite number"),
        ("IDEMPOTENCY_TTL", 1e300, "IDEMPOTENCY_TTL must be at most"),
        ("IDEMPOTENCY_LEASE", "-inf", "IDEMPOTENCY_LEASE must be a finite number"),
        ("IDEMPOTENCY_LEASE", 10**6, "IDEMPOTENCY_LEASE must be at most"),
        ("IDEMPOTENCY_WAIT", "nan", "IDEMPOTENCY_WAIT must be a finite number"),
        ("IDEMPOTENCY_WAIT", 3600, "IDEMPOTENCY_WAIT must be at most"),
        ("IDEMPOTENCY_MAX_BODY", float("inf"), "IDEMPOTENCY_MAX_BODY must be a number"),
        ("IDEMPOTENCY_MAX_REQUEST_BODY", 2**40, "IDEMPOTENCY_MAX_REQUEST_BODY must be at most"),
        ("IDEMPOTENCY_MAX_REQUEST_BODY", -1, "IDEMPOTENCY_MAX_REQUEST_BODY must be at least"),
        ("IDEMPOTENCY_PARTITIONS_AHEAD", 10**9, "IDEMPOTENCY_PARTITIONS_AHEAD must be at most"),
        ("IDEMPOTENCY_TTL", True, "IDEMPOTENCY_TTL must be a number"),
    ],
)
def test_bad_config_fails_in_init_app(
    store: SQLStore, key: str, value: t.Any, message: str
) -> None:
    with pytest.raises(ConfigurationError, match=message):
        Idempotency(_app(**{key: value}), store=store)


@pytest.mark.parametrize("lease", [None, "3"])
def test_prefixed_env_values_are_accepted(
    store: SQLStore, monkeypatch: pytest.MonkeyPatch, lease: str | None
) -> None:
    # A lease longer than the TTL is fine: a record in progress lives as long as its lease.
    monkeypatch.setenv("FLASK_IDEMPOTENCY_TTL", "2")
    if lease is not None:
        monkeypatch.setenv("FLASK_IDEMPOTENCY_LEASE", lease)
    app = _app()
    app.config.from_prefixed_env()
    Idempotency(app, store=store)
    settings = app.extensions["idempotency"].settings
    assert (settings.ttl, settings.lease) == (2, 3 if lease else 30)


def test_bad_view_options_fail_at_decoration(store: SQLStore) -> None:
    idem = Idempotency(store=store)
    with pytest.raises(ConfigurationError, match="recovery"):
        idem.idempotent(recovery="retry")  # type: ignore[call-overload]
    with pytest.raises(ConfigurationError, match="either fingerprint"):
        idem.idempotent(fingerprint=lambda r: b"", exclude=["a"])


def _protected(app: flask.Flask, path: str, **headers: str) -> bool:
    """Whether a second identical POST was replayed."""
    client = app.test_client()
    client.post(path, headers={"Idempotency-Key": "k", **headers})
    second = client.post(path, headers={"Idempotency-Key": "k", **headers})
    return second.headers.get("Idempotent-Replayed") == "true"


def test_app_wide_mode_and_exemption(store: SQLStore) -> None:
    app = _app(IDEMPOTENCY_PROTECT_ALL=True)
    idem = Idempotency(app, store=store, tenant=lambda: "t")
    calls: list[str] = []

    @app.post("/a")
    def a() -> str:
        calls.append("a")
        return "a"

    @app.post("/b")
    @idem.exempt
    def b() -> str:
        calls.append("b")
        return "b"

    assert _protected(app, "/a")
    assert not _protected(app, "/b")
    assert calls == ["a", "b", "b"]
    assert app.test_client().post("/a").status_code == 400, "app-wide mode requires keys"


def test_blueprint_wide_mode(store: SQLStore) -> None:
    app = _app()
    idem = Idempotency(store=store, tenant=lambda: "t")
    api = flask.Blueprint("api", __name__)
    idem.protect_blueprint(api, ttl=60)

    @api.post("/x")
    def x() -> str:
        return "x"

    @app.post("/y")
    def y() -> str:
        return "y"

    app.register_blueprint(api, url_prefix="/api")
    idem.init_app(app)
    assert _protected(app, "/api/x")
    assert not _protected(app, "/y")


def test_protected_methods_are_configurable(store: SQLStore) -> None:
    app = _app(IDEMPOTENCY_METHODS=["PUT"])
    idem = Idempotency(app, store=store, tenant=lambda: "t")

    @app.route("/r", methods=["POST", "PUT"])
    @idem.idempotent
    def r() -> str:
        return flask.request.method

    client = app.test_client()
    for method in ("put", "post"):
        getattr(client, method)("/r", headers={"Idempotency-Key": "k"})
    replay = client.put("/r", headers={"Idempotency-Key": "k"})
    assert replay.headers.get("Idempotent-Replayed") == "true"
    post = client.post("/r", headers={"Idempotency-Key": "k"})
    assert "Idempotent-Replayed" not in post.headers


def test_custom_fingerprint_and_include(store: SQLStore) -> None:
    app = _app()
    idem = Idempotency(app, store=store, tenant=lambda: "t")

    @app.post("/custom")
    @idem.idempotent(fingerprint=lambda request: request.get_json()["order"])
    def custom() -> str:
        return "ok"

    @app.post("/include")
    @idem.idempotent(include=["amount"])
    def include() -> str:
        return "ok"

    client = app.test_client()
    client.post("/custom", json={"order": "o1", "note": "a"}, headers={"Idempotency-Key": "k"})
    same = client.post(
        "/custom", json={"order": "o1", "note": "b"}, headers={"Idempotency-Key": "k"}
    )
    assert same.headers.get("Idempotent-Replayed") == "true"
    other = client.post("/custom", json={"order": "o2"}, headers={"Idempotency-Key": "k"})
    assert other.status_code == 422
    client.post("/include", json={"amount": 1, "note": "a"}, headers={"Idempotency-Key": "k"})
    again = client.post(
        "/include", json={"amount": 1, "note": "b"}, headers={"Idempotency-Key": "k"}
    )
    assert again.headers.get("Idempotent-Replayed") == "true"


def test_per_view_ttl_is_stored(store: SQLStore) -> None:
    app = _app()
    idem = Idempotency(app, store=store, tenant=lambda: "t")

    @app.post("/short")
    @idem.idempotent(ttl=120)
    def short() -> str:
        return "ok"

    app.test_client().post("/short", headers={"Idempotency-Key": "k"})
    from flask_idem import Scope

    record = store.get(Scope("t", "POST /short", "k"))
    assert record is not None
    assert 119 <= (record.expires_at - record.created_at).total_seconds() <= 120


def test_async_views_are_supported(store: SQLStore) -> None:
    app = _app()
    idem = Idempotency(app, store=store, tenant=lambda: "t")

    @app.post("/async")
    @idem.idempotent
    async def async_view() -> str:
        return "async"

    assert _protected(app, "/async")


def test_an_applications_own_ensure_sync_still_wraps_protected_views(store: SQLStore) -> None:
    """The guard skips Flask's ensure_sync for plain views (it returns them as they are), but
    not an application's override of it, on the class or the instance."""
    wrapped: list[str] = []

    def counted(app: flask.Flask, func: t.Callable[..., t.Any]) -> t.Callable[..., t.Any]:
        wrapped.append(getattr(func, "__name__", "?"))
        return flask.Flask.ensure_sync(app, func)

    class App(flask.Flask):
        ensure_sync = counted

    on_instance = _app()
    on_instance.ensure_sync = lambda func: counted(on_instance, func)  # type: ignore[method-assign]
    for app in (App("own-ensure-sync"), on_instance):
        idem = Idempotency(app, store=store, tenant=lambda: "t")

        @app.post("/sync")
        @idem.idempotent
        def sync_view() -> tuple[str, int]:
            return "done", 201

        wrapped.clear()
        assert app.test_client().post("/sync", headers={"Idempotency-Key": "k1"}).status_code == 201
        assert wrapped.count("sync_view") == 2, wrapped  # Flask's dispatch, then the guard's


def test_application_500_handler_wins(store: SQLStore) -> None:
    app = _app(PROPAGATE_EXCEPTIONS=False)

    @app.errorhandler(500)
    def handler(error: Exception) -> tuple[str, int]:
        return "custom", 500

    idem = Idempotency(app, store=store, tenant=lambda: "t")

    @app.post("/boom")
    @idem.idempotent
    def boom() -> str:
        raise RuntimeError("boom")

    response = app.test_client().post("/boom", headers={"Idempotency-Key": "k"})
    assert response.status_code == 500 and response.data == b"custom"


@pytest.mark.parametrize("ttl", [float("nan"), float("inf"), 1e300, 0, -1, 0.001])
def test_a_per_view_ttl_keeps_to_the_bounds_of_IDEMPOTENCY_TTL(ttl: float) -> None:
    idem = Idempotency(store=None, tenant=lambda: "t")
    with pytest.raises(ConfigurationError, match=r"ttl= \(overrides IDEMPOTENCY_TTL\)"):
        idem.idempotent(ttl=ttl)


@pytest.mark.parametrize(("option", "value"), [("lease", 0.0001), ("lease", 1e300), ("ttl", 0)])
def test_a_job_option_keeps_to_the_bounds_of_its_config_key(option: str, value: float) -> None:
    """A lease of a tenth of a millisecond would renew in a busy loop against the database."""
    idem = Idempotency(store=None)
    with pytest.raises(ConfigurationError, match=f"{option}= \\(overrides IDEMPOTENCY_"):
        idem.job("renew", key="order_id", tenant="merchant", **{option: value})
