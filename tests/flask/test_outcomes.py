"""The outcome model in-process, on both databases: failures after contact with the outside
world never free a key, exceptions are crashes whoever renders them, authorization runs before
any replay, and an answer outlives a request longer than its TTL."""

from __future__ import annotations

import functools
import threading
import time
import typing as t

import flask
import pytest
import sqlalchemy as sa
from flask.views import MethodView

from flask_idem import Idempotency, Scope, State, StoredResponse
from flask_idem.store import SQLStore
from tests.support.answers import post, problem_name
from tests.support.helpers import Counter, shift, with_tables

Factory = t.Callable[..., tuple[flask.Flask, Idempotency, Counter]]
ledger = sa.Table(
    "outcome_ledger",
    sa.MetaData(),
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
)


class FakeProvider:
    """An external service that deduplicates on the downstream key and, the first time it sees
    a key, charges and then loses its answer (the call raises as a timeout would)."""

    def __init__(self) -> None:
        self.charges: dict[str, int] = {}
        self.calls = 0
        self.lock = threading.Lock()

    def charge(self, downstream_key: str, *, time_out_first: bool = True) -> int:
        with self.lock:
            self.calls += 1
            first = downstream_key not in self.charges
            self.charges.setdefault(downstream_key, len(self.charges) + 1)
        if first and time_out_first:
            raise TimeoutError("the provider charged, then the answer was lost")
        return self.charges[downstream_key]


@pytest.fixture
def business(store: SQLStore) -> t.Iterator[sa.Table]:
    """A business table in the store's database, for writes through ``idem.connection()``."""
    with with_tables(store, ledger):
        yield ledger


def _record(store: SQLStore, path: str, key: str = "k") -> t.Any:
    return store.get(Scope("alpha", f"POST {path}", key))


# -- failures after contact with the outside world ------------------------------------------


@pytest.mark.parametrize("failure", ["raise", "502", "504"])
def test_provider_timeout_then_retry_charges_once(app_factory: Factory, failure: str) -> None:
    app, idem, _ = app_factory()
    provider = FakeProvider()

    @app.post("/pay")
    @idem.idempotent(recovery="reexecute", release_before_contact=True)
    def pay() -> t.Any:
        try:
            charge = provider.charge(idem.downstream_key("charge"))
        except TimeoutError:
            if failure == "raise":
                raise
            return {"error": "provider timeout"}, int(failure)
        return {"charge": charge}, 201

    client = app.test_client()
    first = post(client, "k", None, path="/pay")
    assert first.status_code == (500 if failure == "raise" else int(failure))
    retry = post(client, "k", None, path="/pay")
    assert retry.status_code == 201 and "Idempotent-Replayed" not in retry.headers
    assert retry.get_json() == {"charge": 1}
    assert post(client, "k", None, path="/pay").headers["Idempotent-Replayed"] == "true"
    assert len(provider.charges) == 1 and provider.calls == 2, "one charge, one re-run"


@pytest.mark.parametrize("how", ["release_before_contact", "refuse"])
def test_a_retry_that_took_over_never_gives_the_key_back(
    app_factory: Factory, store: SQLStore, how: str
) -> None:
    """A retry that re-runs an unknown outcome and fails before its own contact cannot prove
    the operation did nothing (the first attempt charged): releasing would delete the record,
    and the next retry would charge again under new downstream keys."""
    app, idem, _ = app_factory()
    provider = FakeProvider()
    refusing = {"on": False}

    @app.post("/pay")
    @idem.idempotent(recovery="reexecute", release_before_contact=how == "release_before_contact")
    def pay() -> t.Any:
        if refusing["on"]:
            if how == "refuse":
                return idem.refuse(({"error": "try later"}, 503))
            return {"error": "try later"}, 503
        return {"charge": provider.charge(idem.downstream_key("charge"))}, 201

    client = app.test_client()
    assert post(client, "k", None, path="/pay").status_code == 500, (
        "charged, then the answer was lost"
    )
    refusing["on"] = True
    assert post(client, "k", None, path="/pay").status_code == 503, (
        "the re-run fails before its contact"
    )
    assert _record(store, "/pay").state is State.UNKNOWN, "still the same operation"
    refusing["on"] = False
    assert post(client, "k", None, path="/pay").get_json() == {"charge": 1}
    assert len(provider.charges) == 1, "one downstream key charged for one operation"


