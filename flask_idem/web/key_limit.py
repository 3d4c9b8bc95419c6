"""The per-tenant limit on new idempotency keys (``IDEMPOTENCY_KEY_RATE_LIMIT``).

A tenant that sends a new key with every request (a client bug that generates one per retry, or
a flood) grows the table by a row per request and defeats the replay. The limit counts only
claims that create a record; a retry that is replayed, waits (409) or is refused for another
body (422) is never counted, nor refused by it.

The order, in :func:`flask_idem.web.flow.claim`: the limit is *tested* (nothing counted) before
the claim; when it is exhausted, one read of the scope tells a retry (a record exists: the
claim goes on and answers from it) from a new key (refused 429 ``idempotency-key-rate-limited``
with ``Retry-After``; the view does not run and no record is written). A claim that created
its record is *counted* after it. So a refusal costs one read and no write, and a replay is
never refused; under concurrency a few claims may pass the limit between the test and the
count (bounded by the requests in flight), which a limit on new keys can afford.

The counters live in the storage of the application's Flask-Limiter (``app.extensions
["limiter"]``, with its strategy: its Redis or SQL storage shares them between workers), else
in the ``limits`` package's memory storage (per process) with the moving-window strategy.
Each tenant has its own counter (one per view for a view's own ``key_rate_limit=``), keyed by a
digest of the tenant, so no tenant's traffic (nor a tenant name made to look like another's
counter key) limits another, and no tenant name reaches the limiter's storage.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import math
import threading
import time
import typing as t

from flask import current_app

from ..core.config import Settings
from ..core.errors import ConfigurationError
from ..core.options import ViewOptions
from ..core.problem import KeyRateLimited, StoreUnavailableProblem
from ..core.record import Scope

if t.TYPE_CHECKING:
    from limits import RateLimitItem
    from limits.strategies import RateLimiter

log = logging.getLogger("flask_idem")

#: The first of the identifiers of every counter flask_idem keeps in the limiter's storage.
NAMESPACE = "flask_idem-new-keys"


class KeyLimiter:
    """The counters of one application, on the storage found at its first use (a
    Flask-Limiter initialised after flask_idem is found too)."""

    def __init__(self) -> None:
        self._found: t.Callable[[], RateLimiter] | None = None
        self._lock = threading.Lock()

    def applying(self, settings: Settings, options: ViewOptions, scope: Scope) -> KeyLimit | None:
        """The limit the request's new key counts against, or None (no limit)."""
        if options.key_rate_limit is False:
            return None
        if options.key_rate_limit:
            spelled, counted = options.key_rate_limit, f"{scope.tenant}\x00{scope.endpoint}"
        elif settings.key_rate_limit is not None:
            spelled, counted = settings.key_rate_limit, scope.tenant
        else:
            return None
        digest = hashlib.sha256(counted.encode("utf-8", "surrogatepass")).hexdigest()
        return KeyLimit(self.strategy(), _parsed(spelled), (NAMESPACE, digest))

    def strategy(self) -> RateLimiter:
        """The strategy to count with, asked of Flask-Limiter on every use (it switches to
        its in-memory fallback while its storage is down, when configured to)."""
        if self._found is None:
            with self._lock:  # one memory storage per application, never two half-counted
                if self._found is None:
                    self._found = _find_strategy()
        return self._found()


class KeyLimit:
    """One tenant's counter(s) for the current request."""

    def __init__(
        self,
        strategy: RateLimiter,
        items: tuple[RateLimitItem, ...],
        identifiers: tuple[str, ...],
    ) -> None:
        self.strategy = strategy
        self.items = items
        self.identifiers = identifiers

    def allows(self) -> bool:
        """Whether one more new key fits every limit (nothing is counted)."""
        with _storage_errors():
            return all(self.strategy.test(item, *self.identifiers) for item in self.items)

    def count(self) -> None:
        """Count the new key the claim just created (it runs whatever the counter says: the
        claim is made, and the limit tolerates the few that passed concurrently)."""
        try:
            for item in self.items:
                self.strategy.hit(item, *self.identifiers)
        except Exception:
            # The key is claimed and the view about to run: a counter that could not be
            # written must not turn it into a failure (the test before the claim fails closed).
            log.warning("the new-key rate limit could not count a claim", exc_info=True)

    def refusal(self) -> KeyRateLimited:
        """The 429 of a new key over the limit, with the seconds until the fullest of the
        exhausted windows frees a slot."""
        with _storage_errors():
            waits = [
                self.strategy.get_window_stats(item, *self.identifiers).reset_time - time.time()
                for item in self.items
                if not self.strategy.test(item, *self.identifiers)
            ]
        return KeyRateLimited(
            "Too many new idempotency keys: this request was not executed, and nothing was "
            "recorded for its key. Retry it with the same key after the Retry-After delay.",
            retry_after=math.ceil(max(waits, default=1.0)),
        )


@functools.lru_cache(maxsize=64)
def _parsed(spelled: str) -> tuple[RateLimitItem, ...]:
    import limits

    return tuple(limits.parse_many(spelled))


def _find_strategy() -> t.Callable[[], RateLimiter]:
    """The application's Flask-Limiter's strategy (with its storage), else a moving window
    over ``limits``' memory storage."""
    registered = list(current_app.extensions.get("limiter", ()))
    if len(registered) > 1:
        raise ConfigurationError(
            "IDEMPOTENCY_KEY_RATE_LIMIT: the application has several Flask-Limiter instances, "
            "and flask_idem cannot tell which storage to count new keys in"
        )
    if registered:
        limiter = registered[0]
        return lambda: t.cast("RateLimiter", limiter.limiter)
    from limits.storage import MemoryStorage
    from limits.strategies import MovingWindowRateLimiter

    strategy = MovingWindowRateLimiter(MemoryStorage())
    return lambda: strategy


@contextlib.contextmanager
def _storage_errors() -> t.Iterator[None]:
    """A limiter storage that fails (Redis gone) refuses the request with 503, as the
    idempotency store's own failures do: fail closed, never a 500."""
    try:
        yield
    except Exception as exc:
        log.error("the new-key rate limit's storage failed: %s", type(exc).__name__)
        raise StoreUnavailableProblem(
            "The rate limit's storage cannot be reached; the request was not executed. "
            "Retry later with the same key."
        ) from None
