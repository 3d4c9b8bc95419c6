"""The store contract: what every store must do, as pytest suites, one per interface.

:class:`RequestStoreContract` checks the request primitives (:class:`~flask_idem.RequestStore`,
the minimum of a custom store), :class:`OperatorStoreContract` the operator interface
(:class:`~flask_idem.OperatorStore`), and :class:`StoreContract` both, for a
:class:`~flask_idem.Store`. flask_idem runs :class:`StoreContract` on its own stores
(PostgreSQL and SQLite); an author of a custom store runs the one that fits on theirs by
subclassing it in a test module and giving it a ``store`` fixture (an empty, ready store), and
:meth:`~RequestStoreContract.age` when the store is not SQL::

    from flask_idem.testing.contract import StoreContract

    class TestMyStore(StoreContract):
        @pytest.fixture
        def store(self):
            store = MyStore(create_engine(url))
            yield store
            store.engine.dispose()

Every test takes the ``store`` fixture and a fresh ``scope``. The suite moves records in time
with :meth:`~StoreContract.age` (stores read the database clock, so tests never sleep), and
reads what a store keeps at rest with :meth:`~StoreContract.at_rest` (every table its engine
sees), so a store that keeps raw keys or bodies in clear fails whatever it returns.
"""

from __future__ import annotations

import concurrent.futures
import datetime as dt
import hashlib
import json
import threading
import typing as t

import pytest
import sqlalchemy as sa

from ..core.idempotency_keys import key_hash
from ..core.key_digest import KeyDigest, KeySecret, unkeyed
from ..core.record import Scope, State, StoredResponse
from ..core.scopes import ACCOUNT, account_fingerprint, namespace, split, used_elsewhere
from ..core.sealing import EncryptionKey, Sealer
from ..store import RequestStore, Store
from . import age_record

FP = hashlib.sha256(b"request").digest()
OTHER_FP = hashlib.sha256(b"other request").digest()
RESPONSE = StoredResponse(
    201, (("Content-Type", "application/json"), ("Location", "/v1/payments/pay_1")), b'{"id":1}'
)


#: A snapshot whose body and header value are found in clear wherever they are kept.
SECRET_RESPONSE = StoredResponse(
    201,
    (("Content-Type", "application/json"), ("Location", "/v1/payments/pay_contract_clear")),
    b'{"card":"4242-contract-cleartext"}',
)


def _seconds(n: float) -> dt.timedelta:
    return dt.timedelta(seconds=n)


def _as_bytes(value: t.Any) -> bytes:
    """A column value as the bytes a search for a secret looks through."""
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value)
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, list | dict):
        return json.dumps(value).encode() + str(value).encode()
    return str(value).encode()


def _stored(store: RequestStore, scopes: t.Iterable[Scope]) -> list[tuple[str, str, str]]:
    """Scopes as the store keeps them: records read from the table carry the key's digest
    (:mod:`flask_idem.core.key_digest`), never the raw key."""
    return [(s.tenant, s.endpoint, s.digest or store.keys.stored(s.tenant, s.key)) for s in scopes]


class _Contract:
    """What both suites use: a scope per test, and moving a record in time."""

    @pytest.fixture
    def scope(self, request: pytest.FixtureRequest) -> Scope:
        """A scope of its own per test."""
        return Scope("tenant-a", "POST /v1/payments", f"key-{request.node.name}"[:255])

    def age(self, store: RequestStore, scope: Scope, seconds: float, *columns: str) -> None:
        """Move the scope's record ``seconds`` into the past: all its times, or only
        ``columns`` (``created_at``, ``expires_at``, ``lease_expires_at``, ``completed_at``).
        The default works on SQL stores with flask_idem's table; override it otherwise."""
        age_record(store, scope, seconds, *columns)

    def at_rest(self, store: RequestStore) -> list[bytes]:
        """Every value the store keeps, as bytes: each column of each row of each table its
        engine sees (the default schema). Override it for a store that keeps records where
        its engine cannot see them."""
        with store.engine.connect() as conn:
            names = sa.inspect(conn).get_table_names()
            preparer = conn.dialect.identifier_preparer
            return [
                _as_bytes(value)
                for name in names
                for row in conn.execute(sa.text(f"SELECT * FROM {preparer.quote(name)}"))  # noqa: S608
                for value in row
                if value is not None
            ]

    def kept(self, store: RequestStore, *secrets: bytes) -> list[bytes]:
        """Which of ``secrets`` the store keeps somewhere at rest (see :meth:`at_rest`)."""
        values = self.at_rest(store)
        return [secret for secret in secrets if any(secret in value for value in values)]


