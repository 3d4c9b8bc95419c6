"""Stored responses at rest: encryption (rotation, moved ciphertexts, missing keys), compression,
``flask idem keys``, and database dumps that hold no body in clear, on both databases."""

from __future__ import annotations

import base64
import contextlib
import datetime as dt
import functools
import json
import logging
import os
import subprocess
import typing as t
import uuid
import zlib
from pathlib import Path

import flask
import pytest
import sqlalchemy as sa
from click.testing import Result

from flask_idem import ConfigurationError, Idempotency, Scope, State, StoredResponse
from flask_idem.core.config import Settings
from flask_idem.core.fingerprint import fingerprint
from flask_idem.core.key_digest import unkeyed
from flask_idem.core.sealing import (
    COMPRESSED,
    ENCRYPTED,
    HEADER_SIZE,
    KEY_ID_OFFSET,
    MAGIC,
    EncryptionKey,
    Sealer,
    generate_key,
    parse_keys,
)
from flask_idem.ops.migrate import upgrade
from flask_idem.ops.reconcile import Verdict, reconcile
from flask_idem.store import SQLStore, create_store
from tests.support import pgcluster
from tests.support.answers import assert_problem, post
from tests.support.helpers import Counter, shift

PAYMENTS = "POST /payments"
CREATED = dt.datetime(2026, 12, 1, 12, 0, 0, 123456, tzinfo=dt.timezone.utc)
SCOPE = Scope("alpha", PAYMENTS, "key-1")


def _secret() -> str:
    return base64.b64encode(os.urandom(32)).decode()


K1, K2, K3 = _secret(), _secret(), _secret()


# -- helpers ---------------------------------------------------------------------------------


class App(t.NamedTuple):
    app: flask.Flask
    counter: Counter
    store: SQLStore


@pytest.fixture
def make_app(store: SQLStore, db_url: str) -> t.Iterator[t.Callable[..., App]]:
    """Apps on the test database, each with its own store (apps that seal differently cannot
    share one), all with a payment view whose answer carries card data."""
    stores: list[SQLStore] = []

    def make(*, marker: str = "cus_SECRET", padding: int = 0, **config: t.Any) -> App:
        own = create_store(db_url)
        stores.append(own)
        app = flask.Flask("idem-encryption-test")
        app.config.update(TESTING=True, PROPAGATE_EXCEPTIONS=False, **config)
        idem = Idempotency(store=own, tenant=lambda: flask.g.get("tenant", "alpha"))

        @app.before_request
        def authenticate() -> None:
            flask.g.tenant = flask.request.headers.get("X-Tenant", "alpha")

        idem.init_app(app)
        counter = Counter()

        @app.post("/payments")
        @idem.idempotent
        def create_payment() -> t.Any:
            n = counter.bump()
            body = {
                "id": f"pay_{n}",
                "customer": marker,
                "card": {"brand": "visa", "last4": "4242", "exp": "12/29"},
                "amount": (flask.request.get_json(silent=True) or {}).get("amount"),
                "notes": "x" * padding,
            }
            return flask.jsonify(body), 201, {"Location": f"/payments/pay_{n}?c={marker}"}

        @idem.reconciler(create_payment)
        def outcome(record: t.Any) -> Verdict:
            return Verdict.happened(({"id": "pay_reconciled", "customer": marker}, 201))

        return App(app, counter, own)

    yield make
    for own in stores:
        own.engine.dispose()


#: Every request names its tenant (``alpha`` unless told).
_post = functools.partial(post, tenant="alpha")


def _row(store: SQLStore, key: str, tenant: str = "alpha") -> dict[str, t.Any]:
    with store.engine.connect() as conn:
        row = conn.execute(
            sa.text(
                "SELECT state, response_status, response_headers, response_body, created_at "
                "FROM idempotency_keys WHERE tenant = :tenant AND key = :key"
            ),
            {"tenant": tenant, "key": unkeyed(tenant, key)},
        ).one()
    return dict(row._mapping)


