"""What a stored key and a stored fingerprint are made of, and how the secrets are read."""

from __future__ import annotations

import base64
import dataclasses
import datetime as dt
import hashlib

import pytest

from flask_idem import ConfigurationError
from flask_idem.core.config import Settings
from flask_idem.core.idempotency_keys import derive_key, key_hash
from flask_idem.core.key_digest import KeyDigest, KeySecret, parse_secrets, unkeyed
from flask_idem.core.record import Record, Scope, State

S1 = base64.b64encode(b"1" * 32).decode()
S2 = base64.urlsafe_b64encode(b"\xfb" * 40).decode()
FP = hashlib.sha256(b"request").digest()
NOW = dt.datetime(2026, 12, 3, tzinfo=dt.timezone.utc)


def _record(scope: Scope, fingerprint: bytes) -> Record:
    return Record(scope, fingerprint, State.COMPLETED, "t" * 32, None, None, NOW, NOW, NOW, NOW)


def test_the_tenant_and_the_key_are_framed_unambiguously() -> None:
    """Length prefixes: moving characters between the tenant and the key changes the digest."""
    assert unkeyed("ab", "c") != unkeyed("a", "bc")
    assert unkeyed("a:1", "x") != unkeyed("a", "1:x")
    assert unkeyed("t", "k").startswith("$sha256$") and len(unkeyed("t", "k")) == 8 + 64


def test_a_secret_keys_the_digest_and_the_fingerprint() -> None:
    keys = KeyDigest.from_secrets(parse_secrets(f"k1:{S1}"))
    stored = keys.stored("t", "k")
    assert stored.startswith("$k1$") and stored != unkeyed("t", "k")
    assert stored != KeyDigest.from_secrets(parse_secrets(f"k1:{S2}")).stored("t", "k")
    assert keys.fingerprint(FP) != FP and len(keys.fingerprint(FP)) == 32
    assert KeyDigest().fingerprint(FP) == FP, "unkeyed, the fingerprint is what it always was"


def test_a_record_is_compared_under_the_secret_its_key_was_digested_with() -> None:
    old = KeyDigest.from_secrets(parse_secrets(f"old:{S1}"))
    rotated = KeyDigest.from_secrets(parse_secrets(f"new:{S2},old:{S1}"))
    scope = Scope("t", "POST /p", "k", digest=old.stored("t", "k"))
    record = _record(scope, old.fingerprint(FP))
    assert rotated.same_request(record, FP)
    assert not rotated.same_request(record, hashlib.sha256(b"other").digest())
    forgotten = KeyDigest.from_secrets(parse_secrets(f"new:{S2}"))
    assert not forgotten.same_request(record, FP), "an unlisted secret matches nothing"
    custom = _record(Scope("t", "POST /p", "k"), FP)  # a store that digests nothing
    assert rotated.same_request(custom, FP) and not rotated.same_request(custom, FP[::-1])
    migrated = _record(Scope("t", "POST /p", "k", digest=unkeyed("t", "k")), FP)
    assert KeyDigest.from_secrets(parse_secrets(f"new:{S2},sha256")).same_request(migrated, FP)


def test_candidates_list_every_entry_current_first() -> None:
    keys = KeyDigest.from_secrets(parse_secrets(f"new:{S2},sha256,old:{S1}"))
    forms = keys.candidates("t", "k")
    assert [form.split("$")[1] for form in forms] == ["new", "sha256", "old"]
    assert forms[1] == unkeyed("t", "k")
    assert keys.candidates("t", forms[2]) == (forms[2],), "a stored digest is only itself"


def test_key_hashes_and_downstream_keys_are_made_of_the_stored_digest() -> None:
    """The request (raw key and its digest) and a reader of the table (the digest alone) get
    the same key hash and the same downstream keys."""
    keys = KeyDigest.from_secrets(parse_secrets(f"k1:{S1}"))
    request = keys.scope("t", "POST /p", "k")
    from_table = Scope("t", "POST /p", request.digest or "", digest=request.digest)
    assert key_hash(request) == key_hash(from_table)
    assert derive_key(_record(request, FP), "charge") == derive_key(
        _record(from_table, FP), "charge"
    )
    assert key_hash(Scope("t", "POST /p", "k")) == key_hash(KeyDigest().scope("t", "POST /p", "k"))
    assert key_hash(request) != key_hash(Scope("t", "POST /p", "k")), "keyed, not the unkeyed hash"
    assert dataclasses.replace(request, digest=None) == request, "the digest is no identity"


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ("k1", "has no id"),
        ([f"bad id:{S1}"], "invalid id"),
        ("k1:c2hvcnQ=", "32 bytes or more"),
        (f"k1:{S1},k1:{S2}", "given twice"),
        (f"sha256:{S1}", "names the unkeyed digest"),
        ([42], "is not id:secret"),
    ],
)
def test_bad_secrets_fail_naming_the_entry_never_the_secret(raw: object, message: str) -> None:
    with pytest.raises(ConfigurationError, match=message) as caught:
        Settings.from_mapping({"IDEMPOTENCY_KEY_SECRETS": raw})
    assert S1 not in str(caught.value) and S2 not in str(caught.value)
    assert "IDEMPOTENCY_KEY_SECRETS" in str(caught.value)


def test_secrets_are_read_from_strings_mappings_and_pairs() -> None:
    expected = (KeySecret("a", b"1" * 32), KeySecret("sha256"))
    assert parse_secrets(f"a:{S1}, sha256") == expected
    assert parse_secrets({"a": S1}) == expected[:1]
    assert parse_secrets([("a", b"1" * 32), "sha256"]) == expected
    assert parse_secrets(None) == parse_secrets("") == ()
    assert S1 not in repr(Settings.from_mapping({"IDEMPOTENCY_KEY_SECRETS": f"a:{S1}"}))
