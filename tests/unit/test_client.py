"""The retrying client's decisions, backoff bounds and key generation."""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import email.utils
import json
import time
import typing as t

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flask_idem.client import (
    DEFINITIVE_STATUSES,
    RETRY_STATUSES,
    AsyncIdempotentClient,
    AuthenticationFailed,
    IdempotentClient,
    IndefiniteAnswer,
    KeyReused,
    OutcomePending,
    RetriesExhausted,
    RetryPolicy,
    parse_retry_after,
)
from flask_idem.core.idempotency_keys import KEY_PATTERN, new_key, normalize

FAST = RetryPolicy(max_attempts=6, total_timeout=10, base_delay=0.001, max_delay=0.01)


def _problem(status: int, name: str, **headers: str) -> httpx.Response:
    body = json.dumps({"type": f"https://x/problems/{name}", "status": status, "title": name})
    return httpx.Response(
        status, content=body, headers={"Content-Type": "application/problem+json", **headers}
    )


class Script:
    """A scripted server: answers in order and remembers the keys it was sent."""

    def __init__(self, *answers: httpx.Response | Exception) -> None:
        self.answers = list(answers)
        self.keys: list[str] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.keys.append(request.headers["Idempotency-Key"])
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer


def _client(script: Script, policy: RetryPolicy = FAST) -> IdempotentClient:
    transport = httpx.MockTransport(script)
    return IdempotentClient(httpx.Client(transport=transport, base_url="http://api"), policy=policy)


def test_transient_failures_are_retried_with_one_key() -> None:
    script = Script(
        httpx.ConnectError("refused"),
        httpx.ReadTimeout("timed out"),
        httpx.Response(503, headers={"Retry-After": "0"}),
        _problem(409, "request-in-progress", **{"Retry-After": "0"}),
        httpx.Response(201, json={"id": "pay_1"}, headers={"Idempotent-Replayed": "true"}),
    )
    result = _client(script).post("/v1/payments", json={"amount": 1})
    assert result.response.status_code == 201 and result.replayed
    assert result.attempts == 5
    assert len(set(script.keys)) == 1 and script.keys[0] == result.key
    assert KEY_PATTERN.fullmatch(result.key)


@pytest.mark.parametrize("status", [408, 425, 429, 500, 502, 503, 504])
def test_retryable_statuses(status: int) -> None:
    script = Script(httpx.Response(status), httpx.Response(201))
    assert _client(script).post("/x", key="op-1").attempts == 2
    assert script.keys == ["op-1", "op-1"]


@pytest.mark.parametrize(
    "answer",
    [
        httpx.Response(400),
        httpx.Response(404),
        _problem(409, "response-not-stored"),
        httpx.Response(201),
    ],
)
def test_final_answers_are_not_retried(answer: httpx.Response) -> None:
    script = Script(answer)
    result = _client(script).post("/x")
    assert result.attempts == 1 and result.response.status_code == answer.status_code


@pytest.mark.parametrize("status", [301, 302, 303, 307, 308, 501, 505, 507, 511, 520, 522, 524])
def test_statuses_that_do_not_answer_the_operation_raise_with_the_key(status: int) -> None:
    """A redirect never reached the operation, a CDN's 522/524 leaves open whether it ran:
    neither is returned as the operation's answer (nor retried blindly)."""
    script = Script(httpx.Response(status, headers={"Location": "/x/"}))
    with pytest.raises(IndefiniteAnswer, match="same key") as info:
        _client(script).post("/x", key="op-1")
    assert info.value.key == "op-1" and info.value.attempts == 1 and script.keys == ["op-1"]
    assert info.value.response is not None and info.value.response.status_code == status


def test_a_redirect_says_to_fix_the_url() -> None:
    with pytest.raises(IndefiniteAnswer, match="redirect: fix the URL"):
        _client(Script(httpx.Response(308, headers={"Location": "/x/"}))).post("/x")


@pytest.mark.parametrize("status", [500, 503, 422, 308, 524])
def test_a_replayed_answer_is_final_whatever_its_status(status: int) -> None:
    """A stored answer replayed is what the operation answered: retrying it gets it again."""
    script = Script(httpx.Response(status, headers={"Idempotent-Replayed": "true"}))
    result = _client(script).post("/x", key="op-1")
    assert result.attempts == 1 and result.replayed and result.response.status_code == status


def test_a_pending_outcome_is_asked_again_with_the_same_key_when_time_allows() -> None:
    script = Script(_problem(409, "outcome-pending", **{"Retry-After": "0"}), httpx.Response(201))
    result = _client(script).post("/x", key="op-1")
    assert result.response.status_code == 201 and script.keys == ["op-1", "op-1"]


