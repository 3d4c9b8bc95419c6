"""Load generators: wrk when installed, else a closed-loop Python client; both loopback only.

Both are closed loops (a client sends its next request when the previous answer arrived) and
both stop at whichever comes first, a request count or a time limit, so a run never outlasts
its budget. The Python client is one thread multiplexing non-blocking sockets: on a 2-core
machine a thread per connection would spend the CPU the servers need on the GIL. Gunicorn's
sync workers close the connection after every answer, so each request opens one.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import os
import re
import selectors
import shutil
import socket
import subprocess
import tempfile
import time
import typing as t
from pathlib import Path

from .apps import PAYMENT_PATH

HOST = "127.0.0.1"
BODY = b'{"amount": 4200, "currency": "EUR", "customer": "cus_bench"}'
#: A connection that sees nothing for this long counts as failed, so a hung server cannot
#: hang the bench.
STALL_SECONDS = 30.0
_CONTENT_LENGTH = re.compile(rb"\r\ncontent-length:[ \t]*(\d+)", re.IGNORECASE)
_REPLAYED = re.compile(rb"\r\nidempotent-replayed:", re.IGNORECASE)

KeyFor = t.Callable[[int], str]


@dataclasses.dataclass
class LoadResult:
    """What one run of the load generator saw."""

    client: str
    requests: int
    seconds: float
    #: Status code per response, with `` replayed`` appended for replays.
    statuses: dict[str, int]
    errors: int
    #: Milliseconds.
    p50: float
    p95: float
    p99: float
    mean: float
    #: CPU seconds the client itself used (it shares the machine with the servers).
    client_cpu: float

    @property
    def rps(self) -> float:
        return self.requests / self.seconds if self.seconds > 0 else 0.0


def payment_request(port: int, key: str | None, path: str = PAYMENT_PATH) -> bytes:
    """The bytes of one payment POST."""
    lines = [
        f"POST {path} HTTP/1.1",
        f"Host: {HOST}:{port}",
        "Content-Type: application/json",
        f"Content-Length: {len(BODY)}",
        "Connection: close",
    ]
    if key is not None:
        lines.append(f"Idempotency-Key: {key}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + BODY


def get_request(port: int, path: str) -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: {HOST}:{port}\r\nConnection: close\r\n\r\n".encode()


def percentile(sorted_values: t.Sequence[float], fraction: float) -> float:
    """Nearest-rank percentile (the one wrk reports), 0 for no values."""
    if not sorted_values:
        return 0.0
    rank = max(1, math.ceil(fraction * len(sorted_values)))
    return float(sorted_values[rank - 1])


@dataclasses.dataclass(eq=False)
class _Exchange:
    sock: socket.socket
    request: bytes
    started: int
    sent: int = 0
    buffer: bytearray = dataclasses.field(default_factory=bytearray)
    last_activity: float = 0.0


@dataclasses.dataclass
class Response:
    status: int
    replayed: bool
    body: bytes
    latency_ns: int


def _parse(buffer: bytes | bytearray, complete: bool) -> tuple[int, bool, bytes] | None:
    """Status, replay flag and body once the response is whole, else None."""
    end = buffer.find(b"\r\n\r\n")
    if end < 0:
        return None
    head = bytes(buffer[:end])
    length = _CONTENT_LENGTH.search(head)
    body = bytes(buffer[end + 4 :])
    if length is not None and len(body) < int(length.group(1)):
        return None
    if length is None and not complete:
        return None  # no length: the body ends when the server closes
    return int(head[9:12]), _REPLAYED.search(head) is not None, body


def exchange(
    port: int,
    requests: t.Callable[[int], bytes],
    *,
    concurrency: int,
    max_requests: int,
    max_seconds: float,
    on_response: t.Callable[[Response], None] | None = None,
) -> tuple[list[int], collections.Counter[str], int, float]:
    """Closed loop of ``concurrency`` connections on one thread.

    :returns: latencies (ns, in completion order), status counts, errors, wall seconds.
    """
    selector = selectors.DefaultSelector()
    latencies: list[int] = []
    statuses: collections.Counter[str] = collections.Counter()
    errors = 0
    issued = 0
    started = time.perf_counter()
    deadline = started + max_seconds

    def launch() -> None:
        nonlocal issued, errors
        payload = requests(issued)
        issued += 1
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        begun = time.perf_counter_ns()
        code = sock.connect_ex((HOST, port))
        if code not in (0, 115, 11):  # 0, EINPROGRESS, EAGAIN
            sock.close()
            errors += 1
            return
        state = _Exchange(sock, payload, begun, last_activity=time.monotonic())
        selector.register(sock, selectors.EVENT_WRITE, state)

    def finish(state: _Exchange, parsed: tuple[int, bool, bytes] | None) -> None:
        nonlocal errors
        selector.unregister(state.sock)
        state.sock.close()
        if parsed is None:
            errors += 1
        else:
            status, replayed, body = parsed
            latency = time.perf_counter_ns() - state.started
            latencies.append(latency)
            statuses[f"{status} replayed" if replayed else str(status)] += 1
            if on_response is not None:
                on_response(Response(status, replayed, body, latency))
        if issued < max_requests and time.perf_counter() < deadline:
            launch()

    for _ in range(min(concurrency, max_requests)):
        launch()
    while selector.get_map():
        events = selector.select(timeout=1.0)
        now = time.monotonic()
        if not events:
            for key in list(selector.get_map().values()):
                state = key.data
                if now - state.last_activity > STALL_SECONDS:
                    finish(state, None)
            continue
        for key, mask in events:
            state = key.data
            state.last_activity = now
            try:
                if mask & selectors.EVENT_WRITE:
                    state.sent += state.sock.send(state.request[state.sent :])
                    if state.sent == len(state.request):
                        selector.modify(state.sock, selectors.EVENT_READ, state)
                    continue
                chunk = state.sock.recv(65536)
            except OSError:
                finish(state, None)
                continue
            if chunk:
                state.buffer += chunk
                parsed = _parse(state.buffer, complete=False)
                if parsed is not None:
                    finish(state, parsed)
            else:
                finish(state, _parse(state.buffer, complete=True))
    return latencies, statuses, errors, time.perf_counter() - started


def python_load(
    port: int, key_for: KeyFor, *, concurrency: int, max_requests: int, max_seconds: float
) -> LoadResult:
    """Drive the payment endpoint with the Python client."""
    cpu = time.process_time()
    latencies, statuses, errors, seconds = exchange(
        port,
        lambda n: payment_request(port, key_for(n)),
        concurrency=concurrency,
        max_requests=max_requests,
        max_seconds=max_seconds,
    )
    cpu = time.process_time() - cpu
    ordered = sorted(latencies)
    ms = 1e-6
    return LoadResult(
        client="python",
        requests=len(latencies),
        seconds=seconds,
        statuses=dict(statuses),
        errors=errors,
        p50=percentile(ordered, 0.50) * ms,
        p95=percentile(ordered, 0.95) * ms,
        p99=percentile(ordered, 0.99) * ms,
        mean=(sum(ordered) / len(ordered) * ms) if ordered else 0.0,
        client_cpu=cpu,
    )


def wrk_path() -> str | None:
    """wrk on PATH, if any (the bench never requires it)."""
    return shutil.which("wrk")


# A request() per call builds the key (S1: unique per thread and counter; S2: constant);
# response() tallies statuses and stops the thread at its share of the request budget;
# done() prints one JSON line the bench parses.
_WRK_SCRIPT = """
local mode, prefix, limit = "%(mode)s", "%(prefix)s", %(limit)d
local body = '%(body)s'
local threads, next_id = {}, 0
counter, responses, statuses = 0, 0, {}

