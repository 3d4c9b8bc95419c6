"""A retrying HTTP client that keeps one idempotency key per logical operation.

Most idempotency bugs live in clients: a new key per retry, retrying a 422, ignoring
``Retry-After``, treating a timeout as a failure. This client sends one key on every attempt of
an operation and retries only what is safe and useful to retry:

==============================================  =============================================
answer                                          what the client does
==============================================  =============================================
``Idempotent-Replayed: true``, any status       final: the operation's stored answer (an
                                                earlier attempt ran), returned as the result
network error, timeout                          retry, same key (the server may have executed)
408, 425, 429, 500, 502, 503, 504               retry, same key, honouring ``Retry-After``
                                                (``RetryPolicy.retry_statuses``)
409 ``request-in-progress``                     retry after ``Retry-After``, same key
409 ``outcome-pending``                         retry after ``Retry-After`` if the policy
                                                leaves time, else raise :class:`OutcomePending`
401                                             with ``refresh_credentials``: refresh once,
                                                retry at once with the same key; else (or
                                                401 again) raise :class:`AuthenticationFailed`
403                                             raise :class:`AuthenticationFailed`: fix the
                                                credentials, retry with the same ``.key``
422                                             raise :class:`KeyReused`: a new operation needs
                                                a new key (a client bug)
another 2xx or 4xx (400, 404, other 409)        final: returned as the result
                                                (``RetryPolicy.definitive_statuses``)
anything else (3xx, 501, 505, 520-524...)       raise :class:`IndefiniteAnswer`: not an answer
                                                of the operation, which may or may not have
                                                run; retry later with the same key
==============================================  =============================================

Only definitive answers end an operation, from an allow-list: a redirect means the request
never reached the operation (httpx does not follow it: fix the URL), and a status such as a
CDN's 522 or 524 leaves open whether it ran. An unreplayed 500 is retried: a flask_idem server
stores only the 500s a view returns (and replays them with ``Idempotent-Replayed: true``); a
crash's key is either given back (nothing was committed, so the retry runs again) or kept
``unknown`` (the retry gets 409 ``outcome-pending``), so the same key can never run twice.

Backoff is exponential with full jitter, bounded by a number of attempts and a total time.
Install with ``pip install flask-idem[client]`` (httpx).
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import email.utils
import inspect
import math
import random
import re
import time
import typing as t

import httpx

from .core.idempotency_keys import KeyFormat, new_key
from .core.wire import IN_PROGRESS, KEY_HEADER, OUTCOME_PENDING, REPLAYED_HEADER

RETRY_STATUSES = frozenset({408, 425, 429, 500, 502, 503, 504})
#: Statuses that answer the operation: every 2xx and 4xx (those the table above does not treat
#: otherwise). An allow-list, so that a status nobody thought of never ends an operation.
DEFINITIVE_STATUSES = frozenset(range(200, 300)) | frozenset(range(400, 500))
_DELAY_SECONDS = re.compile(r"[0-9]+", re.ASCII)


@dataclasses.dataclass(frozen=True)
class RetryPolicy:
    """How long and how often an operation is retried.

    :param max_attempts: attempts in all, the first included.
    :param total_timeout: seconds from the first attempt after which no retry starts.
    :param base_delay: the first backoff ceiling in seconds; it doubles per attempt.
    :param max_delay: the largest backoff ceiling.
    :param retry_statuses: the statuses retried with the same key (the module's table).
    :param definitive_statuses: the statuses returned as the operation's answer; any other
        one that is not retried raises :class:`IndefiniteAnswer`.
    """

    max_attempts: int = 5
    total_timeout: float = 60.0
    base_delay: float = 0.2
    max_delay: float = 10.0
    retry_statuses: frozenset[int] = RETRY_STATUSES
    definitive_statuses: frozenset[int] = DEFINITIVE_STATUSES

    def backoff(self, attempt: int, rng: random.Random | None = None) -> float:
        """Full jitter: uniform in [0, min(max_delay, base_delay * 2 ** (attempt - 1))]."""
        ceiling = min(self.max_delay, self.base_delay * 2 ** max(0, attempt - 1))
        return (rng or _random).uniform(0.0, ceiling)


_random = random.SystemRandom()


def parse_retry_after(value: str | None, now: dt.datetime | None = None) -> float | None:
    """Seconds to wait from a ``Retry-After`` value (delay-seconds or HTTP-date), or None."""
    if value is None:
        return None
    value = value.strip(" \t")
    # ASCII digits only: str.isdigit() also accepts superscripts and other scripts' digits,
    # which float() then refuses. A delay too large for a float is no usable hint either.
    if _DELAY_SECONDS.fullmatch(value):
        delay = float(value)
        return delay if math.isfinite(delay) else None
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, OverflowError, IndexError):
        return None
    if when is None:
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=dt.timezone.utc)
    now = now or dt.datetime.now(dt.timezone.utc)
    return max(0.0, (when - now).total_seconds())


@dataclasses.dataclass(frozen=True)
class IdempotentResult:
    """The final answer of an operation."""

    response: httpx.Response
    key: str
    attempts: int

    @property
    def replayed(self) -> bool:
        """True when the server answered from its stored result (an earlier attempt ran)."""
        return _replayed(self.response)


def _replayed(response: httpx.Response) -> bool:
    return bool(response.headers.get(REPLAYED_HEADER, "").lower() == "true")


class IdempotentRequestError(Exception):
    """An operation ended without a final answer; ``key`` is the key to retry it with."""

    def __init__(
        self,
        message: str,
        *,
        key: str,
        attempts: int,
        response: httpx.Response | None = None,
    ) -> None:
        super().__init__(message)
        self.key = key
        self.attempts = attempts
        self.response = response


class KeyReused(IdempotentRequestError):
    """422: the key belongs to a different request. Generate a new key for a new operation."""


class AuthenticationFailed(IdempotentRequestError):
    """401/403: refresh the credentials, then retry the operation with the same ``key``."""


class RetriesExhausted(IdempotentRequestError):
    """No final answer within the policy's attempts or time; retry later with the same key."""


class IndefiniteAnswer(IdempotentRequestError):
    """A status that does not answer the operation (a redirect, 501, a CDN's 522...): it may or
    may not have run. Retry later with the same ``key``; after a redirect, fix the URL first."""


class OutcomePending(RetriesExhausted):
    """409 ``outcome-pending``: an attempt may have taken effect and the server is settling it
    (a reconciler); retry later with the same key, never a new one."""


def _problem_type(response: httpx.Response) -> str:
    if not response.headers.get("Content-Type", "").startswith("application/problem+json"):
        return ""
    try:
        return str(response.json().get("type", "")).rsplit("/", 1)[-1]
    except ValueError:
        return ""


#: Called with a 401 answer; returns the headers (``Authorization``...) that carry fresh
#: credentials. The async client also accepts a coroutine function.
RefreshCredentials = t.Callable[
    [httpx.Response], "t.Mapping[str, str] | t.Awaitable[t.Mapping[str, str]]"
]


class _Operation:
    """The retry decisions of one operation, shared by the sync and async clients."""

    def __init__(
        self, policy: RetryPolicy, key: str, clock: t.Callable[[], float], *, refreshable: bool
    ) -> None:
        self.policy = policy
        self.key = key
        self.clock = clock
        self.started = clock()
        self.attempts = 0
        self.refreshable = refreshable
        #: Set when the last answer was a 401 to refresh the credentials for; the attempt
        #: right after a refresh may not refresh again (wrong credentials would loop).
        self.refresh_due = False

    def next_delay(self, outcome: httpx.Response | httpx.TransportError) -> float | None:
        """Seconds to wait before the next attempt, or None when ``outcome`` is final.

        :raises IdempotentRequestError: the operation cannot end with a final answer.
        """
        self.attempts += 1
        just_refreshed, self.refresh_due = self.refresh_due, False
        response = outcome if isinstance(outcome, httpx.Response) else None
        if response is not None:
            status = response.status_code
            if _replayed(response):
                return None  # the operation's stored answer, whatever its status
            if (
                status == 401
                and self.refreshable
                and not just_refreshed
                and self.attempts < self.policy.max_attempts
            ):
                self.refresh_due = True
                return 0.0
            if status in (401, 403):
                raise AuthenticationFailed(
                    f"{status}: refresh credentials and retry with the same key",
                    key=self.key,
                    attempts=self.attempts,
                    response=response,
                )
            if status == 422:
                raise KeyReused(
                    "422: this key was used for a different request; generate a new key for a "
                    "new operation",
                    key=self.key,
                    attempts=self.attempts,
                    response=response,
                )
            problem = _problem_type(response) if status == 409 else ""
            if status not in self.policy.retry_statuses and problem not in (
                IN_PROGRESS,
                OUTCOME_PENDING,
            ):
                if status in self.policy.definitive_statuses:
                    return None
                raise IndefiniteAnswer(
                    f"{status} is no answer of the operation"
                    + (" (a redirect: fix the URL)" if 300 <= status < 400 else "")
                    + "; it may or may not have run: retry later with the same key",
                    key=self.key,
                    attempts=self.attempts,
                    response=response,
                )
        delay = self.policy.backoff(self.attempts)
        if response is not None:
            retry_after = parse_retry_after(response.headers.get("Retry-After"))
            if retry_after is not None:
                delay = retry_after
        elapsed = self.clock() - self.started
        if self.attempts >= self.policy.max_attempts or elapsed + delay > self.policy.total_timeout:
            pending = response is not None and _problem_type(response) == OUTCOME_PENDING
            raise (OutcomePending if pending else RetriesExhausted)(
                f"no final answer after {self.attempts} attempts; retry later with the same key",
                key=self.key,
                attempts=self.attempts,
                response=response,
            ) from (outcome if isinstance(outcome, httpx.TransportError) else None)
        return delay


class _Base:
    def __init__(
        self,
        *,
        policy: RetryPolicy | None = None,
        header: str = KEY_HEADER,
        key_format: KeyFormat = "uuid4",
        refresh_credentials: RefreshCredentials | None = None,
    ) -> None:
        self.policy = policy or RetryPolicy()
        self.header = header
        self.key_format = key_format
        self.refresh_credentials = refresh_credentials

    def _start(self, key: str | None, kwargs: dict[str, t.Any]) -> _Operation:
        key = key or new_key(self.key_format)
        headers = httpx.Headers(kwargs.pop("headers", None))
        headers[self.header] = key
        kwargs["headers"] = headers
        return _Operation(
            self.policy, key, time.monotonic, refreshable=self.refresh_credentials is not None
        )

    def _use_credentials(
        self, client: httpx.Client | httpx.AsyncClient, fresh: t.Any, kwargs: dict[str, t.Any]
    ) -> None:
        """Send ``fresh`` headers on this operation's next attempts and the client's later
        requests; a per-request header of the same name would otherwise win over them."""
        if not isinstance(fresh, t.Mapping):
            raise TypeError("refresh_credentials must return a mapping of headers")
        client.headers.update(fresh)
        kwargs["headers"].update(fresh)


class IdempotentClient(_Base):
    """Synchronous client: ``IdempotentClient(httpx.Client(base_url=...)).post(...)``.

    :param client: the httpx client to send with (its base URL, auth, timeouts apply).
    :param policy: how long and how often to retry (:class:`RetryPolicy`).
    :param refresh_credentials: called with a 401 answer, returns fresh credential headers;
        the operation is then retried at once with the same key.
    """

    def __init__(self, client: httpx.Client, **options: t.Any) -> None:
        super().__init__(**options)
        self.client = client

    def request(
        self, method: str, url: str, *, key: str | None = None, **kwargs: t.Any
    ) -> IdempotentResult:
        """Send one logical operation, retrying with the same key until a final answer.

        :param key: the operation's key, persisted by the caller before the first send
            (:class:`flask_idem.outbox.Outbox` does that); generated once when omitted (then
            read it from the result or the error).
        """
        operation = self._start(key, kwargs)
        while True:
            outcome: httpx.Response | httpx.TransportError
            try:
                outcome = self.client.request(method, url, **kwargs)
            except httpx.TransportError as exc:
                outcome = exc
            delay = operation.next_delay(outcome)
            if delay is None:
                assert isinstance(outcome, httpx.Response)
                return IdempotentResult(outcome, operation.key, operation.attempts)
            if operation.refresh_due:
                assert self.refresh_credentials is not None and isinstance(outcome, httpx.Response)
                self._use_credentials(self.client, self.refresh_credentials(outcome), kwargs)
            time.sleep(delay)

    def post(self, url: str, **kwargs: t.Any) -> IdempotentResult:
        return self.request("POST", url, **kwargs)


class AsyncIdempotentClient(_Base):
    """Asynchronous twin of :class:`IdempotentClient` on ``httpx.AsyncClient``;
    ``refresh_credentials`` may be a coroutine function."""

    def __init__(self, client: httpx.AsyncClient, **options: t.Any) -> None:
        super().__init__(**options)
        self.client = client

    async def request(
        self, method: str, url: str, *, key: str | None = None, **kwargs: t.Any
    ) -> IdempotentResult:
        """See :meth:`IdempotentClient.request`."""
        operation = self._start(key, kwargs)
        while True:
            outcome: httpx.Response | httpx.TransportError
            try:
                outcome = await self.client.request(method, url, **kwargs)
            except httpx.TransportError as exc:
                outcome = exc
            delay = operation.next_delay(outcome)
            if delay is None:
                assert isinstance(outcome, httpx.Response)
                return IdempotentResult(outcome, operation.key, operation.attempts)
            if operation.refresh_due:
                assert self.refresh_credentials is not None and isinstance(outcome, httpx.Response)
                fresh = self.refresh_credentials(outcome)
                if inspect.isawaitable(fresh):
                    fresh = await fresh
                self._use_credentials(self.client, fresh, kwargs)
            await asyncio.sleep(delay)

    async def post(self, url: str, **kwargs: t.Any) -> IdempotentResult:
        return await self.request("POST", url, **kwargs)
