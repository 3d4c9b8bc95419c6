"""A KEY_HASH argument that matches nothing says it was read as a key hash and how to pass
a key of 16 hex digits itself, never a bare "no live record of this key".
"""

from __future__ import annotations

import typing as t

import flask
from click.testing import Result

from flask_idem import Idempotency
from tests.support.helpers import Counter

Factory = t.Callable[..., tuple[flask.Flask, Idempotency, Counter]]
HEX_KEY = "0123456789abcdef"  # secrets.token_hex(8)


def idem(app: flask.Flask, *args: str, input: str | None = None) -> Result:
    return app.test_cli_runner().invoke(args=["idem", *args], input=input)


def test_a_hex_key_on_the_command_line_is_not_reported_as_unrecorded(
    app_factory: Factory,
) -> None:
    app, _, _ = app_factory()
    paid = app.test_client().post(
        "/payments", json={"amount": 4200}, headers={"Idempotency-Key": HEX_KEY}
    )
    assert paid.status_code == 201
    assert idem(app, "show", "--tenant", "alpha", input=f"{HEX_KEY}\n").exit_code == 0

    result = idem(app, "show", HEX_KEY, "--tenant", "alpha")  # an old runbook's spelling
    assert "no live record of this key" not in result.output, (
        "a recorded key is reported as having no record: " + result.output
    )