class RequestStoreContract(_Contract):
    """The contract of the request primitives (:class:`~flask_idem.RequestStore`); subclass it
    (its name must start with ``Test``) with a ``store`` fixture."""

    def test_first_claim_owns_the_key(self, store: RequestStore, scope: Scope) -> None:
        result = store.claim(scope, FP, ttl=3600, lease=30)
        assert result.claimed
        record = result.record
        assert record.state is State.IN_PROGRESS
        assert record.fingerprint == FP
        assert len(result.token) == 32
        assert 29 <= record.lease_remaining <= 30
        assert 3599 <= (record.expires_at - record.created_at).total_seconds() <= 3600
        assert record.response is None

    def test_second_claim_returns_the_existing_record(
        self, store: RequestStore, scope: Scope
    ) -> None:
        first = store.claim(scope, FP, ttl=3600, lease=30)
        second = store.claim(scope, OTHER_FP, ttl=3600, lease=30)
        assert not second.claimed
        assert second.record.fingerprint == FP
        assert second.record.created_at == first.record.created_at
        assert 29 <= second.record.lease_remaining <= 30
        with pytest.raises(ValueError):
            second.token  # noqa: B018

    def test_complete_stores_the_snapshot_for_replay(
        self, store: RequestStore, scope: Scope
    ) -> None:
        token = store.claim(scope, FP, ttl=3600, lease=30).token
        assert store.complete(scope, token, RESPONSE)
        replay = store.claim(scope, FP, ttl=3600, lease=30)
        assert not replay.claimed
        assert replay.record.state is State.COMPLETED
        assert replay.record.response == RESPONSE
        assert replay.record.completed_at is not None
        assert not store.complete(scope, token, RESPONSE), "a completed record is final"

    def test_complete_keeps_binary_bodies_and_repeated_headers(
        self, store: RequestStore, scope: Scope
    ) -> None:
        body = bytes(range(256))
        response = StoredResponse(200, (("Link", "<a>"), ("Link", "<b>")), body)
        token = store.claim(scope, FP, ttl=60, lease=30).token
        assert store.complete(scope, token, response)
        record = store.get(scope)
        assert record is not None and record.response == response

    def test_complete_without_response_marks_the_key_unstored(
        self, store: RequestStore, scope: Scope
    ) -> None:
        token = store.claim(scope, FP, ttl=3600, lease=30).token
        assert store.complete(scope, token, None)
        record = store.claim(scope, FP, ttl=3600, lease=30).record
        assert record.state is State.UNSTORED
        assert record.response is None

    def test_release_frees_the_key(self, store: RequestStore, scope: Scope) -> None:
        token = store.claim(scope, FP, ttl=3600, lease=30).token
        assert not store.release(scope, "0" * 32), "a wrong token releases nothing"
        assert store.release(scope, token)
        assert store.get(scope) is None
        assert store.claim(scope, OTHER_FP, ttl=3600, lease=30).claimed

    def test_mark_unknown_blocks_retries(self, store: RequestStore, scope: Scope) -> None:
        token = store.claim(scope, FP, ttl=3600, lease=30).token
        assert store.mark_unknown(scope, token)
        result = store.claim(scope, FP, ttl=3600, lease=30)
        assert not result.claimed
        assert result.record.state is State.UNKNOWN
        assert not store.release(scope, token), "an unknown outcome is never released by its owner"

    def test_renew_extends_the_lease(self, store: RequestStore, scope: Scope) -> None:
        token = store.claim(scope, FP, ttl=3600, lease=5).token
        assert store.renew(scope, token, lease=120)
        record = store.get(scope)
        assert record is not None and record.lease_remaining > 100
        assert not store.renew(scope, "0" * 32, lease=120)

    def test_take_over_needs_an_expired_lease(self, store: RequestStore, scope: Scope) -> None:
        token = store.claim(scope, FP, ttl=3600, lease=30).token
        assert store.take_over(scope, token, lease=30) is None
        self.age(store, scope, 31, "lease_expires_at")
        record = store.get(scope)
        assert record is not None and record.lease_expired
        takeover = store.take_over(scope, token, lease=30)
        assert takeover is not None and takeover.claimed
        assert takeover.token != token
        assert takeover.record.lease_remaining > 25
        assert store.take_over(scope, token, lease=30) is None, "only one takeover per lease"

    def test_stale_owner_is_fenced_after_take_over(self, store: RequestStore, scope: Scope) -> None:
        stale = store.claim(scope, FP, ttl=3600, lease=30).token
        self.age(store, scope, 31, "lease_expires_at")
        takeover = store.take_over(scope, stale, lease=30)
        assert takeover is not None
        assert not store.complete(scope, stale, RESPONSE)
        assert not store.release(scope, stale)
        assert not store.renew(scope, stale, lease=30)
        assert not store.mark_unknown(scope, stale)
        assert store.complete(scope, takeover.token, RESPONSE)
        record = store.get(scope)
        assert record is not None and record.state is State.COMPLETED

    def test_expired_record_never_blocks(self, store: RequestStore, scope: Scope) -> None:
        token = store.claim(scope, FP, ttl=60, lease=30).token
        store.complete(scope, token, RESPONSE)
        self.age(store, scope, 61)
        assert store.get(scope) is None
        fresh = store.claim(scope, OTHER_FP, ttl=60, lease=30)
        assert fresh.claimed, "a claim over an expired record in the same partition works"
        assert fresh.record.fingerprint == OTHER_FP
        record = store.get(scope)
        assert record is not None and record.state is State.IN_PROGRESS

    def test_live_record_blocks_until_its_expiry(self, store: RequestStore, scope: Scope) -> None:
        store.claim(scope, FP, ttl=60, lease=30)
        self.age(store, scope, 59)
        assert not store.claim(scope, FP, ttl=60, lease=30).claimed

    def test_tenants_and_endpoints_never_collide(self, store: RequestStore) -> None:
        scopes = [
            Scope(tenant, endpoint, "same-key")
            for tenant in ("alpha", "beta")
            for endpoint in ("POST /v1/payments", "POST /v1/refunds")
        ]
        tokens = [store.claim(s, FP, ttl=60, lease=30) for s in scopes]
        assert all(result.claimed for result in tokens)
        assert store.complete(scopes[0], tokens[0].token, RESPONSE)
        for other, result in zip(scopes[1:], tokens[1:], strict=True):
            record = store.get(other)
            assert record is not None and record.state is State.IN_PROGRESS
            assert not store.complete(other, tokens[0].token, RESPONSE), "tokens are scope-bound"
            assert store.release(other, result.token)

    def test_an_account_wide_key_is_claimed_once_across_endpoints(
        self, store: RequestStore
    ) -> None:
        """An account-wide namespace holds one record whatever endpoint claims it, and a claim
        from another endpoint gets the first one's fingerprint back whole: its endpoint tag
        is what tells a reuse elsewhere from a retry, also once the record completed."""
        scope = Scope("tenant-a", ACCOUNT, "account-wide")
        orders = account_fingerprint("POST /v1/orders", FP)
        payments = account_fingerprint("POST /v1/payments", FP)

        def claimed_elsewhere() -> None:
            found = store.claim(scope, payments, ttl=60, lease=30)
            assert not found.claimed and found.record.fingerprint == orders
            assert used_elsewhere(found.record, payments)
            assert not used_elsewhere(found.record, orders)

        first = store.claim(scope, orders, ttl=60, lease=30)
        assert first.claimed
        claimed_elsewhere()
        assert store.complete(scope, first.token, RESPONSE)
        claimed_elsewhere()
        replay = store.claim(scope, orders, ttl=60, lease=30)
        assert not replay.claimed and replay.record.response == RESPONSE

    def test_endpoints_racing_for_an_account_wide_key_claim_it_once(
        self, store: RequestStore
    ) -> None:
        """Four endpoints claiming one account-wide key at the same moment, on threads of
        their own: exactly one owns it, and every other sees the owner's fingerprint."""
        scope = Scope("tenant-a", ACCOUNT, "raced")
        endpoints = [f"POST /v1/endpoint-{n}" for n in range(4)]
        start = threading.Barrier(len(endpoints))

        def claim(endpoint: str) -> tuple[bytes, bool, bytes]:
            digest = account_fingerprint(endpoint, FP)
            start.wait()
            result = store.claim(scope, digest, ttl=60, lease=30)
            return digest, result.claimed, result.record.fingerprint

        with concurrent.futures.ThreadPoolExecutor(len(endpoints)) as pool:
            results = list(pool.map(claim, endpoints))
        winners = [digest for digest, claimed, _ in results if claimed]
        assert len(winners) == 1, "one endpoint runs"
        assert all(seen == winners[0] for _, _, seen in results)

    def test_principals_of_one_tenant_never_collide(self, store: RequestStore) -> None:
        """Per-principal namespaces share the tenant column and stay apart: one principal's
        key is free for another, and its claim token writes only its own record."""
        alice, bob = (
            Scope("tenant-a", namespace("POST /v1/payments", "endpoint", who), "same-key")
            for who in ("user-alice", "user-bob")
        )
        mine, theirs = (
            store.claim(alice, FP, ttl=60, lease=30),
            store.claim(bob, FP, ttl=60, lease=30),
        )
        assert mine.claimed and theirs.claimed
        assert not store.complete(bob, mine.token, RESPONSE), "tokens are namespace-bound"
        assert store.complete(alice, mine.token, RESPONSE)
        record = store.get(bob)
        assert record is not None and record.state is State.IN_PROGRESS
        assert record.scope == bob and split(record.scope.endpoint)[0] == "user-bob"

    def test_get_sees_only_the_live_record(self, store: RequestStore, scope: Scope) -> None:
        assert store.get(scope) is None
        store.claim(scope, FP, ttl=60, lease=30)
        record = store.get(scope)
        assert record is not None and record.scope == scope

    def test_complete_joins_the_business_transaction(
        self, store: RequestStore, scope: Scope
    ) -> None:
        token = store.claim(scope, FP, ttl=60, lease=30).token
        connection = store.begin()
        try:
            assert store.complete(scope, token, RESPONSE, connection=connection)
            connection.rollback()
        finally:
            connection.close()
        record = store.get(scope)
        assert record is not None and record.state is State.IN_PROGRESS, "rolled back together"

        connection = store.begin()
        try:
            assert store.complete(scope, token, RESPONSE, connection=connection)
            connection.commit()
        finally:
            connection.close()
        record = store.get(scope)
        assert record is not None and record.state is State.COMPLETED

    def test_writes_use_the_created_at_hint(self, store: RequestStore, scope: Scope) -> None:
        claim = store.claim(scope, FP, ttl=600, lease=30)
        elsewhere = claim.record.created_at.replace(year=2000)
        assert not store.complete(scope, claim.token, RESPONSE, created_at=elsewhere)
        assert not store.renew(scope, claim.token, lease=30, created_at=elsewhere)
        assert store.renew(scope, claim.token, lease=30, created_at=claim.record.created_at)
        assert store.complete(scope, claim.token, RESPONSE, created_at=claim.record.created_at)

    def test_a_request_running_past_its_ttl_keeps_the_key(
        self, store: RequestStore, scope: Scope
    ) -> None:
        """The TTL never frees a key whose first request still holds its lease."""
        claim = store.claim(scope, FP, ttl=2, lease=30)
        self.age(store, scope, 10, "created_at", "expires_at")
        assert store.renew(
            scope, claim.token, lease=30, created_at=claim.record.created_at - _seconds(10)
        )
        again = store.claim(scope, FP, ttl=2, lease=30)
        assert not again.claimed and again.record.claim_token == claim.token
        assert store.get(scope) is not None
        # The TTL also counts from the end of the lease: 1 s after it the key is still taken.
        self.age(store, scope, 31, "lease_expires_at")
        assert not store.claim(scope, FP, ttl=2, lease=30).claimed, "a TTL after the lease's end"
        self.age(store, scope, 2, "lease_expires_at")
        assert store.claim(scope, FP, ttl=2, lease=30).claimed, "past TTL and lease: forgotten"

    def test_the_raw_key_is_never_kept(self, store: RequestStore, scope: Scope) -> None:
        """A store keeps a key's digest (:attr:`~flask_idem.RequestStore.keys`), never the key
        a client sent: a dump of its tables shows no key."""
        token = store.claim(scope, FP, ttl=60, lease=30).token
        assert store.complete(scope, token, RESPONSE)
        assert self.kept(store, scope.key.encode()) == []

    def test_keys_and_fingerprints_are_kept_keyed_with_the_secret(
        self, store: RequestStore, scope: Scope
    ) -> None:
        """With ``IDEMPOTENCY_KEY_SECRETS`` (:meth:`~flask_idem.RequestStore.use_keys`) a
        store keeps the key's HMAC under the current secret and the request's keyed
        fingerprint: neither the key, its unkeyed SHA-256 (a guessed key would confirm) nor
        the raw fingerprint (a guessed body would) is kept, and the record is found by it."""
        keys = KeyDigest((KeySecret("contract", b"contract secret, 32 bytes long.."),))
        store.use_keys(keys)
        fingerprint = hashlib.sha256(b"contract: a keyed request").digest()
        claim = store.claim(scope, fingerprint, ttl=60, lease=30)
        assert claim.claimed
        assert claim.record.scope.digest == keys.stored(scope.tenant, scope.key)
        assert claim.record.fingerprint == keys.fingerprint(fingerprint)
        assert store.complete(scope, claim.token, RESPONSE)
        replay = store.claim(scope, fingerprint, ttl=60, lease=30)
        assert not replay.claimed and keys.same_request(replay.record, fingerprint)
        assert replay.record.response == RESPONSE
        raw = (scope.key.encode(), unkeyed(scope.tenant, scope.key).encode(), fingerprint)
        assert self.kept(store, *raw) == [], "kept unkeyed"
        assert self.kept(store, keys.stored(scope.tenant, scope.key).encode()), "the digest"

    def test_stored_responses_are_sealed_by_the_sealer(
        self, store: RequestStore, scope: Scope
    ) -> None:
        """With ``IDEMPOTENCY_ENCRYPTION_KEYS`` and ``IDEMPOTENCY_REQUIRE_ENCRYPTED``
        (:meth:`~flask_idem.RequestStore.use_sealer`) a store keeps the snapshot as its sealer
        sealed it: neither the body nor a header value is kept in clear, and it replays."""
        key = EncryptionKey("contract", bytes(range(32)))
        store.use_sealer(Sealer((key,), require_encrypted=True))
        token = store.claim(scope, FP, ttl=60, lease=30).token
        assert store.complete(scope, token, SECRET_RESPONSE)
        record = store.get(scope)
        assert record is not None and record.response == SECRET_RESPONSE
        body, location = SECRET_RESPONSE.body, SECRET_RESPONSE.headers[1][1].encode()
        assert self.kept(store, body, location) == [], "kept in clear"


