"""Tests for request fingerprints: retries must match, different requests must not."""

from __future__ import annotations

import hashlib
import json
import typing as t
from decimal import Decimal
from urllib.parse import urlencode

import pytest
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from flask_idem.core.fingerprint import (
    _ZEROS,
    _exact_canonical_json,
    _plain_canonical_json,
    canonical_request,
    fingerprint,
)

JsonValue: t.TypeAlias = "None | bool | Decimal | str | list[JsonValue] | dict[str, JsonValue]"

fast = settings(max_examples=100, deadline=None)
# For tests that draw whole JSON documents, which are slow to generate and render.
slow = settings(max_examples=50, deadline=None)

# A top-level key that object_keys never produces, for fields a test adds itself.
NOISE = "\x01noise"

WHITESPACE = st.sampled_from(["", " ", "\n", "\t", " \r\n  "])

# Characters that a naive serialisation would use as delimiters, to provoke collisions.
TRICKY_TEXT = st.text(alphabet=st.sampled_from('ab/&=,:;"[]\\ \x00é'), max_size=6)


def decimals(max_exponent: int = 40) -> st.SearchStrategy[Decimal]:
    """Finite decimals with explicit coefficient and exponent, trailing zeros included."""
    return st.builds(
        lambda sign, coefficient, exponent: Decimal(
            (sign, tuple(int(d) for d in str(coefficient)), exponent)
        ),
        st.integers(0, 1),
        st.integers(0, 10**30),
        st.integers(-max_exponent, max_exponent),
    )


# Small alphabets make equal keys and strings likely, and cover escapes and non-ASCII.
object_keys = st.text(alphabet=st.sampled_from('ab"\\'), max_size=3)
strings = st.text(alphabet=st.sampled_from('a1 "\\\n\x00é😀'), max_size=5)

scalars: st.SearchStrategy[JsonValue] = st.none() | st.booleans() | decimals() | strings

json_values: st.SearchStrategy[JsonValue] = st.recursive(
    scalars,
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(object_keys, children, max_size=3)
    ),
    max_leaves=6,
)

json_objects: st.SearchStrategy[dict[str, JsonValue]] = st.dictionaries(
    object_keys, json_values, max_size=4
)

# Shallow objects for tests about top-level fields, where nesting only costs time.
flat_objects: st.SearchStrategy[dict[str, JsonValue]] = st.dictionaries(
    object_keys, scalars | st.lists(scalars, max_size=2), max_size=4
)


def semantic(value: JsonValue) -> object:
    """Return a key equal exactly for JSON values a view would treat as the same."""
    # Tagged because Python says True == 1 == Decimal(1), which JSON does not.
    if value is None:
        return ("null",)
    if isinstance(value, bool):
        return ("bool", value)
    if isinstance(value, Decimal):
        return ("number", value)
    if isinstance(value, str):
        return ("string", value)
    if isinstance(value, list):
        return ("array", tuple(semantic(item) for item in value))
    return ("object", frozenset((key, semantic(item)) for key, item in value.items()))


def spell_number(value: Decimal, data: st.DataObject) -> str:
    """Spell a number in one of the ways a JSON library might."""
    sign, digits, exponent = value.as_tuple()
    assert isinstance(exponent, int)
    prefix = "-" if sign else ""
    coefficient = "".join(map(str, digits))
    spellings = [
        f"{prefix}{coefficient}e{exponent}",
        f"{prefix}{coefficient}E{exponent:+d}",
        format(value, "f"),
    ]
    if coefficient != "0":
        zeros = data.draw(st.integers(1, 3))
        spellings.append(f"{prefix}{coefficient}{'0' * zeros}e{exponent - zeros}")
    if len(coefficient) > 1:
        spellings.append(
            f"{prefix}{coefficient[0]}.{coefficient[1:]}e{exponent + len(coefficient) - 1}"
        )
    return data.draw(st.sampled_from(spellings))


