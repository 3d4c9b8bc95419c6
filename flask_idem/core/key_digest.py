"""Keys and fingerprints at rest: what the table stores instead of the idempotency key.

The ``key`` column holds ``$<id>$<hex>``, never the key a client sent:

- ``$sha256$`` + SHA-256 over the tenant and the key (the default, and what migration 0011
  turned every stored key into): a dump shows no key, but a guessed key can be confirmed by
  hashing the guess;
- ``$<id>$`` + HMAC-SHA256 under the secret ``<id>`` of ``IDEMPOTENCY_KEY_SECRETS``: without
  the secret a dump confirms nothing, and the request fingerprint is keyed with the same
  secret, so a guessed body cannot be confirmed either.

The tenant and the key are length-prefixed before they are hashed, so no two pairs give the
same bytes. ``$`` is not in the key alphabet
(:data:`~flask_idem.core.idempotency_keys.KEY_PATTERN`): a stored digest can never be
taken for a key a client sent, nor the other way round.

Rotation: the first secret digests new records; every secret listed is looked up (atomically
with the claim, see :mod:`flask_idem.store.postgresql`), and a record's fingerprint is checked
with the secret its key was digested with. docs/encryption.md gives the order of a rotation.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import hashlib
import hmac
import re
import typing as t

from .errors import ConfigurationError
from .record import Record, Scope

#: Marks a stored digest; never in a key a client can send.
MARK = "$"
#: The id of the unkeyed digest (SHA-256, no secret).
UNKEYED = "sha256"
#: A secret's id: short, printable, never ``$``.
SECRET_ID_PATTERN = re.compile(r"[A-Za-z0-9._-]{1,16}")
#: Shortest secret accepted, in bytes (HMAC-SHA256's block is 64, its output 32).
MIN_SECRET = 32
_KEY_CONTEXT = b"flask_idem key\x00"
_FINGERPRINT_CONTEXT = b"flask_idem fingerprint\x00"
_HEAD_CONTEXT = b"flask_idem fingerprint head\x00"
#: A keyed fingerprint keys its first bytes on their own: an account-wide fingerprint begins
#: with its endpoint's tag (:func:`flask_idem.core.scopes.account_fingerprint`), which a
#: reuse on another endpoint is told by, with the secret as without it.
HEAD_SIZE = 8
_FORMAT = "write IDEMPOTENCY_KEY_SECRETS as id:base64secret (32 bytes or more), current first"


def _framed(*parts: str) -> bytes:
    """``len:part`` for each part (lengths in bytes): unambiguous for any tenant and key."""
    return b"".join(b"%d:%s" % (len(p.encode()), p.encode()) for p in parts)


def unkeyed(tenant: str, key: str) -> str:
    """The stored form of ``key`` without a secret (``$sha256$...``), as migration 0011 wrote it."""
    digest = hashlib.sha256(_KEY_CONTEXT + _framed(tenant, key)).hexdigest()
    return f"{MARK}{UNKEYED}{MARK}{digest}"


def is_stored(key: str) -> bool:
    """Whether ``key`` is a stored digest rather than a key a client sent."""
    return key.startswith(MARK)


def id_of(stored: str) -> str | None:
    """The secret id a stored digest was made with (``sha256`` for none), or None."""
    if not is_stored(stored):
        return None
    secret_id, sep, _ = stored[1:].partition(MARK)
    return secret_id if sep else None


def stored_of(scope: Scope) -> str:
    """The scope's key as stored: the digest it carries, or its unkeyed digest."""
    if scope.digest is not None:
        return scope.digest
    if is_stored(scope.key):
        return scope.key
    return unkeyed(scope.tenant, scope.key)


@dataclasses.dataclass(frozen=True)
class KeySecret:
    """One entry of ``IDEMPOTENCY_KEY_SECRETS``; ``secret`` None is the unkeyed digest."""

    id: str
    secret: bytes | None = dataclasses.field(default=None, repr=False)


