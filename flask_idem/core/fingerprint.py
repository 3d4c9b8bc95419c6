"""Request fingerprints, so that a retry matches its original and a different request does not.

An idempotency key is only safe if the server can tell a genuine retry from a client
reusing the key for a different request. The fingerprint is the SHA-256 digest of a
*canonical request*, which removes the differences that carry no meaning:

* The method is upper-cased and view arguments are compared as strings, because that is
  how they reach the view.
* Query pairs and form fields are sorted by name (a repeated field keeps the order of its
  values, which the view sees), because clients and proxies do not preserve
  their order.
* JSON bodies are re-serialised with sorted keys and no whitespace, because key order and
  formatting are transport noise.
* JSON numbers compare by value (``4200``, ``4200.0``, ``4.2e3`` and ``42e2`` are equal),
  because clients' JSON libraries spell the same number differently. They are parsed as
  :class:`~decimal.Decimal`, so large integers stay exact.
* Strings are never numbers, and ``true``/``null`` are never ``1``/``"null"``, because the
  view sees different types.
* Volatile top-level fields, such as a client timestamp, are left out through the view's
  ``exclude``/``include`` options, because they change on every retry.

Bodies that cannot be canonicalised (malformed JSON, ``NaN``, invalid UTF-8, duplicate
keys), and bodies too large to canonicalise cheaply (more than :data:`MAX_CANONICAL_VALUES`
JSON values or form fields, counted from their separators before any parsing), are not
rejected here: they are fingerprinted byte for byte, tagged so they never
equal a canonical form, and the view itself answers 400. ``multipart/form-data`` bodies
are also compared byte for byte together with the full ``Content-Type``, because their
boundaries are random per client: they only match when the boundary and bytes are the same.
"""

from __future__ import annotations

import base64
import decimal
import hashlib
import json
import typing as t
from json.encoder import encode_basestring
from urllib.parse import parse_qsl

#: Bumped whenever the canonical form changes, so that old fingerprints stop matching
#: instead of silently matching different requests.
_FORMAT = "flask-idem/fingerprint/1"

#: Deeper JSON is fingerprinted raw, so that the result never depends on how much of the
#: interpreter's recursion limit the caller's stack has already used.
_MAX_DEPTH = 128

#: Integral numbers with more trailing zeros are written with an exponent, so that a tiny
#: body such as ``1e999999999`` cannot expand into a huge canonical form.
_MAX_PLAIN_EXPONENT = 32

#: JSON values (or form fields) beyond which a body is fingerprinted byte for byte: parsing,
#: sorting and re-serialising costs about 7 ms per thousand values, so an attacker's object
#: with 200,000 members would otherwise cost seconds of CPU before the view even runs. The
#: count is an upper bound taken from the separators (``,`` and ``:``; ``&`` for forms).
MAX_CANONICAL_VALUES = 10_000

#: A run of zeros longer than integers are written in full with (see ``_canonical_number``).
_ZEROS = b"0" * (_MAX_PLAIN_EXPONENT + 1)

_JsonValue: t.TypeAlias = (
    "None | bool | decimal.Decimal | str | list[_JsonValue] | dict[str, _JsonValue]"
)


class _NotCanonicalError(ValueError):
    """Raised while parsing a JSON body that has no canonical form, to fall back to raw."""


def canonical_request(
    method: str,
    rule: str,
    view_args: t.Mapping[str, t.Any],
    query: t.Iterable[tuple[str, str]],
    body: bytes,
    content_type: str | None,
    *,
    exclude: t.Collection[str] = (),
    include: t.Collection[str] | None = None,
) -> bytes:
    """Return the canonical serialisation, so that equivalent requests give equal bytes.

    The result is a compact JSON array encoded as UTF-8 (lone surrogates are kept with
    ``surrogatepass`` rather than failing). Every part sits in its own JSON string or
    array, so no value can imitate a delimiter and distinct requests never collide.

    :param method: The HTTP method, compared case-insensitively.
    :param rule: The URL rule of the endpoint, e.g. ``"/v1/payments/<id>/refunds"``.
    :param view_args: The values matched by the rule's converters, compared as strings.
    :param query: The query pairs in arrival order, with repeated names allowed.
    :param body: The raw request body.
    :param content_type: The ``Content-Type`` header, or ``None`` if it is missing.
    :param exclude: Top-level JSON object keys or form field names to leave out.
    :param include: If given, the only top-level JSON object keys or form field names kept.
    :return: The canonical request bytes.
    """
    envelope = [
        _FORMAT,
        method.upper(),
        rule,
        [[name, str(value)] for name, value in sorted(view_args.items())],
        [[name, value] for name, value in _by_name(query)],
        _canonical_body(body, content_type, exclude, include),
    ]
    return _encode_envelope(envelope).encode("utf-8", "surrogatepass")


