"""A JSON POST to a server on a real socket, the way a payment client sends one."""

from __future__ import annotations

import dataclasses
import http.client
import json
import typing as t
from email.message import Message


@dataclasses.dataclass
class Reply:
    """One HTTP answer, read completely."""

    status: int
    headers: Message
    body: bytes

    def json(self) -> t.Any:
        return json.loads(self.body)


def post_json(
    port: int,
    key: str,
    body: t.Any,
    *,
    path: str = "/payments",
    tenant: str = "alpha",
    timeout: float = 30,
) -> Reply:
    """POST ``body`` as JSON to ``127.0.0.1:port`` on a fresh connection, with the
    ``Idempotency-Key`` and the ``X-Tenant`` header the test servers read the tenant from, and
    read the whole answer.

    :param port: the server's port.
    :param key: the ``Idempotency-Key`` header.
    :param body: sent as JSON.
    :param path: the view's URL.
    :param tenant: the ``X-Tenant`` header.
    :param timeout: the connection's timeout in seconds.
    """
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        connection.request(
            "POST",
            path,
            body=json.dumps(body),
            headers={
                "Idempotency-Key": key,
                "X-Tenant": tenant,
                "Content-Type": "application/json",
            },
        )
        response = connection.getresponse()
        return Reply(response.status, response.msg, response.read())
    finally:
        connection.close()