def render(value: JsonValue, data: st.DataObject) -> str:
    """Serialise a value with random key order, whitespace, escapes and number spellings."""

    def ws() -> str:
        return data.draw(WHITESPACE)

    def string(text: str) -> str:
        return json.dumps(text, ensure_ascii=data.draw(st.booleans()))

    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, Decimal):
        return spell_number(value, data)
    if isinstance(value, str):
        return string(value)
    if isinstance(value, list):
        return "[" + ws() + ",".join(ws() + render(item, data) + ws() for item in value) + "]"
    keys = data.draw(st.permutations(list(value)))
    members = (
        ws() + string(key) + ws() + ":" + ws() + render(value[key], data) + ws() for key in keys
    )
    return "{" + ws() + ",".join(members) + "}"


def canon(
    body: bytes,
    content_type: str | None = "application/json",
    *,
    exclude: t.Collection[str] = (),
    include: t.Collection[str] | None = None,
) -> bytes:
    """Return the canonical form of a POST to a fixed rule that differs only by body."""
    return canonical_request(
        "POST", "/v1/items", {}, [], body, content_type, exclude=exclude, include=include
    )


def as_body(value: JsonValue, data: st.DataObject) -> bytes:
    """Return a randomly rendered JSON body for a value."""
    return render(value, data).encode("utf-8")


def _plain(value: JsonValue) -> t.Any:
    """Convert decimals to ints or floats so the standard json module can write them."""
    if isinstance(value, Decimal):
        return int(value) if value == value.to_integral_value() else float(value)
    if isinstance(value, list):
        return [_plain(item) for item in value]
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    return value


# JSON equivalences


@slow
@given(json_values, st.data())
def test_json_renderings_of_the_same_value_match(value: JsonValue, data: st.DataObject) -> None:
    assert canon(as_body(value, data)) == canon(as_body(value, data))


@fast
@given(json_values, json_values, st.data())
def test_json_bodies_match_exactly_when_their_values_do(
    first: JsonValue, second: JsonValue, data: st.DataObject
) -> None:
    same = semantic(first) == semantic(second)
    assert (canon(as_body(first, data)) == canon(as_body(second, data))) == same


@slow
@given(json_objects, st.data())
def test_json_key_order_does_not_matter(value: dict[str, JsonValue], data: st.DataObject) -> None:
    keys = list(value)
    reordered = {key: value[key] for key in data.draw(st.permutations(keys))}
    assert canon(json.dumps(_plain(value)).encode()) == canon(
        json.dumps(_plain(reordered)).encode()
    )


@slow
@given(json_objects)
def test_json_whitespace_does_not_matter(value: dict[str, JsonValue]) -> None:
    compact = json.dumps(_plain(value), separators=(",", ":"))
    indented = json.dumps(_plain(value), indent=4)
    assert canon(compact.encode()) == canon(indented.encode())


@fast
@given(st.integers(-(10**40), 10**40).filter(bool))
def test_integer_spellings_match(number: int) -> None:
    digits = str(abs(number))
    sign = "-" if number < 0 else ""
    spellings = [
        f"{number}",
        f"{number}.0",
        f"{number}.00",
        f"{number}e0",
        f"{number}0e-1",
        f"{number}00E-2",
        f"{sign}{digits[0]}.{digits[1:] or '0'}e{len(digits) - 1}",
        f"{sign}{digits[0]}.{digits[1:] or '0'}E+{len(digits) - 1}",
    ]
    stripped = digits.rstrip("0") or "0"
    spellings.append(f"{sign}{stripped}e{len(digits) - len(stripped)}")
    forms = {canon(f'{{"amount":{spelling}}}'.encode()) for spelling in spellings}
    assert len(forms) == 1


@fast
@given(decimals(max_exponent=60), st.data())
def test_decimal_spellings_match(number: Decimal, data: st.DataObject) -> None:
    first = spell_number(number, data)
    second = spell_number(number, data)
    assert canon(f"[{first}]".encode()) == canon(f"[{second}]".encode())