def test_provider_timeout_on_a_fail_view_waits_for_reconciliation(
    app_factory: Factory, store: SQLStore
) -> None:
    app, idem, _ = app_factory()
    provider = FakeProvider()

    @app.post("/pay")
    @idem.idempotent(release_before_contact=True)
    def pay() -> t.Any:
        return {"charge": provider.charge(idem.downstream_key("charge"))}, 201

    client = app.test_client()
    assert post(client, "k", None, path="/pay").status_code == 500
    for _ in range(2):
        assert problem_name(post(client, "k", None, path="/pay")) == "outcome-pending"
    assert _record(store, "/pay").state is State.UNKNOWN
    assert provider.calls == 1


def test_a_view_that_declares_nothing_never_releases(app_factory: Factory, store: SQLStore) -> None:
    """The safe default: without ``release_before_contact`` any failure leaves the key unknown."""
    app, idem, counter = app_factory()

    @app.post("/quiet")
    @idem.idempotent
    def quiet() -> t.Any:
        counter.bump()
        if counter.calls == 1:
            raise RuntimeError("an effect may have happened before this")
        return "done", 201

    @app.post("/unavailable")
    @idem.idempotent
    def unavailable() -> t.Any:
        counter.bump()
        return "busy", 503

    client = app.test_client()
    first = post(client, "k", None, path="/quiet")
    assert first.status_code == 500
    assert "may have had an effect" in first.get_json()["detail"]
    assert problem_name(post(client, "k", None, path="/quiet")) == "outcome-pending"
    assert post(client, "k", None, path="/unavailable").status_code == 503
    assert problem_name(post(client, "k", None, path="/unavailable")) == "outcome-pending"
    assert counter.calls == 2
    assert _record(store, "/quiet").state is State.UNKNOWN


@pytest.mark.parametrize("own_handler", [False, True])
def test_a_views_own_abort_500_is_its_answer_without_a_crashs_advice(
    app_factory: Factory, store: SQLStore, own_handler: bool
) -> None:
    """``abort(500)`` is an answer the view chose, stored and replayed like a returned 500:
    its body says what the view said, never the crash's "retry with the same key", which
    every replay of it would repeat (also under an application's ``errorhandler(Exception)``,
    which flask_idem's 500 handler outranks)."""
    app, idem, counter = app_factory()
    if own_handler:

        @app.errorhandler(Exception)
        def everything(error: Exception) -> t.Any:
            return {"error": "the application's"}, 500

    @app.post("/gave-up")
    @idem.idempotent
    def gave_up() -> t.Any:
        counter.bump()
        flask.abort(500, description="The provider refused the charge; see the payment.")

    client = app.test_client()
    first, replay = (
        post(client, "k", None, path="/gave-up"),
        post(client, "k", None, path="/gave-up"),
    )
    for answer in (first, replay):
        assert answer.status_code == 500 and problem_name(answer) == "internal-error"
        assert answer.get_json()["detail"] == "The provider refused the charge; see the payment."
    assert replay.headers["Idempotent-Replayed"] == "true"
    assert counter.calls == 1
    assert _record(store, "/gave-up").state is State.COMPLETED


