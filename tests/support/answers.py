"""What a protected view answers through Flask's test client, checked one way in every tier."""

from __future__ import annotations

import json
import typing as t

#: The default ``IDEMPOTENCY_PROBLEM_BASE``, spelled here rather than read from the code, so
#: that a change to it fails the tests that check a problem's type.
BASE = "tag:flask-idem.readthedocs.io,2026:problems/"


def assert_problem(response: t.Any, status: int, name: str) -> dict[str, t.Any]:
    """Check that ``response`` is the problem document ``name`` (RFC 9457) with ``status``, and
    return the document.

    :param response: a test client's response.
    :param status: the HTTP status, also expected as the document's ``status``.
    :param name: the last segment of the problem's ``type``.
    """
    assert response.status_code == status, response.data
    assert response.headers["Content-Type"] == "application/problem+json"
    document = json.loads(response.data)
    assert document["type"] == BASE + name
    assert document["status"] == status
    assert document["title"] and document["detail"]
    return t.cast("dict[str, t.Any]", document)


def problem_name(response: t.Any) -> str:
    """The name of the problem ``response`` carries (the last segment of its ``type``), once its
    content type says it is a problem document.

    :param response: a test client's response.
    """
    assert response.content_type == "application/problem+json", response.data
    return str(response.get_json()["type"]).rsplit("/", 1)[-1]
