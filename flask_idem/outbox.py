"""A client-side outbox: each operation's key and request are committed before the first send.

A key kept in memory dies with the process: a client killed after the server charged and before
the answer arrived comes back without it, and a new key charges twice. :class:`Outbox` writes
(operation, key, request) to a table of the application's own database and commits before the
first byte goes out; after a restart :meth:`Outbox.resume` sends every pending operation again
with its stored key and the same bytes, so the server replays instead of executing twice.

An operation is marked done only on a definitive answer, as the retry table of
:mod:`flask_idem.client` decides: a replayed answer (``Idempotent-Replayed: true``, whatever its
status), a final one (2xx, 400, 404, another 4xx) or 422 (the key belongs to another request). A
network error, a retryable status past the policy's budget, 409 ``outcome-pending``, 401, 403, a
redirect or another status that does not answer the operation (501, 522...) leave it pending, to
be resumed later with the same key.

Adding an operation that is already stored compares what the server compares: the method, the
URL and the canonical body of :mod:`flask_idem.core.fingerprint` (key order and number spelling do
not count), and the headers but for per-call ones such as ``X-Request-Id``
(:data:`VOLATILE_HEADERS`). The stored request is what is sent.

The table is the application's (never in flask_idem's migrations): :func:`outbox_table` adds it
to the application's ``MetaData`` for its own migrations, or :meth:`Outbox.create_table`
creates it. Credentials never go into it: they belong on the httpx client (and its
``refresh_credentials`` hook). The outbox refuses a URL with userinfo, the headers of
:data:`CREDENTIAL_HEADERS` and the query parameters of :data:`CREDENTIAL_QUERY_NAMES` (both
configurable per outbox).
"""

from __future__ import annotations

import dataclasses
import enum
import json as jsonlib
import logging
import typing as t
import urllib.parse

import httpx
import sqlalchemy as sa

from .client import IdempotentClient, IdempotentRequestError, KeyReused
from .core.fingerprint import canonical_request
from .core.idempotency_keys import KeyFormat, new_key

logger = logging.getLogger(__name__)

#: Headers that carry credentials (lower case); stored in the outbox they would outlive their
#: rotation and sit in plain text in the application's database.
CREDENTIAL_HEADERS = frozenset(
    {
        "authorization",
        "proxy-authorization",
        "cookie",
        "api-key",
        "x-api-key",
        "x-auth-token",
        "x-access-token",
        "x-amz-security-token",
        "x-goog-api-key",
        "ocp-apim-subscription-key",
    }
)
#: Query parameter names (lower case) that carry credentials, refused for the same reason.
CREDENTIAL_QUERY_NAMES = frozenset(
    {
        "access_token",
        "api_key",
        "api-key",
        "apikey",
        "auth",
        "auth_token",
        "client_secret",
        "key",
        "password",
        "secret",
        "sig",
        "signature",
        "token",
        "x-amz-credential",
        "x-amz-security-token",
        "x-amz-signature",
    }
)
#: Headers that change per call (tracing, request ids) and that the server does not compare:
#: adding an operation again with other values is the same request (the stored ones are sent).
VOLATILE_HEADERS = frozenset(
    {
        "x-request-id",
        "request-id",
        "x-correlation-id",
        "correlation-id",
        "traceparent",
        "tracestate",
        "baggage",
        "sentry-trace",
        "x-amzn-trace-id",
        "x-b3-traceid",
        "x-b3-spanid",
        "x-b3-parentspanid",
        "x-b3-sampled",
        "b3",
        "x-cloud-trace-context",
        "user-agent",
        "date",
    }
)


class OutboxState(str, enum.Enum):
    """Where an operation stands."""

    PENDING = "pending"  #: committed; sent or not, no definitive answer yet
    DONE = "done"  #: a definitive answer is recorded


class OutboxConflict(ValueError):
    """The operation is already in the outbox with a different request.

    An operation name stands for one request, which may already have run. Never give the
    same intent a second name while the first is pending (two keys, two charges): deliver
    the stored one (:meth:`Outbox.get`, :meth:`Outbox.deliver`) until it is done, and only
    then, if the intent has really changed, add the new request under a new name.
    """


