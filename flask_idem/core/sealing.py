"""Stored responses at rest: compression and authenticated encryption of response snapshots.

A snapshot is stored in one of two layouts, told apart by ``response_headers``:

plain (``response_headers`` is a JSON list)
    the headers as ``[[name, value], ...]`` and the body as it was sent. Rows written without
    encryption whose body is too small to compress (or does not get smaller) look like this,
    and so does every row written before sealing existed.
envelope (``response_headers`` is NULL)
    ``response_body`` holds the headers and the body together, compressed and/or encrypted::

        offset  size  field
        0       4     magic  b"\\x89IDM"
        4       1     version (1)
        5       1     flags: 0x01 payload compressed with zlib, 0x02 encrypted with AES-256-GCM
        6       16    key id, ASCII, NUL-padded (all NUL when not encrypted)
        22      12    nonce (encrypted only; random per row)
        22|34   ...   payload, or its ciphertext followed by the 16-byte GCM tag

    The payload is ``u32 big-endian length of the headers JSON || headers JSON || body``;
    compression applies to the payload, encryption to the (compressed) payload.

Associated data binds a ciphertext to its row: the 22 header bytes (so flags and key id cannot
be flipped) plus the record's tenant, endpoint, key, ``created_at`` (UTC, microseconds) and the
stored status (kept in clear in ``response_status`` for the inspection view). A ciphertext
copied to another row, another tenant, or a later record of the same key (a new
``created_at``) fails to decrypt, and so does a changed status.

The key id is a fixed-width field at a fixed offset so that ``flask idem keys`` can count the
rows per key in SQL (``substr(response_body, 7, 16)``) without reading bodies.

Keys never appear in ``repr``, logs or error messages: only their ids do.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import datetime as dt
import functools
import json
import os
import re
import struct
import typing as t
import zlib

from .errors import ConfigurationError, UnreadableResponse
from .key_digest import is_stored, stored_of
from .record import STORABLE_STATUSES, Scope, StoredResponse

if t.TYPE_CHECKING:
    from .config import Settings

MAGIC = b"\x89IDM"
VERSION = 1
COMPRESSED = 0x01
ENCRYPTED = 0x02
KEY_ID_SIZE = 16
HEADER_SIZE = len(MAGIC) + 2 + KEY_ID_SIZE
NONCE_SIZE = 12
TAG_SIZE = 16
#: Offset (1-based, as SQL ``substr`` counts) of the key id in an envelope.
KEY_ID_OFFSET = len(MAGIC) + 3
#: zlib level: 6 (zlib's default) compresses JSON within a few percent of 9 at a fraction of
#: the time; bench/sealing.py measures it.
COMPRESS_LEVEL = 6
#: Never inflate more than this (a row forged into a decompression bomb cannot exhaust memory).
# The largest IDEMPOTENCY_MAX_BODY plus room for its headers: a snapshot the store accepted
# must always open again.
MAX_PAYLOAD = 65 * 1024 * 1024
DEFAULT_COMPRESS_MIN = 1024

KEY_ID_PATTERN = re.compile(r"[A-Za-z0-9._-]{1,16}")
#: What a completion can have stored: RFC 9110 field names (tokens) and values without control
#: characters (a CR or LF replayed would split the header into two).
HEADER_NAME = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
HEADER_VALUE = re.compile(r"[^\x00-\x08\x0a-\x1f\x7f]*")
_LENGTH = struct.Struct(">I")
_URLSAFE = str.maketrans("-_", "+/")
_AAD_CONTEXT = b"flask_idem/stored-response/v1"

_KEY_FORMAT = (
    "a key is 32 random bytes in base64 or urlsafe base64 (make one with "
    "`flask idem keys generate`)"
)


@dataclasses.dataclass(frozen=True)
class EncryptionKey:
    """One named AES-256 key. Its ``repr`` shows the id only."""

    id: str
    secret: bytes = dataclasses.field(repr=False)

    def __repr__(self) -> str:
        return f"EncryptionKey(id={self.id!r})"

    __str__ = __repr__


def parse_keys(raw: t.Any, name: str = "IDEMPOTENCY_ENCRYPTION_KEYS") -> tuple[EncryptionKey, ...]:
    """Read the configured keys, first (encrypting) first.

    Accepts a mapping ``{id: key}`` (in order), a sequence of ``(id, key)`` pairs, or a string
    ``"id:key,id:key"`` (for an environment variable). A key is 32 bytes, or base64 / urlsafe
    base64 of 32 bytes. Error messages name the key id, never the key.
    """
    if raw is None or raw == "" or raw == () or raw == [] or raw == {}:
        return ()
    pairs: list[tuple[t.Any, t.Any]]
    if isinstance(raw, str):
        pairs = []
        for item in re.split(r"[\s,]+", raw.strip()):
            key_id, sep, secret = item.partition(":")
            if not sep:
                raise ConfigurationError(
                    f"{name}: write each key as id:base64key, separated by commas"
                )
            pairs.append((key_id, secret))
    elif isinstance(raw, t.Mapping):
        pairs = list(raw.items())
    else:
        try:
            pairs = [tuple(pair) for pair in raw]
        except TypeError:
            raise ConfigurationError(
                f"{name} must be a mapping {{id: key}}, a list of (id, key) pairs, or a string "
                "'id:key,id:key'"
            ) from None
    keys: list[EncryptionKey] = []
    for pair in pairs:
        if len(pair) != 2:
            raise ConfigurationError(f"{name}: give each key as a pair (id, key)")
        key_id, secret = pair
        if not isinstance(key_id, str) or not KEY_ID_PATTERN.fullmatch(key_id):
            # Not echoed: a key given in the id's place (pair reversed) would end up in a log.
            raise ConfigurationError(
                f"{name}: key number {len(keys) + 1} has an invalid id; a key id is 1 to "
                f"{KEY_ID_SIZE} characters from A-Z a-z 0-9 . _ - (is the pair reversed?)"
            )
        if any(key.id == key_id for key in keys):
            raise ConfigurationError(f"{name}: key id {key_id!r} is given twice")
        keys.append(EncryptionKey(key_id, _decode_secret(secret, key_id, name)))
    return tuple(keys)


def _decode_secret(secret: t.Any, key_id: str, name: str) -> bytes:
    if isinstance(secret, bytes | bytearray) and len(secret) == 32:
        return bytes(secret)
    if isinstance(secret, bytes | bytearray):
        secret = bytes(secret).decode("ascii", "replace")
    if not isinstance(secret, str):
        raise ConfigurationError(f"{name}: key {key_id!r} is not a string; {_KEY_FORMAT}")
    # Both alphabets, padding optional; anything outside them is an error (validate=True),
    # never silently dropped.
    text = secret.strip().translate(_URLSAFE).rstrip("=")
    try:
        decoded = base64.b64decode(text + "=" * (-len(text) % 4), validate=True)
    except (binascii.Error, ValueError):
        decoded = b""
    if len(decoded) != 32:
        raise ConfigurationError(f"{name}: key {key_id!r} is not 32 bytes in base64; {_KEY_FORMAT}")
    return decoded


def generate_key() -> str:
    """A new random key as urlsafe base64 (for ``flask idem keys generate``)."""
    return base64.urlsafe_b64encode(os.urandom(32)).decode("ascii")


def _cipher_class() -> t.Any:
    try:
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM
    except ImportError:
        raise ConfigurationError(
            "IDEMPOTENCY_ENCRYPTION_KEYS needs the cryptography package: "
            "pip install 'flask-idem[encryption]'"
        ) from None
    return AESGCM


def _associated_data(
    header: bytes, scope: Scope, created_at: dt.datetime, status: int, key: str | None = None
) -> bytes:
    """What a ciphertext is bound to: its record (the key as stored, see
    :func:`~flask_idem.core.key_digest.stored_of`), its ``created_at`` and its status.

    :param key: the key to bind instead (the raw key, for envelopes sealed before 0011).
    """
    created = created_at.astimezone(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    key = stored_of(scope) if key is None else key
    parts = (scope.tenant, scope.endpoint, key, created, str(status))
    # Length-prefixed, so that no two different tuples give the same bytes.
    material = b"".join(b"%d:%s" % (len(p.encode()), p.encode()) for p in parts)
    return header + _AAD_CONTEXT + material


@dataclasses.dataclass(frozen=True)
class Sealer:
    """How one application stores response snapshots: compression threshold and keys.

    :param keys: the first one encrypts; all of them decrypt. Empty: no encryption.
    :param compress_min: bodies of at least this many bytes are compressed (when it saves
        space); None switches compression off.
    :param require_encrypted: refuse to replay snapshots stored unencrypted (a row forged in
        clear by someone with write access to the database is then never replayed).
    """

    keys: tuple[EncryptionKey, ...] = ()
    compress_min: int | None = DEFAULT_COMPRESS_MIN
    require_encrypted: bool = False

    def __post_init__(self) -> None:
        if self.keys:
            _cipher_class()  # fail at configuration time, not at the first request
        if self.require_encrypted and not self.keys:
            raise ConfigurationError(
                "IDEMPOTENCY_REQUIRE_ENCRYPTED needs IDEMPOTENCY_ENCRYPTION_KEYS"
            )

    @classmethod
    def from_settings(cls, settings: Settings) -> Sealer:
        """The sealer an application's :class:`~flask_idem.core.config.Settings` ask for."""
        return cls(settings.encryption_keys, settings.compress_min, settings.require_encrypted)

    @property
    def encrypting(self) -> bool:
        return bool(self.keys)

    @functools.cached_property
    def _ciphers(self) -> dict[str, t.Any]:
        aesgcm = _cipher_class()
        return {key.id: aesgcm(key.secret) for key in self.keys}

    def seal(
        self, response: StoredResponse, scope: Scope, created_at: dt.datetime | None
    ) -> tuple[list[list[str]] | None, bytes]:
        """The ``(response_headers, response_body)`` column values of a snapshot.

        :param created_at: the record's ``created_at``; required when encrypting.
        """
        headers = [list(pair) for pair in response.headers]
        compress = self.compress_min is not None and len(response.body) >= self.compress_min
        if not self.keys and not compress:
            return headers, response.body
        headers_json = json.dumps(headers, separators=(",", ":")).encode()
        payload = _LENGTH.pack(len(headers_json)) + headers_json + response.body
        flags = 0
        if compress:
            packed = zlib.compress(payload, COMPRESS_LEVEL)
            if len(packed) < len(payload):
                payload, flags = packed, COMPRESSED
        if not self.keys:
            if not flags:
                return headers, response.body  # did not compress: plain is smaller
            return None, _header(flags, b"") + payload
        if created_at is None:
            raise ValueError("sealing an encrypted snapshot needs the record's created_at")
        key = self.keys[0]
        header = _header(flags | ENCRYPTED, key.id.encode("ascii"))
        nonce = os.urandom(NONCE_SIZE)
        aad = _associated_data(header, scope, created_at, response.status)
        return None, header + nonce + self._ciphers[key.id].encrypt(nonce, payload, aad)

    def open(
        self,
        scope: Scope,
        created_at: dt.datetime,
        status: int,
        headers: t.Any,
        body: bytes,
    ) -> StoredResponse:
        """The snapshot stored in a row's columns.

        :raises UnreadableResponse: the envelope is malformed, its key is not configured, the
            ciphertext does not authenticate (wrong key, tampered, moved from another row), or
            it is stored unencrypted while ``require_encrypted`` is on.
        """
        if isinstance(status, bool) or not isinstance(status, int):
            raise UnreadableResponse("the stored status is not an HTTP status")
        if status not in STORABLE_STATUSES:
            raise UnreadableResponse(f"status {status} is never stored")
        if headers is not None:
            if self.require_encrypted:
                raise UnreadableResponse("stored unencrypted (IDEMPOTENCY_REQUIRE_ENCRYPTED)")
            return StoredResponse(status, _header_pairs(headers), body)
        if len(body) < HEADER_SIZE or body[: len(MAGIC)] != MAGIC:
            raise UnreadableResponse("malformed envelope")
        header = body[:HEADER_SIZE]
        version, flags = header[len(MAGIC)], header[len(MAGIC) + 1]
        if version != VERSION or flags & ~(COMPRESSED | ENCRYPTED):
            raise UnreadableResponse(f"unknown envelope version {version} (flags {flags:#x})")
        payload = body[HEADER_SIZE:]
        if flags & ENCRYPTED:
            payload = self._decrypt(header, payload, scope, created_at, status)
        elif self.require_encrypted:
            raise UnreadableResponse("stored unencrypted (IDEMPOTENCY_REQUIRE_ENCRYPTED)")
        if flags & COMPRESSED:
            payload = _inflate(payload)
        return _split(status, payload)

    def _decrypt(
        self, header: bytes, sealed: bytes, scope: Scope, created_at: dt.datetime, status: int
    ) -> bytes:
        key_id = key_id_of(header[KEY_ID_OFFSET - 1 :])
        if key_id is None:
            raise UnreadableResponse("malformed envelope: encrypted without a key id")
        cipher = self._ciphers.get(key_id)
        if cipher is None:
            raise UnreadableResponse(
                f"encrypted with key {key_id!r}, which is not in IDEMPOTENCY_ENCRYPTION_KEYS"
            )
        if len(sealed) < NONCE_SIZE + TAG_SIZE:
            raise UnreadableResponse("malformed envelope: ciphertext too short")
        from cryptography.exceptions import InvalidTag

        nonce, ciphertext = sealed[:NONCE_SIZE], sealed[NONCE_SIZE:]
        bound = [_associated_data(header, scope, created_at, status)]
        if not is_stored(scope.key):
            # Sealed before revision 0011 digested keys: bound to the raw key, which a retry
            # still carries.
            bound.append(_associated_data(header, scope, created_at, status, scope.key))
        for aad in bound:
            try:
                return bytes(cipher.decrypt(nonce, ciphertext, aad))
            except InvalidTag:
                pass
        raise UnreadableResponse(
            f"does not authenticate with key {key_id!r} (wrong key material, altered, or "
            "copied from another record)"
        )