def _set_body(store: SQLStore, key: str, tenant: str, body: bytes) -> None:
    with store.engine.begin() as conn:
        conn.execute(
            sa.text(
                "UPDATE idempotency_keys SET response_body = :body "
                "WHERE tenant = :tenant AND key = :key"
            ),
            {"body": body, "tenant": tenant, "key": unkeyed(tenant, key)},
        )


def _idem(app: flask.Flask, *args: str, key: str | None = None) -> Result:
    """``flask idem ARGS``; ``key`` goes to standard input, never on the command line."""
    stdin = None if key is None else f"{key}\n"
    return app.test_cli_runner().invoke(args=["idem", *args], input=stdin)


def _keys_json(app: flask.Flask) -> dict[str, t.Any]:
    result = _idem(app, "keys", "status", "--json")
    assert result.exit_code in (0, 1), result.output
    return t.cast("dict[str, t.Any]", json.loads(result.stdout))


def _usage(app: flask.Flask) -> dict[str | None, int]:
    return {row["key_id"]: row["live_records"] for row in _keys_json(app)["keys"]}


# -- configuration ---------------------------------------------------------------------------


def test_keys_are_read_in_every_spelling_first_one_first() -> None:
    raw = os.urandom(32)
    urlsafe = base64.urlsafe_b64encode(raw).decode().rstrip("=")
    spellings: list[t.Any] = [
        {"k2": urlsafe, "k1": K1},
        [("k2", urlsafe), ("k1", K1)],
        f"k2:{urlsafe}, k1:{K1}",
        [("k2", raw), ("k1", base64.b64decode(K1))],
    ]
    for spelling in spellings:
        keys = parse_keys(spelling)
        assert [key.id for key in keys] == ["k2", "k1"]
        assert keys[0].secret == raw and keys[1].secret == base64.b64decode(K1)
    assert parse_keys(None) == parse_keys("") == parse_keys({}) == ()
    assert len(base64.urlsafe_b64decode(generate_key())) == 32


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"k1": base64.b64encode(b"short").decode()}, "'k1' is not 32 bytes"),
        ({"k1": "not base64 at all!" + K1}, "'k1' is not 32 bytes"),
        ({"bad id!": K1}, "key id is 1 to 16 characters"),
        ({"a" * 17: K1}, "key id is 1 to 16 characters"),
        ([("k1", K1), ("k1", K2)], "'k1' is given twice"),
        ({K1: "k1"}, "key number 1 has an invalid id"),
        ([("k1", K2), ("x/y=", K1)], "key number 2 has an invalid id"),
        ("k1=" + K1, "id:base64key"),
        (42, "must be a mapping"),
        ({"k1": 42}, "'k1' is not a string"),
    ],
)
def test_bad_keys_fail_saying_what_to_do_without_echoing_them(raw: t.Any, message: str) -> None:
    with pytest.raises(ConfigurationError, match=message) as caught:
        Settings.from_mapping({"IDEMPOTENCY_ENCRYPTION_KEYS": raw})
    for secret in (K1, K2, "not base64 at all!"):
        assert secret not in str(caught.value)


def test_init_app_refuses_bad_encryption_config(store: SQLStore) -> None:
    for config in (
        {"IDEMPOTENCY_ENCRYPTION_KEYS": {"k1": K1[:-8]}},
        {"IDEMPOTENCY_REQUIRE_ENCRYPTED": True},
        {"IDEMPOTENCY_COMPRESS_MIN": -1},
    ):
        app = flask.Flask("bad")
        app.config.update(config)
        with pytest.raises(ConfigurationError) as caught:
            Idempotency(app, store=store)
        assert K1[:-8] not in str(caught.value)


