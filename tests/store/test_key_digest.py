"""Keys and fingerprints at rest, on both dialects: the table holds digests, a rotation of the
secrets finds every live record and lets no key be claimed twice, and revision 0011 digests the
rows of revision 0010 without losing a retry's answer."""

from __future__ import annotations

import base64
import concurrent.futures
import threading
import typing as t

import pytest
import sqlalchemy as sa

from flask_idem import Scope, State, create_store
from flask_idem.core.key_digest import KeyDigest, parse_secrets, unkeyed
from flask_idem.ops.migrate import downgrade, upgrade
from flask_idem.store import SQLStore
from flask_idem.testing.contract import FP, OTHER_FP, RESPONSE
from tests.support import pgcluster
from tests.support.helpers import statements_before_0014

OLD = base64.b64encode(b"o" * 32).decode()
NEW = base64.b64encode(b"n" * 32).decode()


def _keyed(store: SQLStore, secrets: str) -> SQLStore:
    """A second store on ``store``'s database, as a server configured with ``secrets``."""
    other = create_store(store.engine.url.render_as_string(hide_password=False))
    other.use_keys(KeyDigest.from_secrets(parse_secrets(secrets)))
    return other


def _rows(store: SQLStore) -> list[tuple[t.Any, ...]]:
    """Every row of the table, binary columns as bytes (psycopg2 reads them as memoryviews,
    which compare unequal inside a tuple)."""
    with store.engine.connect() as conn:
        rows = conn.execute(sa.text("SELECT * FROM idempotency_keys")).all()
    return [tuple(bytes(v) if isinstance(v, memoryview) else v for v in row) for row in rows]


def test_the_table_holds_neither_the_key_nor_an_unkeyed_fingerprint(
    store: SQLStore, scope: Scope
) -> None:
    """With a secret, a dump of the table confirms no guessed key and no guessed request: the
    key is stored as its HMAC, and so is the fingerprint."""
    keyed = _keyed(store, f"k1:{NEW}")
    try:
        token = keyed.claim(scope, FP, ttl=600, lease=30).token
        assert keyed.complete(scope, token, RESPONSE)
        [row] = _rows(store)
        dump = repr(row)
        assert scope.key not in dump and unkeyed(scope.tenant, scope.key) not in dump
        assert FP not in row and FP.hex() not in dump
        stored = keyed.get(scope)
        assert stored is not None and stored.scope.digest is not None
        assert stored.scope.digest.startswith("$k1$") and stored.scope.digest in row
        replay = keyed.claim(scope, FP, ttl=600, lease=30)
        assert not replay.claimed and replay.record.response == RESPONSE
        assert keyed.keys.same_request(replay.record, FP)
        assert not keyed.keys.same_request(replay.record, OTHER_FP)
    finally:
        keyed.engine.dispose()


def test_by_default_the_key_is_stored_as_its_unkeyed_digest(store: SQLStore, scope: Scope) -> None:
    """Without a secret the key column holds SHA-256 of (tenant, key), the fingerprint the
    request's SHA-256 (what revision 0011 leaves of older rows), and lookups by key find it."""
    store.claim(scope, FP, ttl=600, lease=30)
    [row] = _rows(store)
    assert scope.key not in repr(row), repr(row)
    assert unkeyed(scope.tenant, scope.key) in row
    assert FP in row
    [found] = store.find(scope.tenant, scope.key)
    assert found.scope.key == unkeyed(scope.tenant, scope.key)


def test_a_rotation_finds_the_records_of_the_previous_secret(store: SQLStore, scope: Scope) -> None:
    """A record claimed under the old secret replays (the same request) and refuses another
    request (422's test) for servers listing the new secret first; the key is not claimed
    again; new keys get the new secret; writes reach the row whatever its digest."""
    old, new = _keyed(store, f"old:{OLD}"), _keyed(store, f"new:{NEW},old:{OLD}")
    try:
        token = old.claim(scope, FP, ttl=600, lease=30).token
        assert old.complete(scope, token, RESPONSE)
        replay = new.claim(scope, FP, ttl=600, lease=30)
        assert not replay.claimed and replay.record.response == RESPONSE
        assert replay.record.scope.digest is not None
        assert replay.record.scope.digest.startswith("$old$")
        assert new.keys.same_request(replay.record, FP)
        assert not new.keys.same_request(replay.record, OTHER_FP)
        [found] = new.find(scope.tenant, scope.key)
        assert found.scope.digest == replay.record.scope.digest
        running = Scope(scope.tenant, scope.endpoint, scope.key + "-running")
        held = old.claim(running, FP, ttl=600, lease=30)
        seen = new.claim(running, FP, ttl=600, lease=30)
        assert not seen.claimed and seen.record.state is State.IN_PROGRESS
        fresh = Scope(scope.tenant, scope.endpoint, scope.key + "-fresh")
        claimed = new.claim(fresh, FP, ttl=600, lease=30)
        assert claimed.claimed and claimed.record.scope.digest is not None
        assert claimed.record.scope.digest.startswith("$new$")
        assert new.complete(claimed.record.scope, claimed.token, RESPONSE)
        assert old.complete(held.record.scope, held.token, RESPONSE)
    finally:
        old.engine.dispose()
        new.engine.dispose()


