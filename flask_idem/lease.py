"""Lease renewal for requests that are still running.

A lease tells other requests when the owner of a key counts as gone. A slow but alive request
must never look gone, so while a view runs its lease is renewed every third of its length. One
daemon thread per process does this for every running request: a fast request costs a dict
insert and delete, never a round trip.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import logging
import os
import threading
import time

from .errors import StoreUnavailable
from .record import Scope
from .store.base import Store

log = logging.getLogger("flask_idem")


@dataclasses.dataclass(eq=False)
class Watch:
    """One running request's lease; ``lost`` turns True if a renewal found it taken over."""

    scope: Scope
    token: str
    lease: float
    due: float
    lost: bool = False
    active: bool = True


class LeaseKeeper:
    """Renews watched leases from one background thread (started on first use per process)."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self._condition = threading.Condition()
        self._heap: list[tuple[float, int, Watch]] = []
        self._order = itertools.count()
        self._pid: int | None = None

    def watch(self, scope: Scope, token: str, lease: float) -> Watch:
        watch = Watch(scope, token, lease, due=time.monotonic() + lease / 3)
        with self._condition:
            self._ensure_thread()
            heapq.heappush(self._heap, (watch.due, next(self._order), watch))
            self._condition.notify()
        return watch

    def unwatch(self, watch: Watch) -> None:
        # Lazy removal: the thread drops inactive entries when they come due.
        watch.active = False

    def _ensure_thread(self) -> None:
        # A forked worker (gunicorn --preload) inherits the object but not the thread.
        if self._pid == os.getpid():
            return
        self._pid = os.getpid()
        self._heap.clear()
        threading.Thread(target=self._run, name="flask-idem-lease", daemon=True).start()

    def _next_due(self) -> Watch:
        with self._condition:
            while True:
                while self._heap and not self._heap[0][2].active:
                    heapq.heappop(self._heap)
                if self._heap and self._heap[0][0] <= time.monotonic():
                    return heapq.heappop(self._heap)[2]
                timeout = self._heap[0][0] - time.monotonic() if self._heap else None
                self._condition.wait(timeout)

    def _run(self) -> None:
        while True:
            watch = self._next_due()
            try:
                renewed = self.store.renew(watch.scope, watch.token, lease=watch.lease)
            except StoreUnavailable:
                log.warning("lease renewal failed; retrying", exc_info=True)
                renewed = True  # not lost: try again at the next tick
            if not renewed:
                watch.lost = watch.active
                continue
            with self._condition:
                if watch.active:
                    watch.due = time.monotonic() + watch.lease / 3
                    heapq.heappush(self._heap, (watch.due, next(self._order), watch))