def test_keys_never_appear_in_repr() -> None:
    settings = Settings.from_mapping({"IDEMPOTENCY_ENCRYPTION_KEYS": {"k1": K1, "k2": K2}})
    sealer = Sealer.from_settings(settings)
    for text in (repr(settings), str(settings), repr(sealer), repr(settings.encryption_keys)):
        assert "k1" in text
        for secret in (K1, K2):
            assert secret not in text
            assert repr(base64.b64decode(secret)) not in text
            assert base64.b64decode(secret).hex() not in text
    assert repr(EncryptionKey("k9", b"\x01" * 32)) == "EncryptionKey(id='k9')"


def test_two_apps_sharing_a_store_must_seal_alike(store: SQLStore) -> None:
    first = flask.Flask("first")
    first.config["IDEMPOTENCY_ENCRYPTION_KEYS"] = {"k1": K1}
    Idempotency(first, store=store)
    same = flask.Flask("same")
    same.config["IDEMPOTENCY_ENCRYPTION_KEYS"] = {"k1": K1}
    Idempotency(same, store=store)
    other = flask.Flask("other")
    with pytest.raises(ConfigurationError, match="give each application its own store"):
        Idempotency(other, store=store)


# -- the envelope ----------------------------------------------------------------------------

RESPONSE = StoredResponse(
    201,
    (("Content-Type", "application/json"), ("Location", "/payments/pay_1")),
    json.dumps({"id": "pay_1", "customer": "cus_SECRET", "notes": "n" * 3000}).encode(),
)


def _sealer(*ids: str, **options: t.Any) -> Sealer:
    secrets = {"k1": K1, "k2": K2, "k3": K3}
    return Sealer(parse_keys({key_id: secrets[key_id] for key_id in ids}), **options)


def _open(sealer: Sealer, columns: tuple[t.Any, bytes], **changes: t.Any) -> StoredResponse:
    scope = changes.get("scope", SCOPE)
    return sealer.open(
        scope,
        changes.get("created_at", CREATED),
        changes.get("status", RESPONSE.status),
        columns[0],
        columns[1],
    )


def test_plain_compressed_and_encrypted_snapshots_round_trip() -> None:
    small = StoredResponse(201, (("Content-Type", "application/json"),), b'{"id":"pay_1"}')
    plain = Sealer(compress_min=None)
    assert plain.seal(RESPONSE, SCOPE, None) == (
        [["Content-Type", "application/json"], ["Location", "/payments/pay_1"]],
        RESPONSE.body,
    )
    # Compression only: an envelope without key id, much smaller than the body.
    headers, body = Sealer().seal(RESPONSE, SCOPE, None)
    assert headers is None and body[:4] == MAGIC and body[5] == COMPRESSED
    assert body[6:HEADER_SIZE] == b"\0" * 16
    assert len(body) < len(RESPONSE.body) // 4
    # Below the threshold nothing changes.
    assert Sealer().seal(small, SCOPE, None) == ([["Content-Type", "application/json"]], small.body)
    for sealer in (_sealer("k1"), _sealer("k1", compress_min=None), Sealer(), plain):
        for response in (RESPONSE, small):
            columns = sealer.seal(response, SCOPE, CREATED)
            assert _open(sealer, columns, status=response.status) == response
    headers, body = _sealer("k1").seal(RESPONSE, SCOPE, CREATED)
    assert headers is None and body[5] == COMPRESSED | ENCRYPTED
    assert body[KEY_ID_OFFSET - 1 : HEADER_SIZE] == b"k1".ljust(16, b"\0")
    assert b"cus_SECRET" not in body and b"/payments/pay_1" not in body
    # Incompressible bodies are stored uncompressed (encrypted: still an envelope).
    noise = StoredResponse(200, (), os.urandom(4096))
    assert Sealer().seal(noise, SCOPE, None) == ([], noise.body)
    headers, body = _sealer("k1").seal(noise, SCOPE, CREATED)
    assert body[5] == ENCRYPTED and _open(_sealer("k1"), (headers, body), status=200) == noise