function setup(thread)
  next_id = next_id + 1
  thread:set("tid", next_id)
  table.insert(threads, thread)
end

function request()
  counter = counter + 1
  local key = prefix
  if mode == "new" then key = prefix .. "-" .. tid .. "-" .. counter end
  return wrk.format("POST", "%(path)s", {
    ["Content-Type"] = "application/json",
    ["Idempotency-Key"] = key,
  }, body)
end

function response(status, headers, body)
  local name = tostring(status)
  if headers["Idempotent-Replayed"] then name = name .. " replayed" end
  statuses[name] = (statuses[name] or 0) + 1
  responses = responses + 1
  if responses >= limit then wrk.thread:stop() end
end

function done(summary, latency, requests)
  local merged = {}
  for _, thread in ipairs(threads) do
    for name, count in pairs(thread:get("statuses")) do
      merged[name] = (merged[name] or 0) + count
    end
  end
  local parts = {}
  for name, count in pairs(merged) do
    table.insert(parts, string.format('"%%s": %%d', name, count))
  end
  local e = summary.errors
  io.write(string.format(
    'WRK_JSON {"requests": %%d, "duration_us": %%d, "errors": %%d, "p50": %%d, ' ..
    '"p95": %%d, "p99": %%d, "mean": %%f, "statuses": {%%s}}\\n',
    summary.requests, summary.duration, e.connect + e.read + e.write + e.timeout,
    latency:percentile(50), latency:percentile(95), latency:percentile(99), latency.mean,
    table.concat(parts, ", ")))