def _header(flags: int, key_id: bytes) -> bytes:
    return MAGIC + bytes((VERSION, flags)) + key_id.ljust(KEY_ID_SIZE, b"\0")


def key_id_of(field: bytes) -> str | None:
    """The key id in an envelope's key id field (the bytes from ``KEY_ID_OFFSET`` on), None
    when the envelope is not encrypted."""
    key_id = bytes(field[:KEY_ID_SIZE]).rstrip(b"\0")
    return key_id.decode("ascii", "replace") if key_id else None


def _inflate(data: bytes) -> bytes:
    inflater = zlib.decompressobj()
    try:
        payload = inflater.decompress(data, MAX_PAYLOAD)
    except zlib.error:
        raise UnreadableResponse("compressed payload is corrupt") from None
    if inflater.unconsumed_tail or not inflater.eof:
        raise UnreadableResponse("compressed payload is truncated or too large")
    return payload


def _split(status: int, payload: bytes) -> StoredResponse:
    try:
        (length,) = _LENGTH.unpack_from(payload)
        headers = json.loads(payload[_LENGTH.size : _LENGTH.size + length])
    except (struct.error, ValueError, RecursionError):
        # RecursionError: a forged payload nested deeper than the parser's stack.
        raise UnreadableResponse("malformed payload") from None
    return StoredResponse(status, _header_pairs(headers), payload[_LENGTH.size + length :])


def _header_pairs(headers: t.Any) -> tuple[tuple[str, str], ...]:
    """The stored headers as ``seal`` wrote them, a list of ``[name, value]`` string pairs
    that are valid HTTP fields; anything else was written by someone else and is not replayed
    (a CR or LF in it would even inject headers into the replay)."""
    if not isinstance(headers, list):
        raise UnreadableResponse("malformed headers")
    pairs = []
    for pair in headers:
        if not (isinstance(pair, list) and len(pair) == 2):
            raise UnreadableResponse("malformed headers")
        name, value = pair
        if not (
            isinstance(name, str)
            and isinstance(value, str)
            and HEADER_NAME.fullmatch(name)
            and HEADER_VALUE.fullmatch(value)
        ):
            raise UnreadableResponse("malformed headers")
        pairs.append((name, value))
    return tuple(pairs)
