"""The sample app's webhook receiver under gunicorn, on PostgreSQL and SQLite: the provider
delivers one event several times, concurrently and after a worker was killed mid-event, and
the receiver records it once. Signatures are computed here, as the provider would."""

from __future__ import annotations

import concurrent.futures
import contextlib
import email.parser
import email.policy
import hashlib
import hmac
import json
import os
import signal
import socket
import threading
import time
import typing as t
import uuid
from pathlib import Path

import pytest

from tests.e2e.test_sample_app import assert_problem, in_background, new_customer, payment, wait_for
from tests.e2e.test_sample_outcomes import _database
from tests.support.sample_server import Reply, SampleServer, stored_key

pytestmark = [pytest.mark.postgresql, pytest.mark.slow]

PATH = "/v1/webhooks/provider"
LATENCY_MS = 800
LEASE = 2
SECRETS = {"alpha": "whsec_alpha", "beta": "whsec_beta"}


@pytest.fixture(scope="module", params=["postgresql", "sqlite"])
def server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> t.Iterator[SampleServer]:
    """Each new event takes 0.8 s to handle, so that a worker can be killed in the middle."""
    workdir = tmp_path_factory.mktemp(f"webhooks-{request.param}")
    server = SampleServer(
        _database(request, workdir),
        workdir,
        threads=4,
        SAMPLE_WEBHOOK_LATENCY_MS=str(LATENCY_MS),
        FLASK_IDEMPOTENCY_LEASE=str(LEASE),
    )
    yield server
    server.stop()


def new_event(kind: str = "charge.succeeded", **data: t.Any) -> dict[str, t.Any]:
    return {"id": f"evt_{uuid.uuid4().hex}", "type": kind, "data": data}


def deliver(server: SampleServer, event: t.Any, account: str = "alpha", **kwargs: t.Any) -> Reply:
    """One delivery attempt: its own delivery id and a fresh signature, as providers send."""
    body = json.dumps(event).encode()
    stamp = int(time.time())
    mac = hmac.new(SECRETS[account].encode(), f"{stamp}.".encode() + body, hashlib.sha256)
    headers = {
        "Provider-Signature": f"t={stamp},v1={mac.hexdigest()}",
        "Provider-Delivery": f"dlv_{uuid.uuid4().hex[:12]}",
        **kwargs.pop("headers", {}),
    }
    return server.request("POST", PATH, api_key=None, raw=body, headers=headers, **kwargs)


def received(server: SampleServer, event: dict[str, t.Any]) -> list[t.Any]:
    return server.sql(
        "SELECT tenant, delivery_id FROM webhook_events WHERE event_id = :e", e=event["id"]
    )


def test_repeated_deliveries_are_one_event(server: SampleServer) -> None:
    event = new_event()
    first = deliver(server, event)
    assert first.status == 200 and first.json() == {"received": event["id"], "type": event["type"]}
    for _ in range(3):
        again = deliver(server, event)
        assert again.status == 200 and again.headers["Idempotent-Replayed"] == "true"
        assert again.body == first.body
    rows = received(server, event)
    assert len(rows) == 1 and rows[0].tenant == "alpha"


def test_concurrent_deliveries_are_one_event(server: SampleServer) -> None:
    event = new_event()
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        statuses = sorted(r.status for r in pool.map(lambda _: deliver(server, event), range(6)))
    assert set(statuses) <= {200, 409} and 200 in statuses, statuses
    assert deliver(server, event).status == 200
    assert len(received(server, event)) == 1


def test_a_worker_killed_mid_event_is_redelivered_once(server: SampleServer) -> None:
    event = new_event()
    connection = server.connection()
    connection.connect()
    assert connection.sock is not None
    client_port = connection.sock.getsockname()[1]
    thread, _ = in_background(lambda: deliver(server, event, connection=connection))
    state = "SELECT state FROM idempotency_keys WHERE key = :k"
    wait_for(lambda: server.scalar(state, k=stored_key(event["id"])) == "in_progress")
    worker = server.worker_serving(client_port)
    assert worker is not None and worker != server.process.pid
    os.kill(worker, signal.SIGKILL)
    thread.join()
    retry = deliver(server, event)  # the lease is still held by the dead worker
    assert_problem(retry, 409, "request-in-progress")
    deadline = time.monotonic() + LEASE + 10
    while retry.status == 409 and time.monotonic() < deadline:
        time.sleep(0.3)
        retry = deliver(server, event)
    assert retry.status == 200 and "Idempotent-Replayed" not in retry.headers
    assert len(received(server, event)) == 1, "the killed attempt committed nothing"


