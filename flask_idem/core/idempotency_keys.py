"""Idempotency keys: generating, reading from headers, hashing for logs, deriving downstream."""

from __future__ import annotations

import datetime as dt
import functools
import hashlib
import re
import secrets
import typing as t
import uuid

from werkzeug.datastructures import EnvironHeaders

from .key_digest import stored_of
from .record import Record, Scope

#: A valid key: 1 to 255 characters that survive headers, logs and URLs unescaped.
KEY_PATTERN = re.compile(r"[A-Za-z0-9\-_.:~+/=]{1,255}")

#: Header names the environ lookup would not read as ``getlist`` does (see header_values).
_SPECIAL_NAME = re.compile(r"_|^content-(type|length)$", re.IGNORECASE)

# Namespace of keys derived for downstream calls (a fixed, random UUID).
_DOWNSTREAM_NAMESPACE = uuid.UUID("5f1d2c1e-8a3b-4f6e-9c7d-2b4a6e8f0a13")


class InvalidKey(ValueError):
    """A key header that is present but unusable; the message is safe to show the client."""


def normalize(value: str) -> str:
    """Strip optional white space and a structured-field string's quotes, then validate.

    ``"abc"`` (RFC 9651 sf-string, as the IETF draft asks) and ``abc`` (what most clients
    send) are the same key. Escapes can never be valid, because ``"`` and ``\\`` are not in
    the key alphabet.
    """
    value = value.strip(" \t")
    if len(value) >= 2 and value[0] == value[-1] == '"':
        value = value[1:-1]
    return check_key(value)


def check_key(value: str) -> str:
    """``value`` if it is a valid key (as a header, a webhook's event id or a job's key).

    :raises InvalidKey: it is not 1 to 255 characters from the key alphabet.
    """
    if not KEY_PATTERN.fullmatch(value):
        raise InvalidKey(
            "an idempotency key is 1 to 255 characters from A-Z a-z 0-9 - _ . : ~ + / ="
        )
    return value


def header_values(headers: t.Any, name: str) -> t.Sequence[str]:
    """Every value of header ``name``.

    A request's headers live in the WSGI environ, where the server has already joined a
    repeated header into one value: one dictionary lookup then, instead of
    ``getlist``'s walk over the whole environ on every protected request. Names the lookup
    would read differently from ``getlist`` (an ``_``, which the environ spells as ``-``;
    ``Content-Type`` and ``Content-Length``, which servers set empty when absent) keep the walk.
    """
    if isinstance(headers, EnvironHeaders) and _environ_readable(name):
        value = headers.get(name)
        return () if value is None else (value,)
    return t.cast(t.Sequence[str], headers.getlist(name))


@functools.lru_cache(maxsize=64)
def _environ_readable(name: str) -> bool:
    """Whether the environ lookup reads header ``name`` as ``getlist`` does (the configured
    names, asked on every protected request)."""
    return not _SPECIAL_NAME.search(name)


def echo_of_invalid(headers: t.Any, names: t.Sequence[str]) -> str | None:
    """What to echo for an invalid key: the one value sent, unquoted, if it is printable ASCII.

    Echoing lets a client match the 400 to its request; anything that could not travel back in
    a header safely (control or non-ASCII characters, two different values) is not echoed.
    """
    values = [value for name in names for value in header_values(headers, name)]
    if len(set(values)) != 1:
        return None
    value = str(values[0]).strip(" \t")
    if len(value) >= 2 and value[0] == value[-1] == '"':
        value = value[1:-1]
    if not value or len(value) > 1024 or not all(" " <= char <= "~" for char in value):
        return None
    return value


def read_key(headers: t.Any, names: t.Sequence[str]) -> str | None:
    """The key carried by any of the header ``names`` (case-insensitive), or None.

    :raises InvalidKey: a value is invalid, or the headers carry different keys.
    """
    found: set[str] = set()
    for name in names:
        for value in header_values(headers, name):
            found.add(normalize(value))
    if len(found) > 1:
        raise InvalidKey(f"{' and '.join(names)} carry different keys; send one key")
    return found.pop() if found else None


def key_hash(scope: Scope) -> str:
    """A short, stable digest of a scope for logs and signals, never the raw key.

    Made from the key as stored (its digest, see :mod:`flask_idem.core.key_digest`), so that
    the database computes the same value from a row (``flask idem show --key-hash``) and
    nothing needs the raw key or the secret.
    """
    material = "\x1f".join((scope.tenant, scope.endpoint, stored_of(scope))).encode()
    return hashlib.sha256(material).hexdigest()[:16]


def derive_key(record: Record, step: str) -> str:
    """A deterministic key for one downstream call of one operation.

    Every execution of the operation (the first, and a re-execution after a takeover) derives
    the same key for ``step``, so a payment provider that deduplicates on it charges once.
    Different steps, tenants, endpoints, keys, and a key reused after it expired (a new
    record, so a new ``created_at``) never share a downstream key.

    Derived from the key as its record stores it (its digest), not from the raw key: a
    reconciler or the next-day check, which read records from the table, derive the same keys
    as the request did.
    """
    scope = record.scope
    # In UTC: database sessions in other time zones must derive the same key.
    created = record.created_at.astimezone(dt.timezone.utc).isoformat()
    parts = (scope.tenant, scope.endpoint, stored_of(scope), created, step)
    material = "".join(f"{len(part)}:{part}" for part in parts)
    return str(uuid.uuid5(_DOWNSTREAM_NAMESPACE, material))


KeyFormat = t.Literal["uuid4", "uuid7", "ulid", "token"]


def new_key(kind: KeyFormat = "uuid4") -> str:
    """A fresh key for one logical operation, from the operating system's random source.

    Generate it once, persist it with the pending operation, then send it on every attempt.

    :param kind: ``uuid4`` (default, 122 random bits), ``uuid7`` (time-ordered: 48-bit
        milliseconds and 74 random bits), ``ulid`` (26 characters, time-ordered, 80 random bits)
        or ``token`` (128 random bits, 22 base64url characters).
    """
    if kind == "uuid4":
        return str(uuid.uuid4())
    if kind == "token":
        return secrets.token_urlsafe(16)
    if kind == "uuid7":
        import uuid6  # the standard library has no UUIDv7 before Python 3.14

        return str(uuid6.uuid7())
    if kind == "ulid":
        import ulid

        return str(_ulid_generator(ulid).generate())
    raise ValueError(f"unknown key format {kind!r}; use uuid4, uuid7, ulid or token")


@functools.cache
def _ulid_generator(module: t.Any) -> t.Any:
    # Pure randomness for every ULID: the default monotonic policy would make two keys of the
    # same millisecond differ by one, so one key would reveal the next.
    return module.ULIDGenerator(policy=module.PureRandomPolicy())