def test_a_ciphertext_is_bound_to_its_record() -> None:
    sealer = _sealer("k1")
    columns = sealer.seal(RESPONSE, SCOPE, CREATED)
    for changes in (
        {"scope": Scope("beta", PAYMENTS, "key-1")},
        {"scope": Scope("alpha", "POST /refunds", "key-1")},
        {"scope": Scope("alpha", PAYMENTS, "key-2")},
        {"created_at": CREATED + dt.timedelta(microseconds=1)},
        {"status": 200},
    ):
        with pytest.raises(Exception, match="does not authenticate with key 'k1'"):
            _open(sealer, columns, **changes)
    # The same instant in another time zone is the same record.
    other_zone = CREATED.astimezone(dt.timezone(dt.timedelta(hours=-5)))
    assert _open(sealer, columns, created_at=other_zone) == RESPONSE
    body = bytearray(columns[1])
    for position in (5, KEY_ID_OFFSET + 2, HEADER_SIZE + 3, len(body) - 1):
        tampered = bytearray(body)
        tampered[position] ^= 0x01
        with pytest.raises(Exception, match="unreadable"):
            _open(sealer, (None, bytes(tampered)))


def test_missing_keys_and_malformed_envelopes_are_unreadable() -> None:
    columns = _sealer("k1").seal(RESPONSE, SCOPE, CREATED)
    with pytest.raises(Exception, match="key 'k1', which is not in IDEMPOTENCY_ENCRYPTION_KEYS"):
        _open(_sealer("k2"), columns)
    with pytest.raises(Exception, match="key 'k1', which is not"):
        _open(Sealer(), columns)
    # Same id, other key material.
    impostor = Sealer(parse_keys({"k1": K2}))
    with pytest.raises(Exception, match="does not authenticate"):
        _open(impostor, columns)
    for body, reason in (
        (b"garbage", "malformed envelope"),
        (MAGIC + b"\x07\x00" + b"\0" * 16, "unknown envelope version 7"),
        (MAGIC + b"\x01\x01" + b"\0" * 16 + b"not zlib", "compressed payload is corrupt"),
        (MAGIC + b"\x01\x00" + b"\0" * 16 + b"\xff", "malformed payload"),
    ):
        with pytest.raises(Exception, match=reason):
            _open(Sealer(), (None, body))
    # A forged bomb is not inflated past the limit.
    bomb = MAGIC + b"\x01\x01" + b"\0" * 16 + zlib.compress(b"\0" * (80 * 1024 * 1024), 9)
    with pytest.raises(Exception, match="truncated or too large"):
        _open(Sealer(), (None, bomb))


def test_require_encrypted_refuses_snapshots_stored_in_clear() -> None:
    strict = _sealer("k1", require_encrypted=True)
    for columns in (
        Sealer(compress_min=None).seal(RESPONSE, SCOPE, None),
        Sealer().seal(RESPONSE, SCOPE, None),
    ):
        with pytest.raises(Exception, match="stored unencrypted"):
            _open(strict, columns)
    assert _open(strict, strict.seal(RESPONSE, SCOPE, CREATED)) == RESPONSE


# -- through the app, on both databases -------------------------------------------------------


def test_encrypted_responses_replay_and_are_stored_sealed(make_app: t.Callable[..., App]) -> None:
    app, counter, store = make_app(IDEMPOTENCY_ENCRYPTION_KEYS={"k1": K1})
    first = _post(app)
    replay = _post(app)
    assert first.status_code == replay.status_code == 201
    assert replay.data == first.data and replay.headers["Idempotent-Replayed"] == "true"
    assert replay.headers["Location"] == first.headers["Location"]
    assert replay.headers["Content-Type"] == "application/json"
    assert counter.calls == 1
    row = _row(store, "key-1")
    assert row["state"] == "completed" and row["response_status"] == 201
    assert row["response_headers"] is None
    body = bytes(row["response_body"])
    assert body[:4] == MAGIC and body[5] & ENCRYPTED
    assert b"cus_SECRET" not in body and b"4242" not in body and b"/payments/" not in body
    assert _usage(app) == {"k1": 1}


