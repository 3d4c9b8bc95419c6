"""What a protected view answers through Flask's test client, checked one way in every tier."""

from __future__ import annotations

import json
import typing as t

import flask

#: The default ``IDEMPOTENCY_PROBLEM_BASE``, spelled here rather than read from the code, so
#: that a change to it fails the tests that check a problem's type.
BASE = "tag:flask-idem.readthedocs.io,2026:problems/"


#: The body ``post`` sends unless told otherwise: the payment of the conftest's payments app.
PAYMENT: t.Final = {"amount": 4200}


def post(
    target: flask.Flask | t.Any,
    key: str | None = "key-1",
    body: t.Any = PAYMENT,
    *,
    path: str = "/payments",
    tenant: str | None = None,
    authorization: str | None = None,
    environ: t.Mapping[str, t.Any] | None = None,
    **headers: str,
) -> t.Any:
    """POST ``body`` to a protected view with the ``Idempotency-Key`` header, through Flask's
    test client, and return the response.

    :param target: a test client, or an application (a new test client of it is used).
    :param key: the ``Idempotency-Key`` header; ``None`` sends none.
    :param body: sent as JSON; bytes or a string are sent as they are, as ``application/json``;
        ``None`` sends no body.
    :param path: the view's URL.
    :param tenant: the ``X-Tenant`` header the test apps read the tenant from; ``None`` sends
        none.
    :param authorization: the ``Authorization`` header the test apps read a principal from;
        ``None`` sends none.
    :param environ: WSGI environ overrides, for a body the server would hand over another way
        (``wsgi.input``, ``wsgi.input_terminated``, a wrong ``CONTENT_LENGTH``).
    :param headers: further headers (``**{"X-Idempotency-Key": ...}``).
    """
    client = target.test_client() if isinstance(target, flask.Flask) else target
    if key is not None:
        headers.setdefault("Idempotency-Key", key)
    if tenant is not None:
        headers["X-Tenant"] = tenant
    if authorization is not None:
        headers["Authorization"] = authorization
    sent: dict[str, t.Any] = {"headers": headers, "environ_overrides": environ}
    if body is None:
        return client.post(path, **sent)
    if isinstance(body, (bytes, str)):
        return client.post(path, data=body, content_type="application/json", **sent)
    return client.post(path, json=body, **sent)


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
