"""Key scopes: which requests share the namespace of one idempotency key.

A record's namespace is its :class:`~flask_idem.core.record.Scope` ``(tenant, endpoint, key)``.
The ``endpoint`` column says more than the endpoint when a view has a scope option:

``IDEMPOTENCY_SCOPE = "endpoint"`` (the default)
    ``POST /v1/payments``: one key per endpoint, as always (byte for byte).
``IDEMPOTENCY_SCOPE = "account"``
    ``*``: one key per tenant across every account-wide endpoint. The endpoint is taken out of
    the namespace and checked instead: the first :data:`TAG_SIZE` bytes of the record's
    fingerprint are a digest of the endpoint that claimed it (:func:`account_fingerprint`),
    so a reuse on another endpoint is told from a reuse with another body, without a column
    or a claim function of its own. The claim's lock on the namespace is what makes two
    endpoints racing with one key run exactly one of them.
``IDEMPOTENCY_PRINCIPAL``
    ``principal=<id> POST /v1/payments`` (or ``principal=<id> *``): the namespace is per
    principal inside the tenant. The tenant column stays the tenant (Citus distributes by it);
    the principal is an identifier the application returns (a user id, an API key's id),
    never a credential, so it may be stored and shown to operators.
"""

from __future__ import annotations

import hashlib
import typing as t

from werkzeug.exceptions import HTTPException

from .key_digest import HEAD_SIZE, KeyDigest
from .record import Record

ScopeName = t.Literal["endpoint", "account"]
SCOPES: tuple[ScopeName, ...] = ("endpoint", "account")
#: The endpoint column of an account-wide record: no endpoint is part of its namespace.
ACCOUNT = "*"
#: How the endpoint column of a per-principal record begins; the principal holds no space, so
#: the first space ends it.
PRINCIPAL_PREFIX = "principal="
#: The longest principal accepted, in characters.
MAX_PRINCIPAL = 128
#: The longest endpoint column (``String(255)`` in the table).
MAX_NAMESPACE = 255
#: Bytes of an account-wide fingerprint that name the endpoint; the rest is the request's
#: fingerprint, truncated (192 bits still tell any two requests apart).
#: The tag's length: the head a keyed fingerprint keys on its own (see ``key_digest``).
TAG_SIZE = HEAD_SIZE
_FINGERPRINT_SIZE = 32


class PrincipalInvalid(ValueError):
    """A principal callable's value that cannot name a namespace."""


def check_principal(value: object) -> str:
    """The principal ``value`` spells: a string or an integer (a user id), 1 to
    :data:`MAX_PRINCIPAL` printable characters, no white space.

    :raises PrincipalInvalid: it is none of these (None included: no principal).
    """
    if isinstance(value, bool) or not isinstance(value, str | int):
        raise PrincipalInvalid(f"the principal must be a string or an integer, not {_kind(value)}")
    if isinstance(value, int) and value.bit_length() > 4 * MAX_PRINCIPAL:
        # Too long to spell: str() of a huge int raises ValueError on Python 3.11+.
        raise PrincipalInvalid(f"the principal must be 1 to {MAX_PRINCIPAL} characters")
    spelled = str(value)
    if not 0 < len(spelled) <= MAX_PRINCIPAL:
        raise PrincipalInvalid(f"the principal must be 1 to {MAX_PRINCIPAL} characters")
    if not spelled.isprintable() or any(character.isspace() for character in spelled):
        raise PrincipalInvalid("the principal must be printable characters without white space")
    return spelled


def resolve_principal(resolve: t.Callable[[], t.Any] | None) -> str | None:
    """The current caller's principal by ``resolve`` (``IDEMPOTENCY_PRINCIPAL`` or a view's
    ``principal=``), checked by :func:`check_principal`; None when there is no callable. An
    ``HTTPException`` it raises (``abort(401)``) is its own answer and goes through.

    :raises PrincipalInvalid: it raised (the exception is the ``__cause__``, and may carry the
        credential the principal was looked up by: log it redacted), or returned nothing usable.
    """
    if resolve is None:
        return None
    try:
        value = resolve()
    except HTTPException:
        raise
    except Exception as exc:
        raise PrincipalInvalid("the principal callable raised") from exc
    return check_principal(value)


def _kind(value: object) -> str:
    return "None" if value is None else type(value).__name__


def namespace(endpoint: str, scope: ScopeName, principal: str | None) -> str:
    """The endpoint column of a request's records (see the module's table).

    :raises PrincipalInvalid: the principal and the endpoint do not fit the column.
    """
    name = ACCOUNT if scope == "account" else endpoint
    if principal is None:
        return name
    spelled = f"{PRINCIPAL_PREFIX}{principal} {name}"
    if len(spelled) > MAX_NAMESPACE:
        raise PrincipalInvalid(
            f"the principal and the endpoint are {len(spelled)} characters together; the "
            f"record holds {MAX_NAMESPACE}"
        )
    return spelled


def split(column: str) -> tuple[str | None, str]:
    """``(principal or None, endpoint or ACCOUNT)`` of an endpoint column."""
    if column.startswith(PRINCIPAL_PREFIX) and " " in column:
        principal, _, name = column[len(PRINCIPAL_PREFIX) :].partition(" ")
        return principal, name
    return None, column


def is_account(column: str) -> bool:
    """Whether records of this endpoint column are account-wide."""
    return split(column)[1] == ACCOUNT


def endpoint_tag(endpoint: str) -> bytes:
    """The digest of an endpoint an account-wide fingerprint begins with."""
    return hashlib.sha256(b"flask-idem endpoint\x00" + endpoint.encode()).digest()[:TAG_SIZE]


def account_fingerprint(endpoint: str, digest: bytes) -> bytes:
    """The fingerprint of an account-wide request: the endpoint's tag, then ``digest``
    truncated, 32 bytes as every fingerprint (the column, and custom stores, expect them)."""
    return endpoint_tag(endpoint) + digest[: _FINGERPRINT_SIZE - TAG_SIZE]


def used_elsewhere(record: Record, digest: bytes) -> bool:
    """Whether an account-wide ``record`` was claimed on another endpoint than the request
    whose fingerprint, as the record stores it (:meth:`.KeyDigest.as_stored`), is ``digest``."""
    return is_account(record.scope.endpoint) and record.fingerprint[:TAG_SIZE] != digest[:TAG_SIZE]


def endpoint_of(record: Record, endpoints: t.Iterable[str], keys: KeyDigest) -> str:
    """The endpoint a record was claimed on, as records of the endpoint scope spell it
    (``POST /v1/payments``), principal left out; for an account-wide record, the one of
    ``endpoints`` whose tag its fingerprint carries (keyed as ``keys`` keyed it), or
    :data:`ACCOUNT` when none does."""
    name = split(record.scope.endpoint)[1]
    if name != ACCOUNT:
        return name
    tag = record.fingerprint[:TAG_SIZE]
    for endpoint in endpoints:
        stored = keys.as_stored(record, account_fingerprint(endpoint, bytes(_FINGERPRINT_SIZE)))
        if stored is not None and stored[:TAG_SIZE] == tag:
            return endpoint
    return ACCOUNT