def test_an_unlisted_secret_leaves_the_record_unfound(store: SQLStore, scope: Scope) -> None:
    """Dropping a secret from the list forgets its records: why a secret stays listed for one
    TTL after it stopped being the first (docs/encryption.md)."""
    old, new = _keyed(store, f"old:{OLD}"), _keyed(store, f"new:{NEW}")
    try:
        old.claim(scope, FP, ttl=600, lease=30)
        assert new.get(scope) is None and new.find(scope.tenant, scope.key) == []
    finally:
        old.engine.dispose()
        new.engine.dispose()


def test_servers_in_both_phases_of_a_rotation_never_claim_one_key_twice(store: SQLStore) -> None:
    """Servers listing the secrets in either order (a rolling deploy between the two phases
    of a rotation) claim each key once: every claim locks every listed form of the key."""
    servers = [_keyed(store, f"old:{OLD},new:{NEW}"), _keyed(store, f"new:{NEW},old:{OLD}")]
    try:
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            for n in range(40):
                scope = Scope("tenant", "POST /pay", f"race-{n}")
                start = threading.Barrier(4)

                def claim(i: int, scope: Scope = scope, start: threading.Barrier = start) -> bool:
                    start.wait()
                    return servers[i % 2].claim(scope, FP, ttl=600, lease=30).claimed

                wins = list(pool.map(claim, range(4)))
                assert wins.count(True) == 1, f"round {n}: {wins}"
    finally:
        for server in servers:
            server.engine.dispose()


def test_an_atomic_claim_in_a_rotation_finds_the_previous_record(
    pg_store: SQLStore, scope: Scope
) -> None:
    """The atomic claim looks the previous digests up under their locks too, inside the
    business transaction; held locks mean busy, unless the record is completed (replayed)."""
    old, new = _keyed(pg_store, f"old:{OLD}"), _keyed(pg_store, f"new:{NEW},old:{OLD}")
    phase_one = _keyed(pg_store, f"old:{OLD},new:{NEW}")
    try:
        token = old.claim(scope, FP, ttl=600, lease=30).token
        assert old.complete(scope, token, RESPONSE)
        with new.engine.connect() as conn, conn.begin():
            found = new.claim_atomic(conn, scope, FP, ttl=600)
            assert found is not None and not found.claimed
            assert found.record.response == RESPONSE
            with phase_one.engine.connect() as other, other.begin():
                # The key's locks are held by ``conn``: its completed record replays anyway.
                busy = phase_one.claim_atomic(other, scope, FP, ttl=600)
                assert busy is not None and not busy.claimed
                assert busy.record.response == RESPONSE
        fresh = Scope(scope.tenant, scope.endpoint, scope.key + "-atomic")
        with new.engine.connect() as conn:
            conn.begin()
            claimed = new.claim_atomic(conn, fresh, FP, ttl=600)
            assert claimed is not None and claimed.claimed and claimed.reservation is not None
            assert claimed.reservation.complete(RESPONSE)
            with phase_one.engine.connect() as other, other.begin():
                # Every form's lock is held by the open transaction: busy, never a claim.
                assert phase_one.claim_atomic(other, fresh, FP, ttl=600) is None
            conn.commit()
        replay = phase_one.claim(fresh, FP, ttl=600, lease=30)
        assert not replay.claimed and replay.record.response == RESPONSE
    finally:
        for server in (old, new, phase_one):
            server.engine.dispose()


def _claim_as_0010(store: SQLStore, scope: Scope) -> str:
    """Claim ``scope`` as revision 0010's code did: the raw key in the row."""
    token = "f" * 32
    with store.engine.begin() as conn:
        if store.dialect == "postgresql":
            conn.execute(
                sa.text("SELECT * FROM idempotency_claim(:t, :e, :k, :fp, :token, 600, 30)"),
                {"t": scope.tenant, "e": scope.endpoint, "k": scope.key, "fp": FP, "token": token},
            )
        else:
            conn.execute(
                sa.text(
                    "INSERT INTO idempotency_keys (tenant, endpoint, key, fingerprint, state, "
                    "claim_token, lease_expires_at, created_at, expires_at) VALUES (:t, :e, :k, "
                    ":fp, 'in_progress', :token, strftime('%Y-%m-%d %H:%M:%f', 'now', "
                    "'+30 seconds') || '000', strftime('%Y-%m-%d %H:%M:%f', 'now') || '000', "
                    "strftime('%Y-%m-%d %H:%M:%f', 'now', '+600 seconds') || '000')"
                ),
                {"t": scope.tenant, "e": scope.endpoint, "k": scope.key, "fp": FP, "token": token},
            )
    return token


@pytest.fixture(params=["postgresql", "sqlite"])
def url_at_0010(request: pytest.FixtureRequest, tmp_path: t.Any) -> str:
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path}/at-0010.sqlite3"
    else:
        url = str(request.getfixturevalue("fresh_pg_database")())
    upgrade(url, "0010")
    return url