@pytest.mark.parametrize(
    "spellings",
    [
        ["4200", "4200.0", "4.2e3", "4200.00", "42e2", "4.2E+3", "420000e-2"],
        ["0.1", "1e-1", "0.10", "10E-2", "0.01e1"],
        ["0", "-0", "0.0", "-0.0", "0e10", "0E-10"],
        ["1e40", "10000000000000000000000000000000000000000", "1.0e40"],
        ["1e999999999999999999", "10e999999999999999998"],
    ],
)
def test_number_spelling_examples(spellings: list[str]) -> None:
    assert len({canon(spelling.encode()) for spelling in spellings}) == 1


def test_unicode_escapes_match_literal_characters() -> None:
    assert canon('{"name":"Zoë 😀"}'.encode()) == canon(b'{"name":"Zo\\u00eb \\ud83d\\ude00"}')


# JSON non-equivalences


@fast
@given(decimals(), decimals())
def test_different_numbers_differ(first: Decimal, second: Decimal) -> None:
    assume(first != second)
    assert canon(f"{first}".encode()) != canon(f"{second}".encode())


@fast
@given(st.integers(10**17, 10**40))
def test_large_integers_stay_exact(number: int) -> None:
    assert canon(f"{number}".encode()) != canon(f"{number + 1}".encode())
    assert canon(f"{number}".encode()) != canon(f"{number}.0000000000000000000000001".encode())


def test_large_integer_example() -> None:
    assert canon(b"12345678901234567890") != canon(b"12345678901234567891")


def test_huge_exponent_stays_small() -> None:
    assert len(canon(b"1e999999999")) < 200


def test_exponent_beyond_decimal_range_is_compared_byte_for_byte() -> None:
    assert canon(b"[1e9999999999999999999999]") != canon(b"[ 1e9999999999999999999999]")


@fast
@given(decimals())
def test_numbers_are_not_strings(number: Decimal) -> None:
    text = str(number)
    assert canon(f'{{"a":{text}}}'.encode()) != canon(json.dumps({"a": text}).encode())


@pytest.mark.parametrize(
    ("first", "second"),
    [
        (b"4200", b'"4200"'),
        (b"true", b"1"),
        (b"false", b"0"),
        (b"null", b'"null"'),
        (b"null", b"0"),
        (b"true", b'"true"'),
        (b"[1,2]", b"[2,1]"),
        (b'{"a":[]}', b'{"a":{}}'),
        (b'{"a":""}', b'{"a":null}'),
        (b"{}", b"[]"),
    ],
)
def test_json_type_examples_differ(first: bytes, second: bytes) -> None:
    assert canon(first) != canon(second)


# Fallback to raw bytes for bodies that are not strict JSON


@pytest.mark.parametrize("constant", [b"NaN", b"Infinity", b"-Infinity"])
def test_non_finite_numbers_are_compared_byte_for_byte(constant: bytes) -> None:
    assert canon(b'{"a": ' + constant + b"}") != canon(b'{"a":' + constant + b"}")
    assert canon(b'{"a":' + constant + b"}") != canon(b'{"a":"' + constant + b'"}')


@slow
@given(json_values, st.sampled_from([b"NaN", b"Infinity", b"-Infinity"]), st.data())
def test_non_finite_numbers_never_match_valid_json(
    value: JsonValue, constant: bytes, data: st.DataObject
) -> None:
    assert canon(b"[" + constant + b"]") != canon(as_body(value, data))


@slow
@given(json_values, json_values, st.data())
def test_malformed_json_never_matches_valid_json(
    valid: JsonValue, other: JsonValue, data: st.DataObject
) -> None:
    # A trailing comma after the top-level value is never valid JSON.
    malformed = as_body(other, data) + b","
    assert canon(malformed) != canon(as_body(valid, data))


