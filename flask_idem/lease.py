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

from .core.errors import StoreUnavailable
from .core.record import Record
from .store.base import RequestStore
from .store.messages import redacted

log = logging.getLogger("flask_idem")


@dataclasses.dataclass(eq=False)
class Watch:
    """One running request's lease, renewed until the request ends (``active`` turns False)."""

    record: Record
    lease: float
    due: float
    active: bool = True


class LeaseKeeper:
    """Renews watched leases from one background thread (started on first use per process)."""

    def __init__(self, store: RequestStore) -> None:
        self.store = store
        self._condition = threading.Condition()
        self._heap: list[tuple[float, int, Watch]] = []
        self._order = itertools.count()
        self._pid: int | None = None

    def watch(self, record: Record, lease: float) -> Watch:
        """Keep renewing the lease of ``record`` (owned by the caller) until :meth:`unwatch`."""
        watch = Watch(record, lease, due=time.monotonic() + lease / 3)
        with self._condition:
            self._ensure_thread()
            heapq.heappush(self._heap, (watch.due, next(self._order), watch))
            # Wake the thread only if this lease is now the first due (usually it is not).
            if self._heap[0][2] is watch:
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
            if not self.renew(watch):
                continue
            with self._condition:
                if watch.active:
                    watch.due = time.monotonic() + watch.lease / 3
                    heapq.heappush(self._heap, (watch.due, next(self._order), watch))

    def renew(self, watch: Watch) -> bool:
        """Renew one lease now; False when it was lost (taken over or finished: stop renewing).

        A failing store is no loss: the next tick tries again. The owner's own completion is
        fenced by its token, so it learns of a loss there.
        """
        record = watch.record
        assert record.claim_token is not None
        try:
            return self.store.renew(
                record.scope, record.claim_token, lease=watch.lease, created_at=record.created_at
            )
        except StoreUnavailable as exc:
            log.warning("lease renewal failed; retrying", exc_info=redacted(exc))
            return True