@dataclasses.dataclass(frozen=True)
class KeyDigest:
    """How one application stores keys and fingerprints (``IDEMPOTENCY_KEY_SECRETS``).

    :param secrets: the first digests new records; all of them are looked up.
    """

    secrets: tuple[KeySecret, ...] = (KeySecret(UNKEYED),)

    def __post_init__(self) -> None:
        if not self.secrets:
            raise ValueError("a KeyDigest needs at least one entry")

    @classmethod
    def from_secrets(cls, secrets: t.Sequence[KeySecret]) -> KeyDigest:
        """The digest of the configured secrets; none configured: unkeyed."""
        return cls(tuple(secrets)) if secrets else cls()

    @property
    def current(self) -> KeySecret:
        return self.secrets[0]

    @property
    def rotating(self) -> bool:
        """Whether a claim must look up more than one digest."""
        return len(self.secrets) > 1

    def stored(self, tenant: str, key: str, entry: KeySecret | None = None) -> str:
        """``key`` as stored under ``entry`` (default: the current one)."""
        entry = entry or self.current
        if entry.secret is None:
            return unkeyed(tenant, key)
        mac = hmac.new(entry.secret, _KEY_CONTEXT + _framed(tenant, key), hashlib.sha256)
        return f"{MARK}{entry.id}{MARK}{mac.hexdigest()}"

    def current_of(self, scope: Scope) -> str:
        """``scope``'s key under the current entry: the digest the scope carries when it was
        made with that entry (a request's scope, from :meth:`scope`), else computed."""
        carried = scope.digest
        if carried is not None and id_of(carried) == self.current.id:
            return carried
        return self.stored(scope.tenant, scope.key)

    def candidates(self, tenant: str, key: str) -> tuple[str, ...]:
        """Every stored form of ``key`` a live record may carry, current first.

        A key that is already a stored digest (read from the table) is only itself.
        """
        if is_stored(key):
            return (key,)
        return tuple(self.stored(tenant, key, entry) for entry in self.secrets)

    def scope(self, tenant: str, endpoint: str, key: str) -> Scope:
        """A request's scope, carrying the current digest of its key (for logs until its claim
        says which digest its record has)."""
        return Scope(tenant, endpoint, key, digest=self.stored(tenant, key))

    def fingerprint(self, digest: bytes, secret_id: str | None = None) -> bytes:
        """The stored fingerprint of a request whose SHA-256 fingerprint is ``digest``.

        Unkeyed, it is ``digest`` itself (what every release stored); keyed, an HMAC of it, so a
        dump does not confirm a guessed request body.

        :param secret_id: the entry to key it with (default: the current one).
        """
        entry = self.current if secret_id is None else self._entry(secret_id)
        if entry is None or entry.secret is None:
            return digest
        head = hmac.new(entry.secret, _HEAD_CONTEXT + digest[:HEAD_SIZE], hashlib.sha256)
        whole = hmac.new(entry.secret, _FINGERPRINT_CONTEXT + digest, hashlib.sha256)
        return head.digest()[:HEAD_SIZE] + whole.digest()[: len(digest) - HEAD_SIZE]

    def as_stored(self, record: Record, digest: bytes) -> bytes | None:
        """The fingerprint ``digest`` as ``record`` would store it (keyed with the secret its
        key was digested with), or None when that secret is no longer configured."""
        secret_id = id_of(record.scope.digest or record.scope.key)
        if secret_id is None:
            return digest  # a store that keeps fingerprints as it is given them
        if self._entry(secret_id) is None:
            return None
        return self.fingerprint(digest, secret_id)

    def same_request(self, record: Record, digest: bytes) -> bool:
        """Whether ``record`` was stored for a request fingerprinted ``digest``, keyed with the
        secret its key was digested with (a record from before a rotation still matches)."""
        stored = self.as_stored(record, digest)
        return stored is not None and hmac.compare_digest(record.fingerprint, stored)

    def _entry(self, secret_id: str) -> KeySecret | None:
        for entry in self.secrets:
            if entry.id == secret_id:
                return entry
        if secret_id == UNKEYED:
            return KeySecret(UNKEYED)
        return None


def parse_secrets(raw: t.Any, name: str = "IDEMPOTENCY_KEY_SECRETS") -> tuple[KeySecret, ...]:
    """Read the configured secrets, current first.

    Accepts a string ``"id:secret,id:secret"`` (for an environment variable), a mapping
    ``{id: secret}`` (in order) or a sequence of entries, each ``(id, secret)`` or
    ``"id:secret"``. A secret is bytes, or base64 / urlsafe base64, of 32 bytes or more. The
    word ``sha256`` in place of an entry is the unkeyed digest (to switch a secret on, or off,
    without a window: see docs/encryption.md). Errors name the id, never the secret.
    """
    if raw is None or raw == "" or raw == () or raw == [] or raw == {}:
        return ()
    items: list[t.Any]
    if isinstance(raw, str):
        items = [item for item in re.split(r"[\s,]+", raw.strip()) if item]
    elif isinstance(raw, t.Mapping):
        items = list(raw.items())
    else:
        try:
            items = list(raw)
        except TypeError:
            raise ConfigurationError(f"{name}: {_FORMAT}") from None
    entries: list[KeySecret] = []
    for item in items:
        entry = _entry(item, name, len(entries) + 1)
        if any(e.id == entry.id for e in entries):
            raise ConfigurationError(f"{name}: {entry.id!r} is given twice")
        entries.append(entry)
    return tuple(entries)


def _entry(item: t.Any, name: str, number: int) -> KeySecret:
    if item == UNKEYED:
        return KeySecret(UNKEYED)
    if isinstance(item, str):
        secret_id, sep, secret = item.partition(":")
        if not sep:
            raise ConfigurationError(f"{name}: entry number {number} has no id; {_FORMAT}")
    elif isinstance(item, tuple | list) and len(item) == 2:
        secret_id, secret = item
    else:
        raise ConfigurationError(f"{name}: entry number {number} is not id:secret; {_FORMAT}")
    if not isinstance(secret_id, str) or not SECRET_ID_PATTERN.fullmatch(secret_id):
        # Not echoed: a secret given in the id's place would end up in a log.
        raise ConfigurationError(
            f"{name}: entry number {number} has an invalid id; an id is 1 to 16 characters "
            "from A-Z a-z 0-9 . _ -"
        )
    if secret_id == UNKEYED:
        raise ConfigurationError(f"{name}: {UNKEYED!r} names the unkeyed digest; give no secret")
    return KeySecret(secret_id, _decode(secret, secret_id, name))


def _decode(secret: t.Any, secret_id: str, name: str) -> bytes:
    if isinstance(secret, bytes | bytearray):
        decoded = bytes(secret)
    elif isinstance(secret, str):
        text = secret.strip().replace("-", "+").replace("_", "/").rstrip("=")
        try:
            decoded = base64.b64decode(text + "=" * (-len(text) % 4), validate=True)
        except (binascii.Error, ValueError):
            decoded = b""
    else:
        raise ConfigurationError(f"{name}: secret {secret_id!r} is not a string; {_FORMAT}")
    if len(decoded) < MIN_SECRET:
        raise ConfigurationError(
            f"{name}: secret {secret_id!r} is not {MIN_SECRET} bytes or more in base64; {_FORMAT}"
        )
    return decoded