def test_upgrade_from_0010_digests_live_rows_and_their_retries_still_replay(
    url_at_0010: str,
) -> None:
    """Rows written under revision 0010 (raw keys) are digested by 0011: a retry after the
    deploy replays the stored answer of a request made before it, a record that may still run
    again (in progress, unknown) refuses the upgrade until it is settled (its re-run would
    derive other downstream keys), no raw key is left, a worker still sending raw keys is
    refused (PostgreSQL), and the downgrade refuses while digested rows live."""
    store = create_store(url_at_0010)
    try:
        done, running = Scope("t", "POST /p", "before-done"), Scope("t", "POST /p", "before-run")
        token = _claim_as_0010(store, done)
        # Completed by 0010's code: the row's key is the raw key (a scope carrying it as its
        # digest is how the store writes it as it is).
        as_0010 = Scope(done.tenant, done.endpoint, done.key, digest=done.key)
        with statements_before_0014(store):
            assert store.complete(as_0010, token, RESPONSE)
        running_token = _claim_as_0010(store, running)
        # It may run again after the upgrade: with other downstream keys, so it is refused.
        with pytest.raises(RuntimeError, match="1 live records are in progress"):
            upgrade(url_at_0010, "0011")
        as_run = Scope(running.tenant, running.endpoint, running.key, digest=running.key)
        assert store.mark_unknown(as_run, running_token)
        with pytest.raises(RuntimeError, match="unknown or reopened"):
            upgrade(url_at_0010, "0011")
        # Settled by the old release ("it happened", with the answer of the first request).
        copied = ", ".join(
            f"{column} = (SELECT {column} FROM idempotency_keys WHERE key = 'before-done')"
            for column in ("response_status", "response_headers", "response_body")
        )
        with store.engine.begin() as conn:
            settled_rows = conn.execute(
                sa.text(
                    f"UPDATE idempotency_keys SET state = 'completed', lease_expires_at = NULL, "
                    f"completed_at = created_at, {copied} WHERE key = 'before-run'"
                )
            ).rowcount
        assert settled_rows == 1
        upgrade(url_at_0010, "0011")
        if store.dialect == "postgresql":
            # A worker of revision 0010 still running claims with the raw key: refused, never
            # a second record beside the digested one.
            for raw in (done, Scope("t", "POST /p", "new-on-an-old-worker")):
                with pytest.raises(sa.exc.DBAPIError, match="stored as digests"):
                    _claim_as_0010(store, raw)
            for function in ("idempotency_claim_reserve", "idempotency_claim_atomic"):
                with pytest.raises(sa.exc.DBAPIError, match="stored as digests"):
                    with store.engine.begin() as conn:
                        conn.execute(
                            sa.text(f"SELECT * FROM {function}('t', 'e', 'raw', :fp, 'x', 60, 0)"),
                            {"fp": FP},
                        )
        dump = repr(_rows(store))
        assert "before-done" not in dump and "before-run" not in dump
        replay = store.claim(done, FP, ttl=600, lease=30)
        assert not replay.claimed and replay.record.response == RESPONSE
        assert store.keys.same_request(replay.record, FP)
        settled = store.claim(running, FP, ttl=600, lease=30)
        assert not settled.claimed and settled.record.response == RESPONSE
        [found] = store.find("t", "before-done")
        assert found.response == RESPONSE
        upgrade(url_at_0010, "0011")  # again: digests are left as they are
        assert store.claim(done, FP, ttl=600, lease=30).record.response == RESPONSE
        with pytest.raises(RuntimeError, match="live records have digested keys"):
            downgrade(url_at_0010, "0010")
    finally:
        store.engine.dispose()


def test_the_upgrade_digests_keys_as_python_does_on_a_latin1_database(pg_server_url: str) -> None:
    """The migration counts the UTF-8 bytes of a tenant and a key, as the code that looks them
    up does, whatever the server's encoding: on LATIN1 a tenant "Zürich" is 6 bytes to the
    server and 7 in UTF-8, and a digest of the wrong length prefix would never be found (the
    retry of a completed request would run again)."""
    url = pgcluster.create_database(
        pg_server_url, "ENCODING 'LATIN1' TEMPLATE template0 LC_COLLATE 'C' LC_CTYPE 'C'"
    )
    store = None
    try:
        upgrade(url, "0010")
        store = create_store(url)
        done = Scope("Zürich", "POST /p", "k-ü")
        token = _claim_as_0010(store, done)
        with statements_before_0014(store):
            assert store.complete(
                Scope(done.tenant, done.endpoint, done.key, digest=done.key), token, RESPONSE
            )
        upgrade(url, "0011")
        replay = store.claim(done, FP, ttl=600, lease=30)
        assert not replay.claimed, "the request made before the upgrade would run again"
        assert replay.record.response == RESPONSE
    finally:
        if store is not None:
            store.engine.dispose()
        pgcluster.drop_database(url)