def test_a_failure_before_contact_releases_when_the_view_release_before_contact(
    app_factory: Factory, store: SQLStore
) -> None:
    app, idem, counter = app_factory()

    @app.post("/validate")
    @idem.idempotent(release_before_contact=True)
    def validate() -> t.Any:
        if counter.bump() == 1:
            raise RuntimeError("before any contact")
        idem.downstream_key("charge")
        return "done", 201

    client = app.test_client()
    first = post(client, "k", None, path="/validate")
    assert first.status_code == 500 and "Nothing was recorded" in first.get_json()["detail"]
    assert post(client, "k", None, path="/validate").status_code == 201
    assert counter.calls == 2


@pytest.mark.parametrize("exception", [SystemExit, KeyboardInterrupt])
def test_system_exit_after_contact_leaves_the_key_unknown(
    app_factory: Factory, store: SQLStore, exception: type[BaseException]
) -> None:
    """gunicorn's worker timeout (SIGABRT) and SIGQUIT/SIGINT raise SystemExit in the view."""
    app, idem, _ = app_factory()
    provider = FakeProvider()

    @app.post("/pay")
    @idem.idempotent(recovery="reexecute", release_before_contact=True)
    def pay() -> t.Any:
        charge = provider.charge(idem.downstream_key("charge"), time_out_first=False)
        if provider.calls == 1:
            raise exception()
        return {"charge": charge}, 201

    client = app.test_client()
    with pytest.raises(exception):
        post(client, "k", None, path="/pay")
    assert _record(store, "/pay").state is State.UNKNOWN
    assert post(client, "k", None, path="/pay").get_json() == {"charge": 1}
    assert len(provider.charges) == 1


def test_store_failing_after_the_charge_tells_the_truth_and_finishes_on_retry(
    app_factory: Factory, store: SQLStore, business: sa.Table
) -> None:
    app, idem, _ = app_factory(IDEMPOTENCY_LEASE=1)
    provider = FakeProvider()

    @app.post("/pay")
    @idem.idempotent(recovery="reexecute", release_before_contact=True)
    def pay() -> t.Any:
        conn = idem.connection()
        charge = provider.charge(idem.downstream_key("charge"), time_out_first=False)
        conn.execute(business.insert())
        if provider.calls == 1:
            conn.invalidate()  # the database goes away before the commit
        return {"charge": charge}, 201

    client = app.test_client()
    failed = post(client, "k", None, path="/pay")
    assert problem_name(failed) == "store-unavailable"
    assert "may have taken effect" in failed.get_json()["detail"]
    assert "nothing was changed" not in failed.get_json()["detail"]
    assert failed.headers["Idempotent-Stored"] == "false", "the 503 is never replayed"
    assert _record(store, "/pay").state is State.UNKNOWN
    retry = post(client, "k", None, path="/pay")
    assert retry.status_code == 201 and retry.get_json() == {"charge": 1}
    assert len(provider.charges) == 1
    with store.engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(business)).scalar() == 1


# -- exceptions are exceptions, whoever renders them ----------------------------------------


def test_a_catch_all_error_handler_stores_and_commits_nothing(
    app_factory: Factory, store: SQLStore, business: sa.Table
) -> None:
    app, idem, counter = app_factory()

    @app.errorhandler(Exception)
    def everything(error: Exception) -> t.Any:
        return {"error": "internal"}, 500

    @app.post("/write")
    @idem.idempotent(release_before_contact=True)
    def write() -> t.Any:
        idem.connection().execute(business.insert())
        if counter.bump() == 1:
            raise ValueError("half-way")
        return "written", 201

    client = app.test_client()
    first = post(client, "k", None, path="/write")
    assert first.status_code == 500 and first.get_json() == {"error": "internal"}
    assert _record(store, "/write") is None, "nothing stored: the key was given back"
    with store.engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(business)).scalar() == 0
    second = post(client, "k", None, path="/write")
    assert second.status_code == 201 and "Idempotent-Replayed" not in second.headers
    assert post(client, "k", None, path="/write").headers["Idempotent-Replayed"] == "true"
    assert counter.calls == 2


