"""Each view and job option is declared once, as a key of a TypedDict: the dataclasses that hold
the validated values restate exactly those names, and the decorators taking ``**options``
refuse any other keyword, as a signature that listed them did."""

from __future__ import annotations

import dataclasses
import typing as t

import flask
import pytest

from flask_idem import Idempotency
from flask_idem.core.options import (
    EXEMPT,
    BlueprintOptionArgs,
    JobOptionArgs,
    JobOptions,
    OutcomeArgs,
    OutcomeOptions,
    ViewOptionArgs,
    ViewOptions,
)

#: The deprecated spelling of ``release_before_contact``: accepted, never stored.
ALIASES = {"declares_effects"}


def _keys(declaration: t.Any) -> set[str]:
    return set(declaration.__required_keys__ | declaration.__optional_keys__)


def _fields(options: type[t.Any], *positional: str) -> set[str]:
    return {field.name for field in dataclasses.fields(options)} - set(positional)


def test_the_dataclasses_hold_exactly_the_declared_options() -> None:
    """An option added to a TypedDict but not to its dataclass (or the other way round)
    fails here, not as a TypeError in a user's decorator."""
    assert _fields(OutcomeOptions) == _keys(OutcomeArgs) - ALIASES
    assert _fields(ViewOptions) == _keys(ViewOptionArgs) - ALIASES
    assert _fields(JobOptions, "name", "key", "tenant") == _keys(JobOptionArgs) - ALIASES
    assert _keys(BlueprintOptionArgs) == _keys(ViewOptionArgs) - {"key"}
    # A job's fingerprint= takes the job's arguments, a view's the request: same name, two types.
    assert _keys(OutcomeArgs) == _keys(ViewOptionArgs) & _keys(JobOptionArgs) - {"fingerprint"}


def test_every_option_keeps_its_default() -> None:
    """The defaults of the public keywords, as they were when each had its own parameter."""
    assert dataclasses.asdict(ViewOptions.build("f", ViewOptionArgs, {})) == {
        "ttl": None,
        "recovery": "fail",
        "release_before_contact": False,
        "required": None,
        "exclude": (),
        "include": None,
        "fingerprint": None,
        "atomic": False,
        "replay": None,
        "key_rate_limit": None,
        "scope": None,
        "principal": None,
        "key": None,
    }
    assert EXEMPT == ViewOptions()
    job = JobOptions.build("charge", "order_id", "merchant", {})
    assert (job.ttl, job.lease, job.recovery, job.release_before_contact, job.fingerprint) == (
        None,
        None,
        "fail",
        False,
        None,
    )


def test_iterables_are_stored_as_tuples() -> None:
    options = ViewOptions.build(
        "f", ViewOptionArgs, {"exclude": ["nonce"], "include": iter(["amount", "currency"])}
    )
    assert (options.exclude, options.include) == (("nonce",), ("amount", "currency"))


def test_the_decorators_refuse_keywords_they_do_not_declare() -> None:
    """``**options`` must not swallow a typo, nor ``key=`` on a blueprint (only a view can
    take its key from the request)."""
    idem = Idempotency()
    with pytest.raises(TypeError, match="idempotent.. got an unexpected keyword argument 'tll'"):
        idem.idempotent(tll=60)  # type: ignore[call-overload]
    with pytest.raises(TypeError, match="protect_blueprint.. got an unexpected .* 'key'"):
        idem.protect_blueprint(flask.Blueprint("b", __name__), key=lambda r: "k")  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="job.. got an unexpected keyword argument 'exclude'"):
        idem.job("charge", key="order_id", tenant="merchant", exclude=())  # type: ignore[call-arg]


def test_the_deprecated_name_warns_at_the_callers_line() -> None:
    idem = Idempotency()
    with pytest.warns(DeprecationWarning, match="release_before_contact") as caught:
        idem.idempotent(declares_effects=True)
        idem.job("charge", key="order_id", tenant="merchant", declares_effects=True)
    assert [w.filename for w in caught] == [__file__, __file__]
    options = ViewOptions.build("f", ViewOptionArgs, {"release_before_contact": True})
    assert options.release_before_contact