class OperatorStoreContract(_Contract):
    """The contract of the operator interface (:class:`~flask_idem.OperatorStore`) of a store
    that has the request primitives too (they make the records it reads); subclass it (its
    name must start with ``Test``) with a ``store`` fixture."""

    def test_upkeep_never_removes_a_record_under_a_held_lease(
        self, store: Store, scope: Scope
    ) -> None:
        """The TTL never lets upkeep purge a record whose first request still holds its lease."""
        claim = store.claim(scope, FP, ttl=2, lease=30)
        self.age(store, scope, 10, "created_at", "expires_at")
        assert store.renew(
            scope, claim.token, lease=30, created_at=claim.record.created_at - _seconds(10)
        )
        assert store.maintain(ahead=7).purged == 0
        assert store.get(scope) is not None, "upkeep never removes a record under a held lease"

    def test_stuck_lists_expired_leases_and_unknown_outcomes_oldest_first(
        self, store: Store
    ) -> None:
        alive, dead, unknown, done = (
            Scope("t", "e", name) for name in ("alive", "dead", "unk", "ok")
        )
        store.claim(alive, FP, ttl=600, lease=30)
        dead_token = store.claim(dead, FP, ttl=600, lease=30).token
        store.mark_unknown(unknown, store.claim(unknown, FP, ttl=600, lease=30).token)
        store.complete(done, store.claim(done, FP, ttl=600, lease=30).token, RESPONSE)
        self.age(store, dead, 31, "lease_expires_at")
        self.age(store, unknown, 5, "created_at")
        stuck = [record.scope for record in store.stuck()]
        assert _stored(store, stuck) == _stored(store, [unknown, dead])
        assert not store.resolve(alive, RESPONSE, token=None), "a live owner is never overruled"
        assert not store.resolve(done, RESPONSE, token=None)
        assert not store.resolve(dead, RESPONSE, token="another"), "fenced by the token seen"
        assert store.resolve(dead, RESPONSE, token=dead_token)
        replay = store.claim(dead, FP, ttl=600, lease=30)
        assert not replay.claimed and replay.record.response == RESPONSE
        assert not store.complete(dead, dead_token, RESPONSE)
        [seen] = store.stuck()
        assert store.reopen(unknown, token=seen.claim_token)
        [reopened] = store.stuck()
        assert reopened.state is State.REOPENED and reopened.created_at == seen.created_at
        retry = store.claim(unknown, FP, ttl=600, lease=30)
        assert not retry.claimed, "reopened, never forgotten: the same record, the same keys"
        assert reopened.claim_token is not None
        assert store.take_over(unknown, reopened.claim_token, lease=30) is not None
        assert store.stuck() == []

    def test_find_and_evict(self, store: Store) -> None:
        payments, refunds = Scope("t", "POST /p", "k"), Scope("t", "POST /r", "k")
        for scope in (payments, refunds):
            store.claim(scope, FP, ttl=600, lease=30)
        found = [r.scope for r in store.find("t", "k")]
        assert _stored(store, found) == _stored(store, [payments, refunds])
        found = [r.scope for r in store.find("t", "k", endpoint="POST /r")]
        assert _stored(store, found) == _stored(store, [refunds])
        assert store.find("other", "k") == []
        assert store.evict(payments)
        assert not store.evict(payments)
        assert store.claim(payments, FP, ttl=600, lease=30).claimed

    def test_find_sees_every_namespace_of_a_key(self, store: Store) -> None:
        """The operator tools find a key's records of every scope by (tenant, key), and one
        of them by its endpoint column or its key hash."""
        scopes = [
            Scope("t", column, "k")
            for column in ("POST /p", ACCOUNT, "principal=alice POST /p", "principal=alice *")
        ]
        for scope in scopes:
            store.claim(scope, FP, ttl=600, lease=30)
        found = _stored(store, [r.scope for r in store.find("t", "k")])
        assert sorted(found) == sorted(_stored(store, scopes))
        for scope in scopes:
            one = [r.scope for r in store.find("t", "k", endpoint=scope.endpoint)]
            assert _stored(store, one) == _stored(store, [scope])
            [record] = store.find("t", "k", endpoint=scope.endpoint)
            hashed = [r.scope for r in store.find_hashed("t", key_hash(record.scope))]
            assert _stored(store, hashed) == _stored(store, [scope])

    def test_created_between_reads_an_endpoints_records_of_every_principal(
        self, store: Store
    ) -> None:
        """The next-day check asks for the records of its endpoints: a principal's records of
        them are theirs too, the account-wide ones come by ``*``, and nothing else does (an
        endpoint that only ends like one, another case, another principal's other endpoint)."""
        wanted = [
            Scope("t", column, "created")
            for column in ("POST /p/<a_b>", "principal=alice POST /p/<a_b>", ACCOUNT)
        ]
        others = [
            Scope("t", column, "created")
            for column in (
                "POST /x/p/<a_b>",
                "principal=alice POST /q",
                "principal=alice post /P/<A_B>",
                "POST /p/<aXb>",
                "principal=bob POST /x POST /p/<a_b>",
            )
        ]
        for scope in wanted + others:
            store.claim(scope, FP, ttl=600, lease=30)
        now = store.get(wanted[0])
        assert now is not None
        window = (now.created_at - _seconds(60), now.created_at + _seconds(60))
        found = store.created_between(*window, endpoints=["POST /p/<a_b>", ACCOUNT])
        assert sorted(_stored(store, [r.scope for r in found])) == sorted(_stored(store, wanted))
        assert all(record.response is None for record in found)


class StoreContract(RequestStoreContract, OperatorStoreContract):
    """The whole contract of a :class:`~flask_idem.Store` (both interfaces); subclass it (its
    name must start with ``Test``) with a ``store`` fixture."""