def _by_name(pairs: t.Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
    """Pairs sorted by name only: the order of fields means nothing, but the order of one
    field's values does (``request.args["a"]`` is the first ``a``)."""
    return sorted(pairs, key=lambda pair: pair[0])


def fingerprint(
    method: str,
    rule: str,
    view_args: t.Mapping[str, t.Any],
    query: t.Iterable[tuple[str, str]],
    body: bytes,
    content_type: str | None,
    *,
    exclude: t.Collection[str] = (),
    include: t.Collection[str] | None = None,
) -> bytes:
    """Return the SHA-256 digest of the canonical request, a fixed-size key to store.

    Takes the same parameters as :func:`canonical_request`.

    :return: The 32-byte digest.
    """
    canonical = canonical_request(
        method, rule, view_args, query, body, content_type, exclude=exclude, include=include
    )
    return hashlib.sha256(canonical).digest()


def _canonical_body(
    body: bytes,
    content_type: str | None,
    exclude: t.Collection[str],
    include: t.Collection[str] | None,
) -> list[object]:
    """Return the body part of the envelope, tagged by kind so kinds never collide."""
    # A client that sends no body may or may not send a Content-Type; both are the same request.
    if not body:
        return ["empty"]

    media_type = (content_type or "").split(";", 1)[0].strip().lower()

    if media_type == "application/json" or (
        media_type.startswith("application/") and media_type.endswith("+json")
    ):
        if body.count(b",") + body.count(b":") >= MAX_CANONICAL_VALUES:
            return _raw(media_type, body)
        try:
            return ["json", _canonical_json_body(body, exclude, include)]
        except (ValueError, ArithmeticError, RecursionError):
            # Decimal raises ArithmeticError on exponents it cannot hold, and the JSON
            # parser RecursionError on nesting beyond the interpreter's limit.
            return _raw(media_type, body)

    if media_type == "application/x-www-form-urlencoded":
        if body.count(b"&") >= MAX_CANONICAL_VALUES:
            return _raw(media_type, body)
        try:
            pairs = parse_qsl(
                body.decode("utf-8"), keep_blank_values=True, strict_parsing=False, errors="strict"
            )
        except UnicodeDecodeError:
            return _raw(media_type, body)
        return [
            "form",
            [[name, value] for name, value in _by_name(pairs) if _keep(name, exclude, include)],
        ]

    if media_type == "multipart/form-data":
        # The boundary is part of how the bytes are read, so it has to be part of the key.
        return ["multipart", content_type, _encode_bytes(body)]

    return _raw(media_type, body)


def _canonical_json_body(
    body: bytes, exclude: t.Collection[str], include: t.Collection[str] | None
) -> str:
    """Return the canonical JSON text of a body, or raise if it is not strict JSON."""
    text = body.decode("utf-8")
    plain = _plain_canonical_json(text, body, exclude, include)
    return _exact_canonical_json(text, exclude, include) if plain is None else plain


def _exact_canonical_json(
    text: str, exclude: t.Collection[str], include: t.Collection[str] | None
) -> str:
    """The canonical JSON text of any strict JSON body, numbers parsed as Decimals."""
    value: _JsonValue = json.loads(
        text,
        parse_float=decimal.Decimal,
        parse_int=decimal.Decimal,
        parse_constant=_reject_constant,
        object_pairs_hook=_reject_duplicate_keys,
    )
    if isinstance(value, dict):
        value = {key: item for key, item in value.items() if _keep(key, exclude, include)}
    return _canonical_json(value, 0)


def _plain_canonical_json(
    text: str, body: bytes, exclude: t.Collection[str], include: t.Collection[str] | None
) -> str | None:
    """The canonical JSON text of the common body, by the C parser and encoder; None when the
    body needs :func:`_canonical_json` (whose output this equals byte for byte).

    The common body has integers, never fractions or exponents (the parser refuses those
    here), so each number's canonical spelling is Python's own, unless its digits end in more
    than :data:`_MAX_PLAIN_EXPONENT` zeros (no such run anywhere in the body); and it has at
    most :data:`_MAX_DEPTH` brackets, so no value is nested deeper than the limit. Strings are
    encoded by the same function, and keys sorted the same way. Anything else the parser
    refuses (``NaN``, a duplicate key, an integer longer than Python converts) is decided by
    the exact path. A payment's body is canonicalised about three times faster this way.
    """
    if body.count(b"[") + body.count(b"{") > _MAX_DEPTH or _ZEROS in body:
        return None
    try:
        value = _parse_plain(text)
    except Exception:  # a fraction, or a body the exact path decides about
        return None
    if isinstance(value, dict) and (exclude or include is not None):
        value = {key: item for key, item in value.items() if _keep(key, exclude, include)}
    return _encode_plain(value)


class _Fraction(Exception):
    """A JSON number with a fraction or an exponent: canonicalised as a Decimal."""


def _refuse_fraction(_number: str) -> t.NoReturn:
    raise _Fraction


def _canonical_json(value: _JsonValue, depth: int) -> str:
    """Serialise a parsed value with sorted keys, no whitespace and numbers by value."""
    if depth > _MAX_DEPTH:
        raise _NotCanonicalError("JSON body is nested too deeply")
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, decimal.Decimal):
        return _canonical_number(value)
    if isinstance(value, str):
        # What json.dumps(value, ensure_ascii=False) returns, without building an encoder.
        return encode_basestring(value)
    if isinstance(value, list):
        return "[" + ",".join(_canonical_json(item, depth + 1) for item in value) + "]"
    members = (
        encode_basestring(key) + ":" + _canonical_json(item, depth + 1)
        for key, item in sorted(value.items())
    )
    return "{" + ",".join(members) + "}"