@fast
@given(st.binary(min_size=1), st.binary(min_size=1))
def test_malformed_json_bodies_differ_by_bytes(first: bytes, second: bytes) -> None:
    assume(first != second)
    # Invalid UTF-8 up front keeps every body malformed whatever bytes follow.
    assert canon(b"\xff" + first) != canon(b"\xff" + second)


def test_invalid_utf8_is_compared_byte_for_byte() -> None:
    invalid = canon(b'{"a":"\xff"}')
    assert invalid != canon(b'{"a":"\xfe"}')
    assert invalid != canon('{"a":"\xff"}'.encode())
    assert invalid != canon(b'{"a":"\\ufffd"}')


def test_byte_order_mark_is_compared_byte_for_byte() -> None:
    assert canon(b'\xef\xbb\xbf{"a":1}') != canon(b'{"a":1}')


def test_duplicate_keys_are_compared_byte_for_byte() -> None:
    assert canon(b'{"a":1,"a":2}') != canon(b'{"a":2}')
    assert canon(b'{"a":1,"a":2}') != canon(b'{"a":1, "a":2}')


def test_lone_surrogates_do_not_raise() -> None:
    assert canon(b'"\\ud800"') != canon(b'"\\ud801"')


def test_excessive_nesting_does_not_raise() -> None:
    deep = b"[" * 100_000 + b"]" * 100_000
    assert canon(deep) != canon(b"[" * 99_999 + b"]" * 99_999)


def test_moderate_nesting_is_canonicalised() -> None:
    assert canon(b"[ " * 100 + b"]" * 100) == canon(b"[" * 100 + b" ]" * 100)


def test_nesting_beyond_the_limit_is_compared_byte_for_byte() -> None:
    assert canon(b"[ " * 200 + b"]" * 200) != canon(b"[" * 200 + b" ]" * 200)


# exclude and include


@fast
@given(flat_objects, scalars, scalars, st.data())
def test_excluded_field_is_ignored(
    base: dict[str, JsonValue], first: JsonValue, second: JsonValue, data: st.DataObject
) -> None:
    with_first = as_body({**base, NOISE: first}, data)
    with_second = as_body({**base, NOISE: second}, data)
    without = as_body(base, data)
    exclude = [NOISE]
    assert canon(with_first, exclude=exclude) == canon(with_second, exclude=exclude)
    assert canon(with_first, exclude=exclude) == canon(without, exclude=exclude)
    if semantic(first) != semantic(second):
        assert canon(with_first) != canon(with_second)


@fast
@given(flat_objects, flat_objects, st.data())
def test_only_included_fields_count(
    kept: dict[str, JsonValue], other: dict[str, JsonValue], data: st.DataObject
) -> None:
    include = set(kept)
    dropped = {key: value for key, value in other.items() if key not in include}
    assert canon(as_body({**kept, **dropped}, data), include=include) == canon(
        as_body(kept, data), include=include
    )


@fast
@given(flat_objects, flat_objects, st.data())
def test_included_fields_still_distinguish(
    first: dict[str, JsonValue], second: dict[str, JsonValue], data: st.DataObject
) -> None:
    include = set(first) | set(second)
    same = semantic(first) == semantic(second)
    with_first = as_body({**first, NOISE: data.draw(scalars)}, data)
    with_second = as_body({**second, NOISE: data.draw(scalars)}, data)
    assert (canon(with_first, include=include) == canon(with_second, include=include)) == same


def test_exclude_wins_over_include() -> None:
    assert canon(b'{"a":1,"b":2}', include={"a", "b"}, exclude={"b"}) == canon(
        b'{"a":1,"b":3}', include={"a", "b"}, exclude={"b"}
    )


def test_exclude_only_applies_to_top_level_object_keys() -> None:
    assert canon(b'{"a":{"ts":1}}', exclude={"ts"}) != canon(b'{"a":{"ts":2}}', exclude={"ts"})
    assert canon(b'[{"ts":1}]', exclude={"ts"}) != canon(b'[{"ts":2}]', exclude={"ts"})
    assert canon(b'"ts"', include={"x"}) != canon(b'"other"', include={"x"})