def test_a_500_returned_on_purpose_is_stored(app_factory: Factory) -> None:
    app, idem, counter = app_factory()

    @app.errorhandler(Exception)
    def everything(error: Exception) -> t.Any:
        return {"error": "internal"}, 500

    @app.post("/on-purpose")
    @idem.idempotent
    def on_purpose() -> t.Any:
        counter.bump()
        return {"error": "the ledger refused"}, 500

    client = app.test_client()
    post(client, "k", None, path="/on-purpose")
    assert post(client, "k", None, path="/on-purpose").headers["Idempotent-Replayed"] == "true"
    assert counter.calls == 1


# -- authorization before replay -------------------------------------------------------------


def _requires(permission: str) -> t.Callable[[t.Callable[..., t.Any]], t.Callable[..., t.Any]]:
    def decorate(view: t.Callable[..., t.Any]) -> t.Callable[..., t.Any]:
        @functools.wraps(view)
        def checked(*args: t.Any, **kwargs: t.Any) -> t.Any:
            if permission not in flask.request.headers.get("X-Permissions", "write").split():
                flask.abort(403)
            return view(*args, **kwargs)

        return checked

    return decorate


def test_a_restricted_credential_never_sees_a_stored_response(
    app_factory: Factory, store: SQLStore
) -> None:
    app, idem, counter = app_factory()

    @app.post("/refunds")
    @_requires("write")
    @idem.idempotent
    def refund() -> t.Any:
        counter.bump()
        return {"refund": "re_1", "secret": "stored body"}, 201

    client = app.test_client()
    assert post(client, "k", None, path="/refunds").status_code == 201
    for body in (None, b'{"other": 1}'):
        refused = client.post(
            "/refunds", data=body, headers={"Idempotency-Key": "k", "X-Permissions": "read"}
        )
        assert refused.status_code == 403 and b"stored body" not in refused.data
        assert "Idempotent-Replayed" not in refused.headers
    fresh = post(client, "fresh", None, path="/refunds", **{"X-Permissions": "read"})
    assert fresh.status_code == 403
    assert _record(store, "/refunds", "fresh") is None, "no claim for a refused request"
    assert counter.calls == 1


def test_blueprint_protection_claims_after_blueprint_hooks(store: SQLStore) -> None:
    app = flask.Flask("bp")
    idem = Idempotency(store=store, tenant=lambda: "alpha")
    blueprint = flask.Blueprint("orders", __name__)
    calls = Counter()

    @blueprint.before_request
    def authorize() -> None:
        if flask.request.headers.get("X-Permissions") == "read":
            flask.abort(403)

    @blueprint.post("/orders")
    def create_order() -> t.Any:
        calls.bump()
        return "ordered", 201

    idem.protect_blueprint(blueprint)
    idem.init_app(app)
    app.register_blueprint(blueprint)
    client = app.test_client()
    assert post(client, "k", None, path="/orders").status_code == 201
    refused = post(client, "k", None, path="/orders", **{"X-Permissions": "read"})
    assert refused.status_code == 403 and "Idempotent-Replayed" not in refused.headers
    assert post(client, "k", None, path="/orders").headers["Idempotent-Replayed"] == "true"
    assert calls.calls == 1


# -- time ----------------------------------------------------------------------------------------


def test_a_request_longer_than_its_ttl_replays_afterwards(
    app_factory: Factory, store: SQLStore
) -> None:
    app, idem, counter = app_factory()

    @app.post("/long")
    @idem.idempotent(ttl=1)
    def long() -> t.Any:
        counter.bump()
        time.sleep(1.5)
        return "done", 201

    client = app.test_client()
    assert post(client, "k", None, path="/long").status_code == 201
    replay = post(client, "k", None, path="/long")
    assert replay.status_code == 201 and replay.headers["Idempotent-Replayed"] == "true"
    assert counter.calls == 1


# -- replaying what must not be replayed verbatim --------------------------------------------


