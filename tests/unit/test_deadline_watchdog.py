"""The deadline watchdog of store connections, on real sockets (no database needed)."""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest

from flask_idem.store.engines import Watchdog


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
        for _ in range(2000):  # many short calls: none is ever shut down
            token = watchdog.arm(ours.fileno(), 0.2)
            peer.send(b"x")
            assert ours.recv(1) == b"x"
            assert watchdog.disarm(token) is False
        assert not watchdog._armed, "every disarmed call left no entry behind"
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


def _asleep(watchdog: Watchdog) -> None:
    """Wait until the watchdog's thread sleeps until woken (it looked: nothing armed)."""
    watchdog._wake()  # make it look now, past the deadline of the call that started it
    deadline = time.monotonic() + 5
    while watchdog._wake_at != float("inf"):
        assert time.monotonic() < deadline, "the idle thread never went to sleep"
        time.sleep(0.02)


def test_a_sleeping_watchdog_is_woken_by_the_next_call() -> None:
    watchdog = Watchdog()
    ours, silent = socket.socketpair()
    with ours, silent:
        watchdog.disarm(watchdog.arm(ours.fileno(), 5))  # starts the thread
        _asleep(watchdog)
        started = time.monotonic()
        data, fired = _recv_blocked(ours, watchdog, 0.3)
        assert (data, fired) == (b"", True), "the sleeping thread was woken and acted"
        assert time.monotonic() - started < 0.3 + 1.5


def test_calls_armed_from_many_threads_are_each_cut_off_or_untouched() -> None:
    """Arms and disarms without a lock, from threads racing the watchdog's thread: each late
    call is cut off exactly once, and no call answered in time ever is."""
    watchdog = Watchdog()
    results: list[tuple[str, bool, bytes]] = []

    def call(late: bool) -> None:
        ours, peer = socket.socketpair()
        with ours, peer:
            ours.settimeout(10)
            for _ in range(3 if late else 300):
                token = watchdog.arm(ours.fileno(), 0.2 if late else 30)
                if not late:
                    peer.send(b"x")
                data = ours.recv(1)
                results.append(("late" if late else "quick", watchdog.disarm(token), data))
                if late:
                    break

    threads = [threading.Thread(target=call, args=(n % 4 == 0,)) for n in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(set(results)) == [("late", True, b""), ("quick", False, b"x")]
    assert sum(kind == "late" for kind, _, _ in results) == 4
    assert not watchdog._armed


def test_a_call_ended_before_the_woken_watchdog_looked_leaves_it_wakeable() -> None:
    """A short call wakes the sleeping thread and is disarmed before the thread looks: the
    thread sleeps on, and the next call must still wake it (it once stayed asleep for good)."""
    watchdog = Watchdog()
    ours, silent = socket.socketpair()
    with ours, silent:
        watchdog.disarm(watchdog.arm(ours.fileno(), 5))  # starts the thread
        _asleep(watchdog)
        for _ in range(3):  # woken, and nothing armed any more when it looks
            watchdog.disarm(watchdog.arm(ours.fileno(), 5))
            time.sleep(0.2)
        data, fired = _recv_blocked(ours, watchdog, 0.3)
        assert (data, fired) == (b"", True), "the deadline of the next call never fired"


def test_a_sooner_deadline_wakes_a_thread_waiting_for_a_later_one() -> None:
    watchdog = Watchdog()
    late, late_peer = socket.socketpair()
    soon, silent = socket.socketpair()
    with late, late_peer, soon, silent:
        far = watchdog.arm(late.fileno(), 30)  # the thread now sleeps until this one
        time.sleep(0.2)
        started = time.monotonic()
        data, fired = _recv_blocked(soon, watchdog, 0.3)
        assert (data, fired) == (b"", True)
        assert time.monotonic() - started < 0.3 + 1.5, "cut off only at the later deadline"
        assert watchdog.disarm(far) is False


def test_under_steady_calls_the_thread_sleeps_until_the_earliest_deadline() -> None:
    """Calls with one budget, one after the other, never wake the thread: its wake-up time is
    the earliest deadline it saw, and every later call's is later."""
    watchdog = Watchdog()
    ours, peer = socket.socketpair()
    with ours, peer:
        watchdog.disarm(watchdog.arm(ours.fileno(), 5))
        time.sleep(0.2)
        woken: list[int] = []
        wake = watchdog._wake
        watchdog._wake = lambda: (woken.append(1), wake())[1]  # type: ignore[method-assign]
        for _ in range(500):
            token = watchdog.arm(ours.fileno(), 5)
            peer.send(b"x")
            assert ours.recv(1) == b"x"
            assert watchdog.disarm(token) is False
        assert woken == [], "a call of the same budget woke the thread"


def test_a_call_armed_by_the_thread_holding_the_watchdogs_lock_does_not_deadlock() -> None:
    """A garbage-collected connection's rollback can run in a finalizer of the thread that
    holds the watchdog's lock (its own thread while it looks, or one waking it): arming
    there must not wait for the lock forever (every later arm would then wait too)."""
    watchdog = Watchdog()
    ours, silent = socket.socketpair()
    done: list[bool] = []

    def finalizer_like() -> None:
        with watchdog._lock:
            watchdog.disarm(watchdog.arm(ours.fileno(), 5))  # the first arm wakes the thread
        done.append(True)

    with ours, silent:
        caller = threading.Thread(target=finalizer_like, daemon=True)
        caller.start()
        caller.join(5)
        assert done == [True], "arming under the watchdog's own lock deadlocked"
        data, fired = _recv_blocked(ours, watchdog, 0.3)
        assert (data, fired) == (b"", True)