end
"""


def wrk_load(
    port: int,
    mode: t.Literal["new", "same"],
    prefix: str,
    *,
    concurrency: int,
    max_requests: int,
    max_seconds: float,
) -> LoadResult:
    """Drive the payment endpoint with wrk (latency is measured from the write, after the
    connection is open, as wrk does)."""
    binary = wrk_path()
    if binary is None:
        raise RuntimeError("wrk is not installed")
    threads = max(1, min(2, concurrency))
    script = _WRK_SCRIPT % {
        "mode": mode,
        "prefix": prefix,
        "limit": max(1, math.ceil(max_requests / threads)),
        "body": BODY.decode(),
        "path": PAYMENT_PATH,
    }
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as handle:
        handle.write(script)
        script_path = Path(handle.name)
    usage = os.times()
    try:
        completed = subprocess.run(
            [
                binary,
                f"-t{threads}",
                f"-c{concurrency}",
                f"-d{max(1, math.ceil(max_seconds))}s",
                "--timeout",
                f"{int(STALL_SECONDS)}s",
                "-s",
                str(script_path),
                f"http://{HOST}:{port}{PAYMENT_PATH}",
            ],
            capture_output=True,
            text=True,
            timeout=max_seconds + STALL_SECONDS + 10,
            check=False,
        )
    finally:
        script_path.unlink(missing_ok=True)
    after = os.times()
    line = next((x for x in completed.stdout.splitlines() if x.startswith("WRK_JSON ")), None)
    if line is None:
        raise RuntimeError(f"wrk failed: {completed.stdout[-2000:]} {completed.stderr[-2000:]}")
    data = json.loads(line.removeprefix("WRK_JSON "))
    ms = 1e-3
    return LoadResult(
        client="wrk",
        requests=int(data["requests"]),
        seconds=data["duration_us"] / 1e6,
        statuses={str(k): int(v) for k, v in data["statuses"].items()},
        errors=int(data["errors"]),
        p50=data["p50"] * ms,
        p95=data["p95"] * ms,
        p99=data["p99"] * ms,
        mean=data["mean"] * ms,
        client_cpu=(after.children_user - usage.children_user)
        + (after.children_system - usage.children_system),
    )


@dataclasses.dataclass
class StormResult:
    """One storm: ``size`` requests with one key, all sent at once."""

    key: str
    statuses: dict[str, int]
    errors: int
    #: Distinct bodies among the 201 answers: 1 when every 201 is the original or its replay.
    distinct_bodies: int
    seconds: float


def storm(port: int, key: str, size: int) -> StormResult:
    """Open ``size`` connections and send the same keyed request on all of them at once."""
    bodies: set[bytes] = set()

    def keep(response: Response) -> None:
        if response.status == 201:
            bodies.add(response.body)

    payload = payment_request(port, key)
    _, statuses, errors, seconds = exchange(
        port,
        lambda _: payload,
        concurrency=size,
        max_requests=size,
        max_seconds=STALL_SECONDS,
        on_response=keep,
    )
    return StormResult(key, dict(statuses), errors, len(bodies), seconds)


def get_json(port: int, path: str, *, count: int = 1) -> list[t.Any]:
    """``count`` concurrent GETs of a JSON route (readiness, statistics flush)."""
    answers: list[t.Any] = []

    def keep(response: Response) -> None:
        if response.status == 200:
            answers.append(json.loads(response.body))

    exchange(
        port,
        lambda _: get_request(port, path),
        concurrency=count,
        max_requests=count,
        max_seconds=STALL_SECONDS,
        on_response=keep,
    )
    return answers
