"""Marshmallow input schemas, and reading a JSON body into one."""

from __future__ import annotations

import typing as t

from flask import request
from marshmallow import Schema, ValidationError, fields, validate
from werkzeug.exceptions import BadRequest

from . import problems

#: The largest amount the database column holds.
MAX_AMOUNT = 2**63 - 1


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


def amount_field() -> WholeNumber:
    return WholeNumber(required=True, validate=validate.Range(min=1, max=MAX_AMOUNT))


class PaymentSchema(Schema):
    amount = amount_field()
    currency = fields.String(
        required=True,
        validate=validate.Regexp(r"[a-z]{3}\Z", error="Must be three lowercase letters."),
    )
    customer = fields.String(required=True, validate=validate.Length(min=1, max=255))
    description = fields.String()
    metadata = fields.Dict(keys=fields.String(), values=fields.String())
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
    try:
        return t.cast(dict[str, t.Any], schema.load(body))
    except ValidationError as exc:
        messages = exc.messages if isinstance(exc.messages, dict) else {"_schema": exc.messages}
        raise problems.invalid_request(messages) from None