def test_exclude_does_not_apply_to_query() -> None:
    def canonical(value: str) -> bytes:
        return canonical_request(
            "POST", "/r", {}, [("ts", value)], b"{}", "application/json", exclude={"ts"}
        )

    assert canonical("1") != canonical("2")


# Query strings

pairs = st.lists(st.tuples(TRICKY_TEXT, TRICKY_TEXT), max_size=6)


def with_query(query: t.Iterable[tuple[str, str]]) -> bytes:
    return canonical_request("POST", "/r", {}, query, b"", None)


def _fields_reordered(pairs: list[tuple[str, str]], data: st.DataObject) -> list[tuple[str, str]]:
    """A permutation of ``pairs`` in which each name keeps the order of its own values (the
    view sees the first value of a repeated name: that order is meaning, not transport)."""
    shuffled = data.draw(st.permutations(range(len(pairs))))
    by_name: dict[str, list[tuple[str, str]]] = {}
    for pair in pairs:
        by_name.setdefault(pair[0], []).append(pair)
    return [by_name[pairs[i][0]].pop(0) for i in shuffled]


@fast
@given(pairs, st.data())
def test_query_field_order_does_not_matter(
    query: list[tuple[str, str]], data: st.DataObject
) -> None:
    assert with_query(query) == with_query(_fields_reordered(query, data))


def test_the_order_of_a_repeated_fields_values_matters() -> None:
    assert with_query([("a", "1"), ("a", "2")]) != with_query([("a", "2"), ("a", "1")])
    form = [("a", "1"), ("b", "x"), ("a", "2")]
    swapped = [("a", "2"), ("b", "x"), ("a", "1")]
    assert canon(urlencode(form).encode(), FORM) != canon(urlencode(swapped).encode(), FORM)


def _by_name(fields: list[tuple[str, str]]) -> list[tuple[str, str]]:
    return sorted(fields, key=lambda pair: pair[0])  # stable: a name's values keep their order


@fast
@given(pairs, pairs)
@example(
    first=[("", ""), (":", ""), (":", ":")],
    second=[("", ""), (":", ":"), (":", "")],
)
def test_query_multisets_match_exactly_when_equal(
    first: list[tuple[str, str]], second: list[tuple[str, str]]
) -> None:
    # The same parameters: the same names, and each name's values in the same order (the
    # order of a repeated parameter's values is meaning, see above), whatever the names' order.
    same = _by_name(first) == _by_name(second)
    assert (with_query(first) == with_query(second)) == same


# Form bodies

FORM = "application/x-www-form-urlencoded"


@fast
@given(pairs, st.data())
def test_form_field_order_does_not_matter(
    fields: list[tuple[str, str]], data: st.DataObject
) -> None:
    reordered = _fields_reordered(fields, data)
    assert canon(urlencode(fields).encode(), FORM) == canon(urlencode(reordered).encode(), FORM)


@fast
@given(pairs, pairs)
@example(first=[(":", ""), (":", ":")], second=[(":", ":"), (":", "")])
def test_form_bodies_match_exactly_when_fields_do(
    first: list[tuple[str, str]], second: list[tuple[str, str]]
) -> None:
    # The same fields: the same names, and each name's values in the same order (the order of
    # a repeated field's values is meaning, see above), whatever the order of the names.
    same = _by_name(first) == _by_name(second)
    assert (
        canon(urlencode(first).encode(), FORM) == canon(urlencode(second).encode(), FORM)
    ) == same


@fast
@given(pairs, TRICKY_TEXT, TRICKY_TEXT)
def test_form_excluded_field_is_ignored(
    fields: list[tuple[str, str]], first: str, second: str
) -> None:
    fields = [(name, value) for name, value in fields if name != "ts"]
    body_first = urlencode([*fields, ("ts", first)]).encode()
    body_second = urlencode([("ts", second), *fields]).encode()
    assert canon(body_first, FORM, exclude={"ts"}) == canon(body_second, FORM, exclude={"ts"})
    if first != second:
        assert canon(body_first, FORM) != canon(body_second, FORM)