def test_replay_callable_regenerates_short_lived_values(app_factory: Factory) -> None:
    app, idem, counter = app_factory()
    issued: list[str] = []

    def sign(document: str) -> str:
        url = f"https://files.example/{document}?sig={len(issued)}"
        issued.append(url)
        return url

    def fresh_link(stored: StoredResponse) -> t.Any:
        document = flask.json.loads(stored.body)["document"]
        return {"document": document, "url": sign(document)}, stored.status

    @app.post("/exports")
    @idem.idempotent(replay=fresh_link)
    def export() -> t.Any:
        counter.bump()
        return {"document": "inv-7", "url": sign("inv-7")}, 201

    client = app.test_client()
    first = post(client, "k", None, path="/exports")
    replay = post(client, "k", None, path="/exports")
    assert replay.status_code == 201 and replay.headers["Idempotent-Replayed"] == "true"
    assert replay.get_json()["document"] == "inv-7"
    assert replay.get_json()["url"] != first.get_json()["url"], "a new signature, not the old"
    assert counter.calls == 1


# -- operators -----------------------------------------------------------------------------------


def test_reopened_record_reruns_as_the_same_operation(
    app_factory: Factory, store: SQLStore
) -> None:
    app, idem, _ = app_factory()
    provider = FakeProvider()

    @app.post("/pay")
    @idem.idempotent  # recovery="fail": only an operator or a reconciler settles it
    def pay() -> t.Any:
        return {"charge": provider.charge(idem.downstream_key("charge"))}, 201

    client = app.test_client()
    assert post(client, "k", None, path="/pay").status_code == 500
    assert problem_name(post(client, "k", None, path="/pay")) == "outcome-pending"
    scope = Scope("alpha", "POST /pay", "k")
    token = store.get(scope).claim_token
    assert not store.reopen(scope, token="another"), "fenced by the token seen"
    assert store.reopen(scope, token=token)
    assert not store.reopen(scope, token=token), "only stuck records reopen"
    assert post(client, "k", None, path="/pay").get_json() == {"charge": 1}
    assert len(provider.charges) == 1 and provider.calls == 2


# -- whatever a user writes around the view ---------------------------------------------------


def _no_wraps(view: t.Callable[..., t.Any]) -> t.Callable[..., t.Any]:
    def plain(*args: t.Any, **kwargs: t.Any) -> t.Any:  # no functools.wraps
        return view(*args, **kwargs)

    return plain


def test_a_decorator_without_wraps_keeps_the_view_protected(app_factory: Factory) -> None:
    app, idem, counter = app_factory()

    @app.post("/plain")
    @_no_wraps
    @idem.idempotent(exclude=["client_ts"])
    def plain() -> t.Any:
        counter.bump()
        return "done", 201

    client = app.test_client()
    for n in range(3):
        answer = client.post(
            "/plain", json={"a": 1, "client_ts": n}, headers={"Idempotency-Key": "k"}
        )
        assert answer.status_code == 201
    assert answer.headers["Idempotent-Replayed"] == "true", "the view's own exclude= applies"
    assert counter.calls == 1


def test_a_method_view_is_protected(app_factory: Factory) -> None:
    app, idem, counter = app_factory()

    class Orders(MethodView):
        @idem.idempotent
        def post(self) -> t.Any:
            counter.bump()
            return "ordered", 201

    app.add_url_rule("/orders", view_func=Orders.as_view("orders"))
    client = app.test_client()
    first = post(client, "k", None, path="/orders")
    assert first.headers["Idempotency-Key"] == "k"
    assert post(client, "k", None, path="/orders").headers["Idempotent-Replayed"] == "true"
    assert counter.calls == 1