def test_compression_round_trips_and_shrinks_rows(make_app: t.Callable[..., App]) -> None:
    app, counter, store = make_app(padding=20_000)
    first = _post(app, "big")
    assert first.status_code == 201 and len(first.data) > 20_000
    replay = _post(app, "big")
    assert replay.data == first.data and replay.headers["Location"] == first.headers["Location"]
    row = _row(store, "big")
    body = bytes(row["response_body"])
    assert row["response_headers"] is None and body[:4] == MAGIC and body[5] == COMPRESSED
    assert len(body) < len(first.data) // 10
    # Small answers keep the plain layout.
    assert _post(app, "small-app-check").status_code == 201
    small_app, _, _ = make_app()
    assert _post(small_app, "small").status_code == 201
    small = _row(store, "small")
    assert small["response_headers"] and b"cus_SECRET" in bytes(small["response_body"])
    assert counter.calls == 2
    assert _usage(app) == {None: 3}
    # Off: stored as sent.
    off, _, _ = make_app(padding=20_000, IDEMPOTENCY_COMPRESS_MIN=None)
    assert _post(off, "uncompressed").status_code == 201
    assert len(bytes(_row(store, "uncompressed")["response_body"])) > 20_000


def test_a_ciphertext_moved_to_another_record_is_never_replayed(
    make_app: t.Callable[..., App], caplog: pytest.LogCaptureFixture
) -> None:
    app, counter, store = make_app(IDEMPOTENCY_ENCRYPTION_KEYS={"k1": K1})
    assert _post(app, "key-1", tenant="alpha").status_code == 201
    assert _post(app, "key-1", tenant="beta").status_code == 201
    alpha = bytes(_row(store, "key-1", "alpha")["response_body"])
    _set_body(store, "key-1", "beta", alpha)
    with caplog.at_level(logging.ERROR, logger="flask_idem"):
        answer = _post(app, "key-1", tenant="beta")
    document = assert_problem(answer, 503, "stored-response-unreadable")
    assert "not executed again" in document["detail"]
    assert answer.headers["Retry-After"] == "30"
    assert answer.headers["Idempotency-Key"] == "key-1"
    assert b"cus_SECRET" not in answer.data
    assert counter.calls == 2
    assert _row(store, "key-1", "beta")["state"] == "completed"  # never released
    (entry,) = [r for r in caplog.records if "unreadable" in r.getMessage()]
    assert "does not authenticate with key 'k1'" in entry.getMessage()
    assert len(t.cast(t.Any, entry).key_hash) == 16
    # The same ciphertext under a later record of the same key (a new created_at) fails too.
    shift(store, Scope("alpha", PAYMENTS, "key-1"), 1, "created_at")
    assert_problem(_post(app, "key-1", tenant="alpha"), 503, "stored-response-unreadable")
    assert counter.calls == 2


def test_a_missing_key_answers_a_problem_and_never_reexecutes(
    make_app: t.Callable[..., App], caplog: pytest.LogCaptureFixture
) -> None:
    writer, counter, store = make_app(IDEMPOTENCY_ENCRYPTION_KEYS={"k1": K1})
    assert _post(writer).status_code == 201
    # Same id, wrong material; other ids only; no keys at all.
    for config in ({"k1": K2}, {"k2": K2}, None):
        reader, reader_counter, _ = make_app(IDEMPOTENCY_ENCRYPTION_KEYS=config)
        with caplog.at_level(logging.INFO, logger="flask_idem"):
            for _ in range(2):
                assert_problem(_post(reader), 503, "stored-response-unreadable")
        assert reader_counter.calls == 0
    assert counter.calls == 1
    assert _row(store, "key-1")["state"] == "completed"
    logged = "\n".join(f"{r.getMessage()} {r.__dict__}" for r in caplog.records)
    assert "key-1" not in logged and "cus_SECRET" not in logged
    for secret in (K1, K2):
        assert secret not in logged
    # Operators see why; the tenant's view no longer promises a replay.
    reader, _, _ = make_app(IDEMPOTENCY_ENCRYPTION_KEYS={"k2": K2})
    shown = _idem(reader, "show", "--tenant", "alpha", "--json", key="key-1")
    (record,) = json.loads(shown.stdout)
    assert record["state"] == "completed" and record["replays"] is False
    assert "key 'k1', which is not in IDEMPOTENCY_ENCRYPTION_KEYS" in record["unreadable"]
    status = _idem(reader, "keys", "status")
    assert status.exit_code == 1
    assert "k1" in status.stdout and "missing" in status.stdout
    assert "1 live record cannot be replayed" in status.stderr
    # Putting the key back is all it takes.
    restored, restored_counter, _ = make_app(IDEMPOTENCY_ENCRYPTION_KEYS={"k2": K2, "k1": K1})
    replay = _post(restored)
    assert replay.status_code == 201 and replay.headers["Idempotent-Replayed"] == "true"
    assert restored_counter.calls == 0


