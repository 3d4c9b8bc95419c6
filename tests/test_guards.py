"""The deadline watchdog of store connections, on real sockets (no database needed)."""

from __future__ import annotations

import os
import socket
import time

import pytest

from flask_idem.store.guards import Watchdog


def _recv_blocked(sock: socket.socket, watchdog: Watchdog, budget: float) -> tuple[bytes, bool]:
    """Block in ``recv`` (a silent peer) with ``budget`` armed; what it returned, and whether
    the watchdog fired."""
    sock.settimeout(10)  # a safety net only: the watchdog must act long before
    token = watchdog.arm(sock.fileno(), budget)
    try:
        data = sock.recv(1)
    finally:
        fired = watchdog.disarm(token)
    return data, fired


def test_an_expired_deadline_shuts_the_socket_down() -> None:
    watchdog = Watchdog()
    ours, silent = socket.socketpair()
    with ours, silent:
        started = time.monotonic()
        data, fired = _recv_blocked(ours, watchdog, 0.3)
        elapsed = time.monotonic() - started
        assert (data, fired) == (b"", True), "the blocked call returned: the peer hung up"
        assert 0.3 <= elapsed < 0.3 + 1.5, elapsed
        assert ours.fileno() >= 0, "the descriptor itself stays open (its owner closes it)"


def test_a_call_answered_in_time_is_untouched() -> None:
    watchdog = Watchdog()
    ours, peer = socket.socketpair()
    with ours, peer:
        for _ in range(2000):  # many short calls: the heap is rebuilt, never shuts anything
            token = watchdog.arm(ours.fileno(), 0.2)
            peer.send(b"x")
            assert ours.recv(1) == b"x"
            assert watchdog.disarm(token) is False
        assert len(watchdog._heap) <= 2 * len(watchdog._armed) + watchdog.slack
        time.sleep(0.5)  # every deadline has passed by now: all were disarmed in time
        peer.send(b"y")
        assert ours.recv(1) == b"y"
        ours.send(b"z")
        assert peer.recv(1) == b"z"


def test_only_the_late_call_is_cut_off() -> None:
    watchdog = Watchdog()
    late, late_peer = socket.socketpair()
    idle, idle_peer = socket.socketpair()
    with late, late_peer, idle, idle_peer:
        idle_token = watchdog.arm(idle.fileno(), 30)  # armed, but far from its deadline
        data, fired = _recv_blocked(late, watchdog, 0.2)
        assert (data, fired) == (b"", True)
        idle_peer.send(b"ok")
        assert idle.recv(2) == b"ok"
        assert watchdog.disarm(idle_token) is False


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # fork() with threads (3.12+)
def test_a_forked_child_gets_its_own_watchdog_thread() -> None:
    watchdog = Watchdog()
    ours, silent = socket.socketpair()
    with ours, silent:
        watchdog.disarm(watchdog.arm(ours.fileno(), 5))  # the parent's thread runs
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child reports through its exit status
            code = 1
            try:
                data, fired = _recv_blocked(ours, watchdog, 0.2)
                code = 0 if (data, fired) == (b"", True) else 2
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