def test_blueprints_are_protected_wherever_they_are_mounted(store: SQLStore) -> None:
    app = flask.Flask("mounts")
    idem = Idempotency(store=store, tenant=lambda: "alpha")
    calls = Counter()
    payments, api, child = (flask.Blueprint(name, __name__) for name in ("pay", "api", "child"))

    @payments.post("/pay")
    @child.post("/pay")
    def pay() -> t.Any:
        calls.bump()
        return "paid", 201

    idem.protect_blueprint(payments)
    idem.protect_blueprint(child)
    idem.init_app(app)
    app.register_blueprint(payments, url_prefix="/v1")
    app.register_blueprint(payments, url_prefix="/v2", name="payments_v2")
    api.register_blueprint(child, url_prefix="/child")
    app.register_blueprint(api, url_prefix="/api")
    client = app.test_client()
    for path in ("/v1/pay", "/v2/pay", "/api/child/pay"):
        assert post(client, "k", None, path=path).status_code == 201
        assert post(client, "k", None, path=path).headers["Idempotent-Replayed"] == "true", path
    assert calls.calls == 3


def test_an_exception_raised_around_the_view_is_a_crash(
    app_factory: Factory, store: SQLStore, business: sa.Table
) -> None:
    app, idem, _ = app_factory()

    @app.errorhandler(Exception)
    def everything(error: Exception) -> t.Any:
        return {"error": type(error).__name__}, 500

    def fails_afterwards(view: t.Callable[..., t.Any]) -> t.Callable[..., t.Any]:
        @functools.wraps(view)
        def wrapper(*args: t.Any, **kwargs: t.Any) -> t.Any:
            view(*args, **kwargs)
            raise ValueError("the decorator failed after the view")

        return wrapper

    @app.post("/around")
    @fails_afterwards
    @idem.idempotent
    def around() -> t.Any:
        idem.connection().execute(business.insert())
        idem.side_effect()
        return "done", 201

    assert post(app.test_client(), "k", None, path="/around").status_code == 500
    assert _record(store, "/around").state is State.UNKNOWN, "never a stored 500"
    with store.engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(business)).scalar() == 0


def test_a_failing_replay_never_says_nothing_was_recorded(app_factory: Factory) -> None:
    app, idem, counter = app_factory()

    def broken(stored: StoredResponse) -> t.Any:
        raise RuntimeError("cannot sign")

    @app.post("/links")
    @idem.idempotent(replay=broken)
    def links() -> t.Any:
        counter.bump()
        return "link", 201

    client = app.test_client()
    post(client, "k", None, path="/links")
    failed = post(client, "k", None, path="/links")
    assert failed.status_code == 500 and "Nothing was recorded" not in failed.get_json()["detail"]
    assert counter.calls == 1


def test_a_stale_reconciler_verdict_never_settles_a_retry(
    app_factory: Factory, store: SQLStore
) -> None:
    """The reconciler looks the provider up while a retry takes the operation over (and fails
    again): its stale "not happened" must not delete the retry's record."""
    from flask_idem.ops.reconcile import Verdict, reconcile

    app, idem, _ = app_factory()
    provider = FakeProvider()

    @app.post("/pay")
    @idem.idempotent(recovery="reexecute")
    def pay() -> t.Any:
        key = idem.downstream_key("charge")
        if provider.calls == 0:
            provider.calls += 1
            raise ConnectionError("provider unreachable")  # nothing charged
        return {"charge": provider.charge(key)}, 201  # charges, then the answer is lost

    client = app.test_client()

    @idem.reconciler(pay)
    def outcome(record: t.Any) -> Verdict:
        assert post(client, "k", None, path="/pay").status_code == 500, (
            "the retry charged, then failed"
        )
        return Verdict.not_happened("the provider had nothing when asked")

    assert post(client, "k", None, path="/pay").status_code == 500
    with app.app_context():
        [settlement] = list(reconcile(store.stuck()))
    assert settlement.action.value == "skipped"
    assert _record(store, "/pay").state is State.UNKNOWN
    assert post(client, "k", None, path="/pay").get_json() == {"charge": 1}
    assert len(provider.charges) == 1, "one charge: the record was never deleted"