def test_rotation_add_switch_retire(make_app: t.Callable[..., App], store: SQLStore) -> None:
    # 1. Encrypting with k1.
    old, _, _ = make_app(IDEMPOTENCY_ENCRYPTION_KEYS={"k1": K1})
    first = _post(old, "before")
    # 2. Deploy k2 first, k1 still decrypting: old records replay, new ones use k2.
    new, counter, _ = make_app(IDEMPOTENCY_ENCRYPTION_KEYS=f"k2:{K2},k1:{K1}")
    replay = _post(new, "before")
    assert replay.status_code == 201 and replay.data == first.data and counter.calls == 0
    assert _post(new, "after").status_code == 201
    body = bytes(_row(store, "after")["response_body"])
    assert body[KEY_ID_OFFSET - 1 : KEY_ID_OFFSET + 1] == b"k2"
    listed = _keys_json(new)
    assert [(k["key_id"], k["role"], k["live_records"]) for k in listed["keys"]] == [
        ("k2", "encrypts", 1),
        ("k1", "decrypts", 1),
    ]
    assert listed["missing"] == 0 and all(k["last_expires_at"] for k in listed["keys"])
    # 3. k1 is needed until its last record expires.
    needed = _idem(new, "keys", "can-retire", "k1")
    assert needed.exit_code == 1 and "still needed: 1 live stored response" in needed.stdout
    refused = _idem(new, "keys", "can-retire", "k2")
    assert refused.exit_code == 1 and "encrypts new responses" in refused.output
    shift(store, Scope("alpha", PAYMENTS, "before"), 86400 + 1, "expires_at")
    retire = _idem(new, "keys", "can-retire", "k1", "--json")
    assert retire.exit_code == 0
    assert json.loads(retire.stdout)["can_retire"] is True
    # 4. Retired: the new records replay, the expired one is a new operation.
    retired, retired_counter, _ = make_app(IDEMPOTENCY_ENCRYPTION_KEYS={"k2": K2})
    assert _post(retired, "after").headers["Idempotent-Replayed"] == "true"
    assert _post(retired, "before").headers.get("Idempotent-Replayed") is None
    assert retired_counter.calls == 1
    assert _usage(retired) == {"k2": 2}
    assert _idem(retired, "keys", "status").exit_code == 0


def test_turning_encryption_on_keeps_plain_records_replayable(
    make_app: t.Callable[..., App], store: SQLStore
) -> None:
    plain, _, _ = make_app()
    assert _post(plain, "plain").status_code == 201
    sealed, counter, _ = make_app(IDEMPOTENCY_ENCRYPTION_KEYS={"k1": K1})
    assert _post(sealed, "plain").headers["Idempotent-Replayed"] == "true"
    assert _post(sealed, "new").status_code == 201
    assert _usage(sealed) == {"k1": 1, None: 1}
    strict, strict_counter, _ = make_app(
        IDEMPOTENCY_ENCRYPTION_KEYS={"k1": K1}, IDEMPOTENCY_REQUIRE_ENCRYPTED=True
    )
    assert_problem(_post(strict, "plain"), 503, "stored-response-unreadable")
    assert _post(strict, "new").headers["Idempotent-Replayed"] == "true"
    assert counter.calls == 1 and strict_counter.calls == 0


