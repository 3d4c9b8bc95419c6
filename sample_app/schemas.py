"""Marshmallow input schemas, and reading a JSON body into one."""

from __future__ import annotations

import typing as t

from flask import request
from marshmallow import Schema, ValidationError, fields, validate
from werkzeug.exceptions import BadRequest

from . import problems

#: The largest amount the database column holds.
MAX_AMOUNT = 2**63 - 1
#: A payment's 201 echoes its description: bounded, the answer always fits the stored-answer
#: limit (``IDEMPOTENCY_MAX_BODY``, 256 KiB), even with every character escaped as 12 bytes
#: (``\\ud83d\\ude00``); a 201 too large to store could not be replayed to the retries.
#: A longer description is a 400 before any charge.
DESCRIPTION_MAX = 1000


class WholeNumber(fields.Integer):
    """An integer that JSON may spell ``4200``, ``4200.0`` or ``4.2e3``.

    The extension fingerprints these spellings as one request, so the view must accept them
    alike; a fractional, boolean or string amount is still invalid (never truncated).
    """

    def _validated(self, value: t.Any) -> int:
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.make_error("invalid", input=value)
        return value


class Text(fields.String):
    """A string the database can store: no NUL character, no lone surrogate.

    PostgreSQL text cannot hold NUL and UTF-8 cannot encode a lone surrogate; both parse as
    JSON, so they must be refused here (400) rather than fail in an INSERT after the charge.
    """

    def _deserialize(self, value: t.Any, attr: str | None, data: t.Any, **kwargs: t.Any) -> str:
        text = super()._deserialize(value, attr, data, **kwargs)
        if "\x00" in text:
            raise ValidationError("Must not contain NUL characters.")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise ValidationError("Must be valid Unicode text.") from None
        return text


def amount_field() -> WholeNumber:
    return WholeNumber(required=True, validate=validate.Range(min=1, max=MAX_AMOUNT))


class PaymentSchema(Schema):
    amount = amount_field()
    currency = Text(
        required=True,
        validate=validate.Regexp(r"[a-z]{3}\Z", error="Must be three lowercase letters."),
    )
    customer = Text(required=True, validate=validate.Length(min=1, max=255))
    description = Text(validate=validate.Length(max=DESCRIPTION_MAX))
    metadata = fields.Dict(keys=Text(), values=Text())
    # Volatile: left out of the fingerprint (see the view's ``exclude``), accepted and ignored.
    client_ts = fields.Raw()


class RefundSchema(Schema):
    amount = amount_field()


def load_body(schema: Schema) -> dict[str, t.Any]:
    """The request's JSON object validated by ``schema``, or a 400 problem listing the errors."""
    if not request.is_json:
        raise problems.invalid_request({"_schema": ["Send a JSON object as application/json."]})
    try:
        body = request.get_json()
    except BadRequest:
        raise problems.invalid_request({"_schema": ["The body is not valid JSON."]}) from None
    except RecursionError:
        # json.loads recurses once per nesting level: ~1,000 levels exhaust the stack.
        raise problems.invalid_request({"_schema": ["The body is nested too deeply."]}) from None
    try:
        return t.cast(dict[str, t.Any], schema.load(body))
    except ValidationError as exc:
        messages = exc.messages if isinstance(exc.messages, dict) else {"_schema": exc.messages}
        raise problems.invalid_request(messages) from None
