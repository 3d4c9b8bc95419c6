"""Marshmallow schemas: how records are shown to tenants (the inspection endpoint) and to
operators (the CLI).

Stored bodies and headers are in :data:`BODY_FIELDS`, which callers exclude unless
``IDEMPOTENCY_INSPECT_BODIES`` is on: a stored response can hold card details or personal data,
and inspection is for "did it go through?", not for reading it again. Raw keys are in
:data:`KEY_FIELDS`, shown to operators only with ``--show-keys``.
"""

from __future__ import annotations

import base64
import typing as t

from marshmallow import Schema, fields

from .idempotency_keys import key_hash
from .record import Record, State

#: Fields that reveal the stored response beyond its status.
BODY_FIELDS = ("headers", "body", "body_encoding")
#: Fields that reveal the raw key.
KEY_FIELDS = ("key",)


def _body_encoding(record: Record) -> str | None:
    """How the stored body is shown: as UTF-8 text when it is, else as base64."""
    if record.response is None:
        return None
    try:
        record.response.body.decode("utf-8")
    except UnicodeDecodeError:
        return "base64"
    return "utf-8"


def _body(record: Record) -> str | None:
    encoding = _body_encoding(record)
    if record.response is None or encoding is None:
        return None
    body = record.response.body
    return body.decode("utf-8") if encoding == "utf-8" else base64.b64encode(body).decode("ascii")


def _field(function: t.Callable[[Record], t.Any]) -> fields.Function:
    return fields.Function(function)


class RequestSchema(Schema):
    """One use of a key as its tenant sees it (``GET <prefix>/requests/<key>``)."""

    endpoint = _field(lambda record: record.scope.endpoint)
    state = fields.Enum(State, by_value=True)
    first_seen = fields.DateTime(attribute="created_at")
    completed_at = fields.DateTime()
    #: The stored status, None until the operation completed.
    status = _field(lambda record: None if record.response is None else record.response.status)
    #: Whether a retry with the same request gets the stored response back.
    replays = _field(lambda record: record.state is State.COMPLETED and record.unreadable is None)
    #: After this moment the key is forgotten and the same key is a new operation.
    expires_at = fields.DateTime()
    headers = _field(
        lambda record: (
            None if record.response is None else [list(h) for h in record.response.headers]
        )
    )
    body = _field(_body)
    body_encoding = _field(_body_encoding)


class RecordSchema(RequestSchema):
    """A record as operators see it (``flask idem stuck|show|reconcile --json``)."""

    tenant = _field(lambda record: record.scope.tenant)
    key_hash = _field(lambda record: key_hash(record.scope))
    key = _field(lambda record: record.scope.key)
    fingerprint = _field(lambda record: record.fingerprint.hex())
    lease_expires_at = fields.DateTime()
    lease_expired = _field(lambda record: record.lease_expired)
    #: Why the stored response cannot be read (its encryption key is missing, ...), or None.
    unreadable = fields.String(allow_none=True)
    #: Seconds since the first request claimed the key (database clock).
    age_seconds = _field(lambda record: round((record.now - record.created_at).total_seconds(), 3))

    class Meta:
        # Who and what first, then when, then the outcome (``flask idem show`` prints in order).
        fields = (
            "tenant",
            "endpoint",
            "key_hash",
            "key",
            "state",
            "fingerprint",
            "first_seen",
            "age_seconds",
            "lease_expires_at",
            "lease_expired",
            "completed_at",
            "expires_at",
            "status",
            "replays",
            "unreadable",
            *BODY_FIELDS,
        )


def request_schema(*, bodies: bool, many: bool = False) -> RequestSchema:
    """The tenant's view, with the stored body only when ``bodies``."""
    return RequestSchema(many=many, exclude=() if bodies else BODY_FIELDS)


def record_schema(*, bodies: bool, keys: bool, many: bool = False) -> RecordSchema:
    """The operator's view, with the stored body only when ``bodies`` and keys as stored
    (digests, see :mod:`flask_idem.core.key_digest`) only when ``keys``."""
    excluded = (() if bodies else BODY_FIELDS) + (() if keys else KEY_FIELDS)
    return RecordSchema(many=many, exclude=excluded)