def test_form_include_keeps_only_named_fields() -> None:
    assert canon(b"a=1&b=2", FORM, include={"a"}) == canon(b"b=3&a=1", FORM, include={"a"})
    assert canon(b"a=1&b=2", FORM, include={"a"}) != canon(b"a=2&b=2", FORM, include={"a"})


def test_form_invalid_utf8_is_compared_byte_for_byte() -> None:
    assert canon(b"a=%FF", FORM) != canon(b"a=%EF%BF%BD", FORM)
    assert canon(b"a=\xff&b=1", FORM) != canon(b"b=1&a=\xff", FORM)


def test_form_is_not_json() -> None:
    assert canon(b"a=1", FORM) != canon(b"a=1", "text/plain")


# Content types, raw and empty bodies


def test_media_type_is_case_insensitive_and_ignores_parameters() -> None:
    body = b'{"b":1,"a":2}'
    assert canon(body, "Application/JSON; charset=UTF-8") == canon(b'{"a":2,"b":1}')
    assert canon(b"x", "Text/Plain; charset=utf-8") == canon(b"x", "text/plain")


def test_structured_json_suffix_is_json() -> None:
    media = "application/vnd.api+json"
    assert canon(b'{"b":1, "a":2}', media) == canon(b'{"a":2,"b":1}', media)


def test_other_media_types_are_compared_byte_for_byte() -> None:
    assert canon(b'{"b":1,"a":2}', "text/plain") != canon(b'{"a":2,"b":1}', "text/plain")
    assert canon(b'{"a":1}', "text/plain") != canon(b'{"a":1}')
    assert canon(b"x", "text/plain") != canon(b"x", "application/octet-stream")
    assert canon(b"x", None) != canon(b"x", "text/plain")


@fast
@given(st.binary(min_size=1), st.binary(min_size=1))
def test_raw_bodies_match_exactly_when_bytes_do(first: bytes, second: bytes) -> None:
    media = "application/octet-stream"
    assert (canon(first, media) == canon(second, media)) == (first == second)


def test_multipart_matches_only_with_the_same_boundary_and_bytes() -> None:
    body = b'--XyZ\r\nContent-Disposition: form-data; name="a"\r\n\r\n1\r\n--XyZ--\r\n'
    content_type = "multipart/form-data; boundary=XyZ"
    assert canon(body, content_type) == canon(body, content_type)
    assert canon(body, content_type) != canon(body, "multipart/form-data; boundary=xyz")
    other = body.replace(b"XyZ", b"AbC")
    assert canon(other, "multipart/form-data; boundary=AbC") != canon(body, content_type)


@pytest.mark.parametrize("content_type", [None, "", "application/json", FORM, "text/plain"])
def test_empty_body_matches_regardless_of_content_type(content_type: str | None) -> None:
    assert canon(b"", content_type) == canon(b"", None)
    assert canon(b"", content_type) != canon(b"{}")


# Method, rule and view arguments

methods = st.sampled_from(["POST", "post", "PUT", "Patch", "DELETE"])
view_arg_maps = st.dictionaries(TRICKY_TEXT, TRICKY_TEXT, max_size=3)


@fast
@given(
    st.tuples(methods, TRICKY_TEXT, view_arg_maps, pairs, st.binary(max_size=4)),
    st.tuples(methods, TRICKY_TEXT, view_arg_maps, pairs, st.binary(max_size=4)),
)
def test_requests_match_exactly_when_their_parts_do(
    first: tuple[str, str, dict[str, str], list[tuple[str, str]], bytes],
    second: tuple[str, str, dict[str, str], list[tuple[str, str]], bytes],
) -> None:
    def normal(request: tuple[str, str, dict[str, str], list[tuple[str, str]], bytes]) -> object:
        method, rule, view_args, query, body = request
        # The order of names means nothing; the order of one name's values does.
        values: dict[str, list[str]] = {}
        for name, value in query:
            values.setdefault(name, []).append(value)
        return method.upper(), rule, sorted(view_args.items()), sorted(values.items()), body

    def canonical(request: tuple[str, str, dict[str, str], list[tuple[str, str]], bytes]) -> bytes:
        method, rule, view_args, query, body = request
        return canonical_request(method, rule, view_args, query, body, "text/plain")

    assert (canonical(first) == canonical(second)) == (normal(first) == normal(second))