def test_store_primitives_seal_without_a_created_at_hint(store: SQLStore) -> None:
    store.use_sealer(_sealer("k1"))
    scope = Scope("alpha", PAYMENTS, "hintless")
    claim = store.claim(scope, b"f" * 32, ttl=60, lease=30)
    assert store.complete(scope, claim.token, RESPONSE)  # no created_at: looked up
    assert not store.complete(scope, "not-the-token", RESPONSE)
    record = store.get(scope)
    assert record is not None and record.response == RESPONSE and record.unreadable is None
    # A reconciler settling a stuck record seals its answer the same way.
    stuck = Scope("alpha", PAYMENTS, "stuck")
    claim = store.claim(stuck, b"f" * 32, ttl=60, lease=30)
    assert store.mark_unknown(stuck, claim.token)
    assert store.resolve(stuck, RESPONSE, token=claim.token)
    record = store.get(stuck)
    assert record is not None and record.response == RESPONSE and record.state is State.COMPLETED
    assert bytes(_row(store, "stuck")["response_body"])[5] & ENCRYPTED


def test_reconciled_records_are_sealed(make_app: t.Callable[..., App]) -> None:
    app, counter, store = make_app(IDEMPOTENCY_ENCRYPTION_KEYS={"k1": K1})
    scope = Scope("alpha", PAYMENTS, "died")
    claim = store.claim(scope, b"f" * 32, ttl=60, lease=30)
    store.mark_unknown(scope, claim.token, created_at=claim.record.created_at)
    with app.app_context():
        (settlement,) = list(reconcile(store.stuck()))
    assert settlement.action.value == "completed"
    body = bytes(_row(store, "died")["response_body"])
    assert body[5] & ENCRYPTED and b"cus_SECRET" not in body
    record = store.get(scope)
    assert record is not None and record.response is not None
    assert json.loads(record.response.body)["id"] == "pay_reconciled"


def test_keys_generate_prints_a_usable_key(store: SQLStore) -> None:
    app = flask.Flask("gen")
    Idempotency(app, store=create_store(store.engine))
    result = app.test_cli_runner().invoke(args=["idem", "keys", "generate", "k2027"])
    assert result.exit_code == 0
    (key,) = parse_keys(result.stdout.strip())
    assert key.id == "k2027" and len(key.secret) == 32
    bad = app.test_cli_runner().invoke(args=["idem", "keys", "generate", "bad id"])
    assert bad.exit_code == 2


# -- database dumps ---------------------------------------------------------------------------


def _dump_app(url: str, **config: t.Any) -> tuple[flask.Flask, SQLStore]:
    store = create_store(url)
    app = flask.Flask("dump")
    app.config.update(TESTING=True, **config)
    idem = Idempotency(store=store, tenant=lambda: "alpha")
    idem.init_app(app)

    @app.post("/payments")
    @idem.idempotent
    def create_payment() -> t.Any:
        marker = flask.request.get_json()["marker"]
        body = {"customer": marker, "card": {"last4": "4242"}, "padding": "p" * 5000}
        return flask.jsonify(body), 201, {"Location": f"/payments/{marker}-location"}

    return app, store


def _pg_dump(url: str) -> bytes:
    pg_dump = pgcluster.find_binary("pg_dump")
    assert pg_dump is not None, "pg_dump is needed next to the server binaries"
    libpq = sa.make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)
    return subprocess.run(
        [pg_dump, "--data-only", "--dbname", libpq], check=True, capture_output=True
    ).stdout


def _sqlite_files(url: str) -> bytes:
    path = Path(t.cast(str, sa.make_url(url).database))
    return b"".join(
        candidate.read_bytes()
        for candidate in (path, Path(f"{path}-wal"), Path(f"{path}-journal"))
        if candidate.exists()
    )