def _canonical_number(value: decimal.Decimal) -> str:
    """Return the one spelling of a number's value, so clients' spellings compare equal.

    Trailing zeros move into the exponent, so the coefficient and exponent are unique per
    value. Integers are written in full (``4200``); other values, and integers with more
    than :data:`_MAX_PLAIN_EXPONENT` trailing zeros, as ``<coefficient>e<exponent>``
    (``125e-2``). Zero of any sign or scale is ``0``. The result is a valid JSON number.
    """
    sign, digits, exponent = value.as_tuple()
    # JSON number syntax only produces finite decimals, whose exponent is an int.
    assert isinstance(exponent, int)
    spelled = "".join(map(str, digits))
    # Done on the digit string rather than with Decimal.normalize(), which rounds to the
    # context precision and would make large integers inexact.
    coefficient = spelled.rstrip("0")
    if not coefficient:
        return "0"
    exponent += len(spelled) - len(coefficient)
    prefix = "-" if sign else ""
    if 0 <= exponent <= _MAX_PLAIN_EXPONENT:
        return prefix + coefficient + "0" * exponent
    return f"{prefix}{coefficient}e{exponent}"


def _reject_constant(name: str) -> t.NoReturn:
    """Refuse ``NaN`` and ``Infinity``, which are not JSON and have no value to compare."""
    raise _NotCanonicalError(f"JSON body contains {name}")


def _reject_duplicate_keys(pairs: list[tuple[str, _JsonValue]]) -> dict[str, _JsonValue]:
    """Refuse duplicate keys, whose meaning depends on the parser that reads them."""
    obj = dict(pairs)
    if len(obj) != len(pairs):
        raise _NotCanonicalError("JSON body contains a duplicate key")
    return obj


def _keep(name: str, exclude: t.Collection[str], include: t.Collection[str] | None) -> bool:
    """Tell whether a top-level field takes part in the fingerprint."""
    return name not in exclude and (include is None or name in include)


def _raw(media_type: str, body: bytes) -> list[object]:
    """Return the byte-for-byte body part, for bodies without a canonical form."""
    return ["raw", media_type, _encode_bytes(body)]


def _encode_bytes(body: bytes) -> str:
    """Encode arbitrary bytes as text, so they fit in the JSON envelope."""
    return base64.b64encode(body).decode("ascii")


#: The envelope as ``json.dumps(envelope, ensure_ascii=False, separators=(",", ":"))`` writes
#: it, without building an encoder per request.
_encode_envelope = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode
#: :func:`_plain_canonical_json`'s parser: integers as ``int``, fractions refused, constants
#: and duplicate keys refused as by the exact path.
_parse_plain = json.JSONDecoder(
    parse_float=_refuse_fraction,
    parse_constant=_reject_constant,
    object_pairs_hook=_reject_duplicate_keys,
).decode
#: :func:`_plain_canonical_json`'s encoder: what :func:`_canonical_json` writes for such values.
_encode_plain = json.JSONEncoder(
    ensure_ascii=False, separators=(",", ":"), sort_keys=True, allow_nan=False
).encode