@fast
@given(view_arg_maps, st.data())
def test_view_arg_order_does_not_matter(view_args: dict[str, str], data: st.DataObject) -> None:
    reordered = dict(data.draw(st.permutations(list(view_args.items()))))
    assert canonical_request("POST", "/r", view_args, [], b"", None) == (
        canonical_request("POST", "/r", reordered, [], b"", None)
    )


@pytest.mark.parametrize(
    ("first", "second"),
    [
        ({"a": "b/c"}, {"a": "b", "c": ""}),
        ({"a": "b/c"}, {"a/b": "c"}),
        ({"a": 'b","c'}, {"a": "b", "c": ""}),
        ({"ab": ""}, {"a": "b"}),
    ],
)
def test_view_args_cannot_be_spliced(first: dict[str, str], second: dict[str, str]) -> None:
    assert canonical_request("POST", "/r", first, [], b"", None) != canonical_request(
        "POST", "/r", second, [], b"", None
    )


@pytest.mark.parametrize("delimiter", ["|", "\n", "\x00", " ", ",", ";", ":", "/", "&", "=", '"'])
def test_method_and_rule_cannot_be_spliced(delimiter: str) -> None:
    assert canonical_request("POST" + delimiter + "X", "/r", {}, [], b"", None) != (
        canonical_request("POST", "X" + delimiter + "/r", {}, [], b"", None)
    )


def test_query_values_cannot_be_spliced() -> None:
    assert with_query([("a", "1&b=2")]) != with_query([("a", "1"), ("b", "2")])
    assert with_query([("a", "")]) != with_query([])


def test_method_is_case_insensitive_and_view_args_compare_as_strings() -> None:
    assert canonical_request("post", "/r/<int:id>", {"id": 5}, [], b"", None) == (
        canonical_request("POST", "/r/<int:id>", {"id": "5"}, [], b"", None)
    )


def test_different_rules_differ() -> None:
    assert canonical_request("POST", "/a/<id>", {"id": "1"}, [], b"", None) != (
        canonical_request("POST", "/b/<id>", {"id": "1"}, [], b"", None)
    )


# fingerprint()


def test_fingerprint_is_sha256_of_the_canonical_request() -> None:
    args = ("POST", "/r/<id>", {"id": "7"}, [("q", "1")], b'{"a":1,"ts":2}', "application/json")
    digest = fingerprint(*args, exclude={"ts"})
    assert len(digest) == 32
    assert digest == hashlib.sha256(canonical_request(*args, exclude={"ts"})).digest()


def test_fingerprint_distinguishes_and_matches() -> None:
    def digest(body: bytes, **options: t.Any) -> bytes:
        return fingerprint("POST", "/r", {}, [], body, "application/json", **options)

    assert digest(b'{"a":1, "b":2}') == digest(b'{"b":2.0,"a":1}')
    assert digest(b'{"a":1}') != digest(b'{"a":2}')
    assert digest(b'{"a":1,"ts":1}', exclude={"ts"}) == digest(b'{"a":1,"ts":2}', exclude={"ts"})
    assert digest(b'{"a":1,"b":1}', include={"a"}) == digest(b'{"a":1,"b":2}', include={"a"})