@contextlib.contextmanager
def _fresh_database(
    dialect: str, request: pytest.FixtureRequest, tmp_path: Path
) -> t.Iterator[str]:
    if dialect == "postgresql":
        make = request.getfixturevalue("fresh_pg_database")
        url = make()
    else:
        url = f"sqlite:///{tmp_path / 'dump.sqlite3'}"
    upgrade(url)
    yield url


@pytest.mark.parametrize("dialect", ["postgresql", "sqlite"])
@pytest.mark.parametrize("encrypted", [True, False])
def test_a_database_dump_holds_no_stored_body_in_clear(
    dialect: str, encrypted: bool, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    marker = f"cus_{uuid.uuid4().hex}"
    config: dict[str, t.Any] = {"IDEMPOTENCY_COMPRESS_MIN": None}
    if encrypted:
        config["IDEMPOTENCY_ENCRYPTION_KEYS"] = {"k1": K1}
    with _fresh_database(dialect, request, tmp_path) as url:
        app, store = _dump_app(url, **config)
        try:
            client = app.test_client()
            for n in range(5):
                for _ in range(2):  # stored, then replayed
                    answer = client.post(
                        "/payments",
                        json={"marker": marker},
                        headers={"Idempotency-Key": f"dump-{n}"},
                    )
                    assert answer.status_code == 201 and marker.encode() in answer.data
            dump = _pg_dump(url) if dialect == "postgresql" else _sqlite_files(url)
        finally:
            store.engine.dispose()
        if dialect == "sqlite":
            dump += _sqlite_files(url)  # after the close: checkpointed into the main file
    assert _holds(dump, unkeyed("alpha", "dump-3").encode())  # the dump is real: keys are there
    assert not _holds(dump, b"dump-3"), "keys are stored as their digests"
    for secret in (marker.encode(), b'"last4":"4242"', b"-location", b"p" * 64):
        # Without encryption (the control) the body is there in clear: the check can see it.
        assert _holds(dump, secret) is not encrypted, secret


def _holds(dump: bytes, secret: bytes) -> bool:
    """Whether ``secret`` is in the dump as bytes, or as pg_dump spells bytea (hex)."""
    return secret in dump or secret.hex().encode() in dump


@pytest.mark.parametrize("dialect", ["postgresql", "sqlite"])
def test_with_a_key_secret_a_dump_confirms_no_guessed_key_or_request(
    dialect: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """With ``IDEMPOTENCY_KEY_SECRETS`` a dump holds neither the raw key, nor its unkeyed
    digest, nor the request's unkeyed fingerprint: whoever guesses a key or a body cannot
    confirm the guess without the secret. Without it (the control), the unkeyed digest and
    fingerprint are there, so the check can see them."""
    marker = f"cus_{uuid.uuid4().hex}"
    sent = json.dumps({"marker": marker}).encode()
    guessed = fingerprint("POST", "/payments", {}, (), sent, "application/json")
    for keyed in (True, False):
        config: dict[str, t.Any] = {"IDEMPOTENCY_KEY_SECRETS": f"k1:{K1}" if keyed else ()}
        (tmp_path / str(keyed)).mkdir()
        with _fresh_database(dialect, request, tmp_path / str(keyed)) as url:
            app, store = _dump_app(url, **config)
            try:
                client = app.test_client()
                for _ in range(2):  # stored, then replayed
                    answer = client.post(
                        "/payments",
                        data=sent,
                        content_type="application/json",
                        headers={"Idempotency-Key": "order-42"},
                    )
                    assert answer.status_code == 201 and marker.encode() in answer.data
                dump = _pg_dump(url) if dialect == "postgresql" else _sqlite_files(url)
            finally:
                store.engine.dispose()
            if dialect == "sqlite":
                dump += _sqlite_files(url)
        assert not _holds(dump, b"order-42")
        assert _holds(dump, unkeyed("alpha", "order-42").encode()) is not keyed
        assert _holds(dump, guessed) is not keyed