def test_signatures_are_checked_before_the_claim_and_name_the_tenant(
    server: SampleServer,
) -> None:
    event = new_event()
    forged = deliver(server, event, headers={"Provider-Signature": "t=1,v1=00"})
    assert_problem(forged, 401, "invalid-signature")
    unsigned = server.request("POST", PATH, api_key=None, json_body=event)
    assert_problem(unsigned, 401, "invalid-signature")
    bearer = server.request("POST", PATH, json_body=event)  # an API key is no signature
    assert_problem(bearer, 401, "invalid-signature")
    assert (
        server.scalar(
            "SELECT count(*) FROM idempotency_keys WHERE key = :k", k=stored_key(event["id"])
        )
        == 0
    )
    assert deliver(server, event, account="beta").status == 200
    assert deliver(server, event, account="alpha").headers.get("Idempotent-Replayed") is None
    assert sorted(row.tenant for row in received(server, event)) == ["alpha", "beta"]
    missing = deliver(server, {"type": "charge.refunded"})
    assert_problem(missing, 400, "idempotency-key-missing")


@pytest.mark.parametrize("digits", [400, 5000])
def test_a_timestamp_of_many_digits_is_an_invalid_signature(
    server: SampleServer, digits: int
) -> None:
    """A ``t=`` far too long for a Unix time (it overflowed a float at 400 digits and hit
    Python's integer-string limit at 5000: a 500 with a traceback, unauthenticated) is a
    signature refused like any other, before the claim; the MAC is right for that ``t``."""
    event = new_event()
    body = json.dumps(event).encode()
    stamp = "9" * digits
    mac = hmac.new(SECRETS["alpha"].encode(), f"{stamp}.".encode() + body, hashlib.sha256)
    headers = {"Provider-Signature": f"t={stamp},v1={mac.hexdigest()}"}
    reply = server.request("POST", PATH, api_key=None, raw=body, headers=headers)
    assert_problem(reply, 401, "invalid-signature")
    assert b"Traceback" not in reply.body
    assert (
        server.scalar(
            "SELECT count(*) FROM idempotency_keys WHERE key = :k", k=stored_key(event["id"])
        )
        == 0
    )


UPLOAD_MIB = 400


def _peak_rss(pids: t.Iterable[int]) -> dict[int, int]:
    """Each process's peak resident set so far (``VmHWM``, KiB)."""
    peaks = {}
    for pid in pids:
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    peaks[pid] = int(line.split()[1])
    return peaks


def _upload(server: SampleServer, headers: dict[str, str], mib: int, chunked: bool) -> Reply:
    """POST ``mib`` MiB to the webhook on a raw socket, reading the answer while sending: a
    server that refuses early closes the connection before the body has all gone."""
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=60)
    framing = {"Transfer-Encoding": "chunked"} if chunked else {"Content-Length": str(mib << 20)}
    head = [f"POST {PATH} HTTP/1.1", "Host: 127.0.0.1", "Connection: close"]
    head += [f"{name}: {value}" for name, value in {**headers, **framing}.items()]
    received = bytearray()

    def read() -> None:
        with contextlib.suppress(OSError):
            while chunk := sock.recv(65536):
                received.extend(chunk)

    reader = threading.Thread(target=read)
    reader.start()
    piece = b"x" * (1 << 20)
    if chunked:
        piece = b"%x\r\n%s\r\n" % (len(piece), piece)
    try:
        sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode())
        for _ in range(mib):
            sock.sendall(piece)
        if chunked:
            sock.sendall(b"0\r\n\r\n")
    except OSError:  # the server answered and closed: the rest was never wanted
        pass
    reader.join(60)
    sock.close()
    status_line, _, rest = bytes(received).partition(b"\r\n")
    header_block, _, body = rest.partition(b"\r\n\r\n")
    message = email.parser.BytesHeaderParser(policy=email.policy.compat32).parsebytes(header_block)
    return Reply(int(status_line.split()[1]), t.cast(t.Any, message), body)


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_a_huge_unverified_delivery_is_refused_before_it_is_read(
    server: SampleServer, chunked: bool
) -> None:
    """400 MiB behind a fresh timestamp and a wrong MAC: the signature check read and hashed
    all of it before refusing it (a worker grew by the upload's size, twice over). The body is
    read bounded by ``IDEMPOTENCY_MAX_REQUEST_BODY`` (1 MiB): 413, and the worker stays small."""
    headers = {"Provider-Signature": f"t={int(time.time())},v1={'0' * 64}"}
    before = _peak_rss(server.workers())
    reply = _upload(server, headers, UPLOAD_MIB, chunked)
    after = _peak_rss(server.workers())
    grown = {pid: (after[pid] - before[pid]) >> 10 for pid in before.keys() & after.keys()}
    assert grown and max(grown.values()) < 64, f"MiB of peak RSS gained per worker: {grown}"
    assert_problem(reply, 413, "request-body-too-large")


def test_a_refund_event_marks_the_payment_refunded_once(server: SampleServer) -> None:
    paid = server.pay(str(uuid.uuid4()), payment(new_customer())).json()
    event = new_event("charge.refunded", charge=paid["provider_charge_id"])
    assert deliver(server, event).status == 200
    assert deliver(server, event).headers["Idempotent-Replayed"] == "true"
    shown = server.request("GET", f"/v1/payments/{paid['id']}").json()
    assert shown["status"] == "refunded"
    assert len(received(server, event)) == 1
