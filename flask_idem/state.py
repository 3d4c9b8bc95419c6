"""Per-application state, importable by every module of the package.

``init_app`` keeps an :class:`AppState` in ``app.extensions["idempotency"]``. The attempt of a
protected request or job (:class:`flask_idem.attempt.Attempt`) lives on ``flask.g`` under
:data:`ATTEMPT_SLOT`. This module imports nothing above the store, so the CLI, the blueprint,
reconcilers, jobs and the flow can all use it without an import cycle; the modules below the
attempt (the commit guard, the session listeners) name its type only for the type checker.
"""

from __future__ import annotations

import dataclasses
import typing as t

from flask import current_app, g

from .core.config import EXTENSION_NAME, Settings
from .lease import LeaseKeeper
from .store import RequestStore

if t.TYPE_CHECKING:
    from .attempt import Attempt
    from .web.extension import Idempotency
    from .web.key_limit import KeyLimiter

#: ``flask.g`` attribute holding the context's :class:`~flask_idem.attempt.Attempt`.
ATTEMPT_SLOT = "_flask_idem"
#: ``session.info`` key of the attempt whose business transaction a session carries.
SESSION_ATTEMPT = "flask_idem.attempt"


class Trace(t.Protocol):
    """One attempt as a tracer follows it (:mod:`flask_idem.ops.otel`). The transitions reach it
    as signals; these are the moments no signal marks."""

    def completing(self) -> None:
        """The view or job is over: its result is being recorded, or its key given up."""

    def failed(self, error: BaseException) -> None:
        """The view or job raised ``error``."""

    def end(self) -> None:
        """The attempt is over (its request torn down, its job returned or raised)."""


class SessionSource(t.Protocol):
    """Where the business sessions come from (see :mod:`flask_idem.sessions`)."""

    @property
    def scoped(self) -> t.Any:
        """The application's ``db.session`` (a ``scoped_session``)."""


@dataclasses.dataclass
class AppState:
    """What ``init_app`` keeps per application in ``app.extensions["idempotency"]``."""

    extension: Idempotency
    settings: Settings
    store: RequestStore
    keeper: LeaseKeeper
    #: The counters of ``IDEMPOTENCY_KEY_RATE_LIMIT`` and ``key_rate_limit=``.
    key_limiter: KeyLimiter
    #: The application's Flask-SQLAlchemy session (``Idempotency(db=...)``): the business
    #: transaction of every protected request, None for the store's own connections.
    sessions: SessionSource | None = None
    #: The application keeps Flask's own ``ensure_sync`` (which returns a plain function as
    #: it is), so a guard may skip asking it for a view that is not a coroutine function.
    plain_ensure_sync: bool = True
    #: A Flask-SQLAlchemy registered on the app whose session flask_idem does not settle (the
    #: store runs on another database): its writes left uncommitted by a view are warned of.
    unmanaged_db: t.Any = None
    #: Starts the trace of an attempt (``IDEMPOTENCY_OPENTELEMETRY``); None: nothing traced,
    #: and an attempt costs one attribute test.
    tracer: t.Callable[[Attempt], Trace] | None = None

    #: Endpoints whose view guard was entered under the outer guard's claim (logged once).
    guards_not_found: set[str] = dataclasses.field(default_factory=set)

    @classmethod
    def current(cls) -> AppState:
        """The state of ``current_app`` (for hooks, the CLI, the blueprint and reconcilers)."""
        return t.cast(AppState, current_app.extensions[EXTENSION_NAME])


def current_attempt() -> Attempt | None:
    """The attempt of this context (on ``flask.g``), or None. For the modules below
    :mod:`flask_idem.attempt`, which look at it without importing it."""
    # The proxy's object once (not a proxied g.get()): a request looks its attempt up often.
    attempt: Attempt | None = g._get_current_object().__dict__.get(ATTEMPT_SLOT)
    return attempt