def test_a_pending_outcome_past_the_budget_says_retry_later_with_the_same_key() -> None:
    script = Script(_problem(409, "outcome-pending", **{"Retry-After": "300"}))
    with pytest.raises(OutcomePending, match="same key") as info:
        _client(script).post("/x", key="op-1")
    assert isinstance(info.value, RetriesExhausted), "callers catching RetriesExhausted see it"
    assert info.value.key == "op-1" and info.value.attempts == 1
    assert info.value.response is not None and info.value.response.status_code == 409


def test_422_tells_the_caller_to_use_a_new_key() -> None:
    with pytest.raises(KeyReused, match="new key") as info:
        _client(Script(_problem(422, "idempotency-key-reused"))).post("/x", key="op-1")
    assert info.value.key == "op-1" and info.value.attempts == 1


@pytest.mark.parametrize("status", [401, 403])
def test_auth_failures_raise_with_the_key_to_retry_with(status: int) -> None:
    with pytest.raises(AuthenticationFailed) as info:
        _client(Script(httpx.Response(status))).post("/x", key="op-1")
    assert info.value.key == "op-1"


class Credentials:
    """A refresh hook that hands out a new token per call and counts its calls."""

    def __init__(self) -> None:
        self.calls: list[int] = []

    def __call__(self, response: httpx.Response) -> dict[str, str]:
        self.calls.append(response.status_code)
        return {"Authorization": f"Bearer fresh-{len(self.calls)}"}


class Recorder(Script):
    """A script that also remembers the Authorization header of every request."""

    def __init__(self, *answers: httpx.Response | Exception) -> None:
        super().__init__(*answers)
        self.authorizations: list[str | None] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.authorizations.append(request.headers.get("Authorization"))
        return super().__call__(request)


def _refreshing_client(script: Script, credentials: Credentials) -> IdempotentClient:
    http = httpx.Client(
        transport=httpx.MockTransport(script),
        base_url="http://api",
        headers={"Authorization": "Bearer expired"},
    )
    return IdempotentClient(http, policy=FAST, refresh_credentials=credentials)


def test_a_401_refreshes_the_credentials_and_retries_with_the_same_key() -> None:
    script = Recorder(httpx.Response(401), httpx.Response(201), httpx.Response(201))
    credentials = Credentials()
    client = _refreshing_client(script, credentials)
    result = client.post("/x", key="op-1")
    assert result.response.status_code == 201 and result.attempts == 2
    assert script.keys == ["op-1", "op-1"] and credentials.calls == [401]
    assert script.authorizations == ["Bearer expired", "Bearer fresh-1"]
    client.post("/x", key="op-2")
    assert script.authorizations[-1] == "Bearer fresh-1", "later operations keep the new token"


def test_fresh_credentials_win_over_a_per_request_header() -> None:
    script = Recorder(httpx.Response(401), httpx.Response(201))
    client = _refreshing_client(script, Credentials())
    client.post("/x", key="op-1", headers={"Authorization": "Bearer per-request"})
    assert script.authorizations == ["Bearer per-request", "Bearer fresh-1"]


def test_a_401_right_after_a_refresh_raises_instead_of_looping() -> None:
    script = Script(httpx.Response(401), httpx.Response(401))
    credentials = Credentials()
    with pytest.raises(AuthenticationFailed) as info:
        _refreshing_client(script, credentials).post("/x", key="op-1")
    assert info.value.key == "op-1" and info.value.attempts == 2
    assert credentials.calls == [401] and script.keys == ["op-1", "op-1"]


def test_a_403_is_not_refreshed() -> None:
    credentials = Credentials()
    with pytest.raises(AuthenticationFailed):
        _refreshing_client(Script(httpx.Response(403)), credentials).post("/x", key="op-1")
    assert credentials.calls == [], "new credentials do not grant a missing permission"


def test_a_refresh_hook_that_returns_no_headers_is_refused() -> None:
    http = httpx.Client(transport=httpx.MockTransport(Script(httpx.Response(401))))
    client = IdempotentClient(http, policy=FAST, refresh_credentials=lambda response: None)
    with pytest.raises(TypeError, match="mapping of headers"):
        client.post("http://api/x", key="op-1")