def test_the_canonical_form_is_pinned_byte_for_byte() -> None:
    """Stored fingerprints outlive releases: a change to the canonical form (even one that
    keeps every equality) must bump ``_FORMAT`` instead of silently changing digests."""
    body = '{"b":[1.50,"\u00e9\\ud800",{"z":null,"a":true}],"a":"x\\"y","n":4.2e3}'.encode()
    canonical = canonical_request(
        "post",
        "/v1/p/<id>",
        {"id": 7},
        [("q", "2"), ("a", "1"), ("q", "1")],
        body,
        "application/json; charset=utf-8",
    )
    assert canonical == (
        b'["flask-idem/fingerprint/1","POST","/v1/p/<id>",[["id","7"]],'
        b'[["a","1"],["q","2"],["q","1"]],["json","{\\"a\\":\\"x\\\\\\"y\\",\\"b\\":[15e-1,'
        b'\\"\xc3\xa9\xed\xa0\x80\\",{\\"a\\":true,\\"z\\":null}],\\"n\\":4200}"]]'
    )


# The plain path (C parser and encoder, for bodies without fractions) and the exact path

plain_values: st.SearchStrategy[t.Any] = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(10**40), 10**40)
    | st.sampled_from([0, 10**32, -(10**32), 10**33, 7 * 10**40, 10**4000])
    | strings,
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(object_keys, children, max_size=3)
    ),
    max_leaves=8,
)


def _both_paths(body: bytes, **fields: t.Any) -> tuple[str | None, str | None]:
    """(plain, exact) canonical texts of a JSON body; None where a path declines or refuses."""
    text = body.decode("utf-8")
    exclude, include = fields.get("exclude", ()), fields.get("include")
    try:
        exact: str | None = _exact_canonical_json(text, exclude, include)
    except ValueError:
        exact = None
    return _plain_canonical_json(text, body, exclude, include), exact


@fast
@given(plain_values, st.booleans(), st.sampled_from([None, 1]))
def test_the_plain_path_writes_what_the_exact_path_writes(
    value: t.Any, ensure_ascii: bool, indent: int | None
) -> None:
    body = json.dumps(value, ensure_ascii=ensure_ascii, indent=indent).encode()
    plain, exact = _both_paths(body)
    assert exact is not None
    if _ZEROS not in body:
        assert plain is not None, "an integer body takes the plain path"
    assert plain in (None, exact)


@pytest.mark.parametrize(
    "body",
    [
        b"-0",
        b'{"a": -0, "b": [0, -1, 100]}',
        b"1" + b"0" * 32,  # written in full
        b"1" + b"0" * 33,  # 1e33
        b"9" * 5000,  # longer than Python converts to an int
        b'{"a": 1, "a": 2}',  # a duplicate key: the exact path refuses it
        b'{"a": NaN}',
        b"[" * 128 + b"1" + b"]" * 128,
        b"[" * 129 + b"1" + b"]" * 129,
        b'{"b": 1.5, "a": 2}',
        '"\\ud800 é \\u00e9"'.encode(),
    ],
)
def test_plain_path_examples(body: bytes) -> None:
    plain, exact = _both_paths(body)
    assert plain in (None, exact)


def test_the_plain_path_keeps_exclude_and_include() -> None:
    body = b'{"a": 1, "ts": 2, "b": [3]}'
    assert _both_paths(body, exclude={"ts"}) == ('{"a":1,"b":[3]}',) * 2
    assert _both_paths(body, include={"b"}) == ('{"b":[3]}',) * 2


def test_the_canonical_form_of_an_integer_body_is_pinned_byte_for_byte() -> None:
    body = b'{"n": 4200, "z": [true, null, -0], "s": "\\u00e9\\ud800", "big": 1000}'
    assert canonical_request("POST", "/p", {}, [], body, "application/json") == (
        b'["flask-idem/fingerprint/1","POST","/p",[],[],["json","{\\"big\\":1000,'
        b'\\"n\\":4200,\\"s\\":\\"\xc3\xa9\xed\xa0\x80\\",\\"z\\":[true,null,0]}"]]'
    )