def outbox_table(metadata: sa.MetaData, name: str = "idempotency_outbox") -> sa.Table:
    """The outbox table in the application's ``metadata`` (for its own migrations)."""
    return sa.Table(
        name,
        metadata,
        sa.Column("operation", sa.String(255), primary_key=True),
        sa.Column("key", sa.String(255), nullable=False, unique=True),
        sa.Column("method", sa.String(16), nullable=False),
        sa.Column("url", sa.Text, nullable=False),
        sa.Column("headers", sa.JSON, nullable=False),
        sa.Column("body", sa.LargeBinary, nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("response_status", sa.Integer),
        sa.Column("response_body", sa.LargeBinary),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("completed_at", sa.DateTime(timezone=True)),
        sa.Index(f"{name}_state", "state", "created_at"),
    )


@dataclasses.dataclass(frozen=True)
class OutboxEntry:
    """One operation as stored: its key, its request and, once done, the answer."""

    operation: str
    key: str
    method: str
    url: str
    headers: dict[str, str]
    body: bytes
    state: OutboxState
    response_status: int | None = None
    response_body: bytes | None = None

    @property
    def done(self) -> bool:
        return self.state is OutboxState.DONE

    def json(self) -> t.Any:
        """The recorded answer's body, decoded as JSON."""
        if self.response_body is None:
            raise ValueError(f"operation {self.operation!r} has no answer yet")
        return jsonlib.loads(self.response_body)


class Outbox:
    """Operations persisted before their first send, resumed after a restart.

    :param engine: the application's database (SQLite or PostgreSQL).
    :param table: the outbox table; by default ``idempotency_outbox`` in a ``MetaData`` of its own.
    :param key_format: how new operations' keys are made
        (:func:`~flask_idem.core.idempotency_keys.new_key`).
    :param credential_headers: header names refused (case-insensitive).
    :param credential_query_names: query parameter names refused (case-insensitive).
    :param volatile_headers: header names left out when an operation added again is compared.
    """

    def __init__(
        self,
        engine: sa.Engine,
        *,
        table: sa.Table | None = None,
        key_format: KeyFormat = "uuid4",
        credential_headers: t.Collection[str] = CREDENTIAL_HEADERS,
        credential_query_names: t.Collection[str] = CREDENTIAL_QUERY_NAMES,
        volatile_headers: t.Collection[str] = VOLATILE_HEADERS,
    ) -> None:
        self.engine = engine
        self.table = table if table is not None else outbox_table(sa.MetaData())
        self.key_format = key_format
        self.credential_headers = frozenset(name.lower() for name in credential_headers)
        self.credential_query_names = frozenset(name.lower() for name in credential_query_names)
        self.volatile_headers = frozenset(name.lower() for name in volatile_headers)

    def create_table(self) -> None:
        """Create the table unless it exists (when no migration of the application does)."""
        self.table.create(self.engine, checkfirst=True)

    def add(
        self,
        operation: str,
        method: str,
        url: str,
        *,
        json: t.Any = None,
        content: bytes | None = None,
        headers: t.Mapping[str, str] | None = None,
    ) -> OutboxEntry:
        """Commit ``operation`` with a new key and its request, or return it when it is there.

        :param url: relative to the httpx client's ``base_url``, or absolute; never with
            credentials (userinfo, ``?api_key=``...).
        :param json: the body as JSON (encoded once, so every attempt sends the same bytes).
        :param headers: request headers to store with it; never credentials.
        :raises OutboxConflict: the operation is stored with a different request.
        :raises ValueError: the URL or the headers carry credentials.
        """
        request = httpx.Request(method, "http://outbox.invalid", json=json, content=content)
        stored_headers = {name.lower(): value for name, value in (headers or {}).items()}
        self._refuse_credentials(url, stored_headers)
        if "content-type" in request.headers:
            stored_headers.setdefault("content-type", request.headers["content-type"])
        body = request.read()
        wanted = {"method": method.upper(), "url": url, "headers": stored_headers, "body": body}
        try:
            with self.engine.begin() as conn:
                conn.execute(
                    self.table.insert().values(
                        operation=operation,
                        key=new_key(self.key_format),
                        state=OutboxState.PENDING.value,
                        created_at=sa.func.now(),
                        **wanted,
                    )
                )
        except sa.exc.IntegrityError:
            pass  # already there (a restart, or a concurrent add): compared below
        entry = self.get(operation)
        assert entry is not None, "committed above or by whoever conflicted"
        stored = self._compared(entry.method, entry.url, entry.headers, entry.body)
        if stored != self._compared(method.upper(), url, stored_headers, body):
            raise OutboxConflict(f"operation {operation!r} is stored with a different request")
        return entry

    def _refuse_credentials(self, url: str, headers: t.Mapping[str, str]) -> None:
        """Raise when the request carries credentials, naming where (never the value)."""
        parts = urllib.parse.urlsplit(url)
        refused = ["userinfo in the URL"] if "@" in parts.netloc else []
        query = urllib.parse.parse_qsl(parts.query, keep_blank_values=True)
        refused += sorted(
            {name for name, _ in query if name.lower() in self.credential_query_names}
        )
        refused += sorted(self.credential_headers & headers.keys())
        if refused:
            raise ValueError(
                f"credentials are not stored in the outbox ({', '.join(refused)}): set them on "
                "the httpx client (and refresh them with refresh_credentials)"
            )

    def _compared(
        self, method: str, url: str, headers: t.Mapping[str, str], body: bytes
    ) -> tuple[bytes, dict[str, str]]:
        """What tells two requests apart: the server's canonical request (method, URL, body)
        and the headers but for the volatile ones."""
        parts = urllib.parse.urlsplit(url)
        canonical = canonical_request(
            method,
            urllib.parse.urlunsplit(parts._replace(query="", fragment="")),
            {},
            urllib.parse.parse_qsl(parts.query, keep_blank_values=True),
            body,
            headers.get("content-type"),
        )
        kept = {name: value for name, value in headers.items() if name not in self.volatile_headers}
        return canonical, kept

    def send(
        self, client: IdempotentClient, operation: str, method: str, url: str, **request: t.Any
    ) -> OutboxEntry:
        """:meth:`add` then :meth:`deliver`: the request is committed before the first send.

        Calling it again for a done operation returns the recorded answer without sending.
        """
        return self.deliver(client, self.add(operation, method, url, **request))

    def deliver(self, client: IdempotentClient, entry: OutboxEntry) -> OutboxEntry:
        """Send a pending operation with its stored key and bytes until a definitive answer.

        :raises KeyReused: after recording the 422 (the operation cannot succeed as stored).
        :raises IdempotentRequestError: no definitive answer; the operation stays pending.
        """
        if entry.done:
            return entry
        try:
            result = client.request(
                entry.method, entry.url, key=entry.key, content=entry.body, headers=entry.headers
            )
        except KeyReused as exc:
            assert exc.response is not None
            self._record(entry, exc.response)
            raise
        return self._record(entry, result.response)

    def resume(self, client: IdempotentClient) -> list[OutboxEntry]:
        """Deliver every pending operation, oldest first, and return them as they now stand.

        An operation that still gets no definitive answer stays pending for the next call;
        one refused with 422 is returned done, with that answer.
        """
        resumed = []
        for entry in self.pending():
            try:
                resumed.append(self.deliver(client, entry))
            except IdempotentRequestError as exc:
                # The operation's name only: its key and body stay out of the logs.
                logger.warning("outbox operation %r: %s", entry.operation, exc)
                current = self.get(entry.operation)
                assert current is not None
                resumed.append(current)
        return resumed

    def pending(self) -> list[OutboxEntry]:
        """The operations without a definitive answer, oldest first."""
        query = (
            sa.select(self.table)
            .where(self.table.c.state == OutboxState.PENDING.value)
            .order_by(self.table.c.created_at, self.table.c.operation)
        )
        with self.engine.connect() as conn:
            return [self._entry(row) for row in conn.execute(query)]

    def get(self, operation: str) -> OutboxEntry | None:
        """The stored operation, or None."""
        query = sa.select(self.table).where(self.table.c.operation == operation)
        with self.engine.connect() as conn:
            row = conn.execute(query).one_or_none()
        return None if row is None else self._entry(row)

    def _record(self, entry: OutboxEntry, response: httpx.Response) -> OutboxEntry:
        """Mark the operation done with ``response``; the first answer recorded stays (a
        concurrent resume got the same replay anyway)."""
        with self.engine.begin() as conn:
            conn.execute(
                self.table.update()
                .where(
                    self.table.c.operation == entry.operation,
                    self.table.c.state == OutboxState.PENDING.value,
                )
                .values(
                    state=OutboxState.DONE.value,
                    response_status=response.status_code,
                    response_body=response.content,
                    completed_at=sa.func.now(),
                )
            )
        recorded = self.get(entry.operation)
        assert recorded is not None
        return recorded

    @staticmethod
    def _entry(row: sa.Row[t.Any]) -> OutboxEntry:
        return OutboxEntry(
            operation=row.operation,
            key=row.key,
            method=row.method,
            url=row.url,
            headers=dict(row.headers),
            body=bytes(row.body),
            state=OutboxState(row.state),
            response_status=row.response_status,
            response_body=None if row.response_body is None else bytes(row.response_body),
        )