def test_reconcile_finds_views_the_extension_wrapped(store: SQLStore) -> None:
    from flask_idem.ops.reconcile import Verdict, reconcile

    app = flask.Flask("wrapped")
    idem = Idempotency(store=store, tenant=lambda: "alpha")
    blueprint = flask.Blueprint("orders", __name__)

    @blueprint.post("/orders")
    def create_order() -> t.Any:
        raise RuntimeError("died")

    idem.protect_blueprint(blueprint)
    idem.init_app(app)
    app.register_blueprint(blueprint)
    idem.reconciler(create_order)(lambda record: Verdict.happened(("ordered", 201)))
    assert post(app.test_client(), "k", None, path="/orders").status_code == 500
    with app.app_context():
        [settlement] = list(reconcile(store.stuck()))
    assert settlement.action.value == "completed"


def test_a_header_with_a_nul_is_never_stored_as_json(app_factory: Factory, store: SQLStore) -> None:
    app, idem, counter = app_factory()

    @app.post("/nul")
    @idem.idempotent
    def nul() -> t.Any:
        counter.bump()
        return "made", 201, {"Location": "/p/a\x00b"}

    assert post(app.test_client(), "k", None, path="/nul").status_code == 201
    assert _record(store, "/nul").state is State.UNSTORED, "not unknown after a jsonb error"
    assert problem_name(post(app.test_client(), "k", None, path="/nul")) == "response-not-stored"
    assert counter.calls == 1


def test_a_repeated_query_field_keeps_the_order_of_its_values(app_factory: Factory) -> None:
    app, idem, counter = app_factory()

    @app.post("/pick")
    @idem.idempotent
    def pick() -> t.Any:
        counter.bump()
        return {"a": flask.request.args["a"]}, 201

    client = app.test_client()
    assert post(client, "k", None, path="/pick?a=1&a=2&b=x").get_json() == {"a": "1"}
    assert (
        post(client, "k", None, path="/pick?b=x&a=1&a=2").headers["Idempotent-Replayed"] == "true"
    )
    assert (
        problem_name(post(client, "k", None, path="/pick?a=2&a=1&b=x")) == "idempotency-key-reused"
    )
    assert counter.calls == 1


def _record_signals(app: flask.Flask, *names: str) -> list[str]:
    from flask_idem import signals

    seen: list[str] = []
    for name in names:
        getattr(signals, name).connect(
            lambda sender, name=name, **_: seen.append(name), app, weak=False
        )
    return seen


def test_an_atomic_views_store_outage_is_reported(store: SQLStore) -> None:
    app = flask.Flask("atomic-down")
    app.config["IDEMPOTENCY_DATABASE_URL"] = "postgresql://nobody@127.0.0.1:1/none"
    idem = Idempotency(app, tenant=lambda: "alpha")
    seen = _record_signals(app, "store_unavailable")

    @app.post("/atomic")
    @idem.idempotent(atomic=True)
    def atomic() -> t.Any:
        return "never", 201

    assert problem_name(post(app.test_client(), "k", None, path="/atomic")) == "store-unavailable"
    assert seen == ["store_unavailable"]


def test_a_request_that_lost_its_lease_reports_no_transition_it_did_not_make(
    app_factory: Factory, store: SQLStore
) -> None:
    app, idem, _ = app_factory(IDEMPOTENCY_LEASE=1)
    seen = _record_signals(app, "unknown", "released", "lease_lost")

    @app.post("/lost")
    @idem.idempotent
    def lost() -> t.Any:
        idem.side_effect()
        scope = Scope("alpha", "POST /lost", "k")
        record = store.get(scope)
        shift(store, scope, 5, "lease_expires_at")
        assert store.take_over(scope, record.claim_token, lease=30) is not None
        raise RuntimeError("fails after another request took it over")

    assert post(app.test_client(), "k", None, path="/lost").status_code == 500
    assert seen == ["lease_lost"], seen
    assert _record(store, "/lost").state is State.IN_PROGRESS, "the new owner's record"
