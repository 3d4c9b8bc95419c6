"""Lease renewal for requests that are still running, and claims given back after a silence.

A lease tells other requests when the owner of a key counts as gone. A slow but alive request
must never look gone, so while a view runs its lease is renewed every third of its length. One
daemon thread per process does this for every running request: a fast request costs a dict
insert and delete, never a round trip.

The same thread gives back claims that may have landed after their request gave up: a server
silent past the deadline (frozen, a hung host) can wake up and run the claim it had received,
after the client got its 503 "not executed". That record would hold the key in progress for
its lease, and then, for a view with ``recovery="fail"``, answer ``outcome-pending`` although
nothing ran. Its token is known, so it is released, fenced by that token, once the store
answers again. A long outage at a high request rate would queue one give-back per 503 for a
whole TTL, so a process holds at most :data:`GIVE_BACK_MAX_PENDING`; a claim past that is left
to its lease, as it would be without give-backs.
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
from .core.idempotency_keys import key_hash
from .core.record import Record, Scope
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


@dataclasses.dataclass(eq=False)
class GiveBack:
    """A claim that may have landed after its request gave up: released once the store
    answers. Tried again while the store fails, until ``until`` (after its TTL no record can
    hold it), and, once the store answers without finding it, for one ``lease`` more: the
    silent backend holding the claim may wake after the others (a backend frozen alone)."""

    scope: Scope
    token: str
    lease: float
    until: float
    due: float
    delay: float = 1.0
    #: Set when the store first answered without finding the claim.
    found_nothing_until: float | None = None
    active: bool = True


#: The longest wait between two attempts to give a claim back while the store is silent.
GIVE_BACK_MAX_DELAY = 30.0
#: The most give-backs one process keeps pending (an entry is a few hundred bytes).
GIVE_BACK_MAX_PENDING = 10_000


class LeaseKeeper:
    """Renews watched leases from one background thread (started on first use per process)."""

    def __init__(self, store: RequestStore) -> None:
        self.store = store
        self._condition = threading.Condition()
        self._heap: list[tuple[float, int, Watch | GiveBack]] = []
        self._order = itertools.count()
        self._pid: int | None = None
        self._giving_back = 0
        self.max_give_backs = GIVE_BACK_MAX_PENDING

    def watch(self, record: Record, lease: float) -> Watch:
        """Keep renewing the lease of ``record`` (owned by the caller) until :meth:`unwatch`."""
        watch = Watch(record, lease, due=time.monotonic() + lease / 3)
        # Wakes the thread only if this lease is now the first due (usually it is not).
        self._schedule(watch)
        return watch

    def unwatch(self, watch: Watch) -> None:
        # Lazy removal: the thread drops inactive entries when they come due.
        watch.active = False

    def give_back(self, scope: Scope, token: str, *, ttl: float, lease: float) -> None:
        """Release the claim ``token`` of ``scope`` once the store answers, if the claim
        landed (the release is fenced by the token: a no-op otherwise). Only for a claim
        whose request runs nothing: its 503 said it was not executed. Past
        :attr:`max_give_backs` pending, the claim is left to its lease (logged)."""
        with self._condition:
            self._ensure_thread()  # first: a forked worker starts counting from none
            if self._giving_back >= self.max_give_backs:
                log.warning(
                    "too many claims to give back; this one is left to its lease",
                    extra={"key_hash": key_hash(scope)},
                )
                return
            self._giving_back += 1
        now = time.monotonic()
        self._schedule(GiveBack(scope, token, lease, until=now + ttl, due=now + 1.0))

    @property
    def giving_back(self) -> int:
        """How many claims this process is waiting to give back."""
        return self._giving_back

    def _schedule(self, entry: Watch | GiveBack) -> None:
        with self._condition:
            self._ensure_thread()
            heapq.heappush(self._heap, (entry.due, next(self._order), entry))
            if self._heap[0][2] is entry:
                self._condition.notify()

    def _ensure_thread(self) -> None:
        # A forked worker (gunicorn --preload) inherits the object but not the thread.
        if self._pid == os.getpid():
            return
        self._pid = os.getpid()
        self._heap.clear()
        self._giving_back = 0
        threading.Thread(target=self._run, name="flask-idem-lease", daemon=True).start()

    def _next_due(self) -> Watch | GiveBack:
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
            entry = self._next_due()
            if isinstance(entry, GiveBack):
                self._give_back(entry)
            elif self.renew(entry):
                with self._condition:
                    if entry.active:
                        entry.due = time.monotonic() + entry.lease / 3
                        heapq.heappush(self._heap, (entry.due, next(self._order), entry))

    def renew(self, watch: Watch) -> bool:
        """Renew one lease now; False when it was lost (taken over or finished: stop renewing).

        A failing store is no loss: the next tick tries again. The owner's own completion is
        fenced by its token, so it learns of a loss there. Any other error (a custom store's
        bug, a driver raising what the store does not translate) is logged and tried again
        too: it must never end the thread, or every lease in the process would run out under
        requests that still run, and a ``recovery="reexecute"`` retry would take them over.
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
        except Exception as exc:
            log.error("lease renewal raised; retrying", exc_info=redacted(exc))
            return True

    def _give_back(self, entry: GiveBack) -> None:
        try:
            released = self.store.release(entry.scope, entry.token)
        except StoreUnavailable:
            self._again(entry, entry.until)
            return
        except Exception as exc:  # never the thread's end: see renew()
            log.error("giving a claim back raised; retrying", exc_info=redacted(exc))
            self._again(entry, entry.until)
            return
        if released:
            log.info(
                "gave back a claim that landed after its request answered 503",
                extra={"key_hash": key_hash(entry.scope)},
            )
            self._done_giving_back()
            return
        if entry.found_nothing_until is None:
            entry.found_nothing_until = min(entry.until, time.monotonic() + entry.lease)
        self._again(entry, entry.found_nothing_until)

    def _again(self, entry: GiveBack, until: float) -> None:
        """Try ``entry`` again after a growing delay, unless that is past ``until``."""
        due = time.monotonic() + entry.delay
        if due < until:
            entry.due = due
            entry.delay = min(entry.delay * 2, GIVE_BACK_MAX_DELAY)
            self._schedule(entry)
        else:
            self._done_giving_back()

    def _done_giving_back(self) -> None:
        with self._condition:
            self._giving_back -= 1