def test_async_client_awaits_a_coroutine_refresh_hook() -> None:
    script = Recorder(httpx.Response(401), httpx.Response(201))

    async def refresh(response: httpx.Response) -> dict[str, str]:
        return {"Authorization": "Bearer async-fresh"}

    async def run() -> t.Any:
        transport = httpx.MockTransport(script)
        async with httpx.AsyncClient(transport=transport, base_url="http://api") as http:
            client = AsyncIdempotentClient(http, policy=FAST, refresh_credentials=refresh)
            return await client.post("/x", key="op-1")

    assert asyncio.run(run()).attempts == 2
    assert script.authorizations == [None, "Bearer async-fresh"] and script.keys == ["op-1"] * 2


def test_a_500_is_final_when_the_policy_says_so() -> None:
    policy = dataclasses.replace(
        FAST, retry_statuses=RETRY_STATUSES - {500}, definitive_statuses=DEFINITIVE_STATUSES | {500}
    )
    result = _client(Script(httpx.Response(500)), policy).post("/x")
    assert result.attempts == 1 and result.response.status_code == 500


def test_a_500_neither_retried_nor_definitive_is_indefinite() -> None:
    policy = dataclasses.replace(FAST, retry_statuses=RETRY_STATUSES - {500})
    with pytest.raises(IndefiniteAnswer):
        _client(Script(httpx.Response(500)), policy).post("/x")


def test_attempts_are_bounded() -> None:
    script = Script(*(httpx.Response(503) for _ in range(3)))
    policy = RetryPolicy(max_attempts=3, total_timeout=10, base_delay=0.001, max_delay=0.001)
    with pytest.raises(RetriesExhausted) as info:
        _client(script, policy).post("/x", key="op-1")
    assert info.value.attempts == 3 and len(script.keys) == 3


def test_total_time_is_bounded_by_retry_after() -> None:
    script = Script(httpx.Response(503, headers={"Retry-After": "120"}))
    with pytest.raises(RetriesExhausted):
        _client(script).post("/x")
    assert len(script.keys) == 1, "never sleeps past the total timeout"


def test_network_errors_exhausted_keep_the_cause() -> None:
    script = Script(*(httpx.ConnectError("refused") for _ in range(6)))
    with pytest.raises(RetriesExhausted) as info:
        _client(script).post("/x")
    assert isinstance(info.value.__cause__, httpx.ConnectError)


def test_async_client_keeps_one_key() -> None:
    script = Script(httpx.Response(502), httpx.Response(201))

    async def run() -> t.Any:
        transport = httpx.MockTransport(script)
        async with httpx.AsyncClient(transport=transport, base_url="http://api") as http:
            return await AsyncIdempotentClient(http, policy=FAST).post("/x")

    result = asyncio.run(run())
    assert result.attempts == 2 and script.keys == [result.key, result.key]


@given(st.integers(min_value=1, max_value=60), st.floats(0.001, 5), st.floats(0.001, 60))
@settings(max_examples=300, deadline=None)
def test_backoff_stays_within_full_jitter_bounds(attempt: int, base: float, cap: float) -> None:
    policy = RetryPolicy(base_delay=base, max_delay=cap)
    delay = policy.backoff(attempt)
    assert 0.0 <= delay <= min(cap, base * 2 ** (attempt - 1)) + 1e-9


def test_backoff_is_jittered() -> None:
    policy = RetryPolicy(base_delay=1, max_delay=100)
    assert len({policy.backoff(5) for _ in range(20)}) > 1


@given(st.integers(min_value=0, max_value=10**6))
def test_retry_after_seconds(seconds: int) -> None:
    assert parse_retry_after(str(seconds)) == seconds


@given(st.integers(min_value=-3600, max_value=86400))
def test_retry_after_http_date(offset: int) -> None:
    now = dt.datetime(2026, 11, 30, 12, 0, 0, tzinfo=dt.timezone.utc)
    value = email.utils.format_datetime(now + dt.timedelta(seconds=offset), usegmt=True)
    assert parse_retry_after(value, now) == max(0, offset)


def test_retry_after_garbage_is_ignored() -> None:
    assert parse_retry_after("soon") is None and parse_retry_after(None) is None


@pytest.mark.parametrize("kind", ["uuid4", "uuid7", "ulid", "token"])
def test_generated_keys_pass_the_server_validation_and_are_unique(kind: t.Any) -> None:
    keys = {new_key(kind) for _ in range(500)}
    assert len(keys) == 500
    for key in keys:
        assert normalize(key) == key


def test_time_ordered_keys_sort_by_creation() -> None:
    for kind in ("uuid7", "ulid"):
        first = new_key(kind)  # type: ignore[arg-type]
        time.sleep(0.002)
        assert first < new_key(kind)  # type: ignore[arg-type]


def test_unknown_key_format_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown key format"):
        new_key("uuid1")  # type: ignore[arg-type]
