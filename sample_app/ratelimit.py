"""Rate limiting per API key with Flask-Limiter, counted in the app's database.

Flask-Limiter's ``memory://`` storage counts per process, so under ``gunicorn -w N`` every
worker would grant the full limit. :class:`SQLStorage` keeps fixed-window counters in the table
``rate_limit_counters`` instead, updated by one atomic upsert, so every worker shares them
(PostgreSQL or SQLite alike).

The limit is an *application* limit restricted to POST: Flask-Limiter checks those in its
``before_request`` hook, which runs before the idempotency claim, whereas ``@limiter.limit``
decorators are checked inside the view, after the claim.

The counters live in the database the claim needs. When PostgreSQL does not answer them at all
(frozen, gone), the request is answered 503 ``store-unavailable`` at once, as the claim would
have answered it: going on to the claim would add the claim's own wait (the store's 5 s) to
the counters', past the bound the store promises. An error the server did answer (a lock or
statement timeout on a busy counter) lets the request go on unlimited, as does the breaker.
"""

from __future__ import annotations

import contextlib
import math
import time
import typing as t

import sqlalchemy as sa
from flask import Flask, Response, g, has_request_context
from flask_limiter import ApplicationLimit, Limiter, RequestLimit
from limits.storage import Storage

from flask_idem.core.problem import StoreUnavailableProblem
from flask_idem.store import create_engine

from . import problems
from .auth import current_api_key_id
from .models import dialect_insert, rate_limit_counters

table = rate_limit_counters
#: Seconds the counters are skipped after the database failed under them.
BREAKER_SECONDS = 5.0


class SQLStorage(Storage):
    """A ``limits`` storage for the fixed-window strategy on a SQL database.

    Registered for the ``sample-sql://`` scheme; the database comes from the ``url`` option.
    Times are this host's clock (``time.time()``): workers of one host share it.
    """

    STORAGE_SCHEME = ["sample-sql"]

    def __init__(
        self, uri: str | None = None, wrap_exceptions: bool = False, *, url: str, **options: t.Any
    ) -> None:
        super().__init__(uri, wrap_exceptions=wrap_exceptions, **options)
        # Checked on checkout: an external service must survive a database restart. Short
        # timeouts and a breaker: the counters come before the claim, so a silent database
        # must cost little here (the claim then answers 503 within its own bound).
        self.engine = create_engine(
            url, pool_pre_ping=True, statement_timeout=0.5, connect_timeout=1
        )
        self._skip_until = 0.0

    @contextlib.contextmanager
    def _guarded(self) -> t.Iterator[None]:
        """After a failure, skip the database for a few seconds (requests go unlimited); a
        server that did not answer also refuses the current request (:func:`refuse_unanswered`)."""
        if time.monotonic() < self._skip_until:
            raise sa.exc.DisconnectionError("rate-limit counters skipped after a failure")
        try:
            yield
        except sa.exc.SQLAlchemyError as exc:
            self._skip_until = time.monotonic() + BREAKER_SECONDS
            if has_request_context() and self._unanswered(exc):
                g.database_unanswered = True
            raise

    def _unanswered(self, exc: sa.exc.SQLAlchemyError) -> bool:
        """PostgreSQL never answered: no connection, or one the client-side deadline cut
        (a server error carries its SQLSTATE). SQLite is a local file: a lock is no outage."""
        return (
            self.engine.dialect.name == "postgresql"
            and isinstance(exc, sa.exc.DBAPIError)
            and (exc.connection_invalidated or getattr(exc.orig, "pgcode", None) is None)
        )

    @property
    def base_exceptions(self) -> type[Exception] | tuple[type[Exception], ...]:
        return sa.exc.SQLAlchemyError

    def incr(self, key: str, expiry: int, amount: int = 1) -> int:
        now = time.time()
        insert = dialect_insert(self.engine, table).values(
            key=key, count=amount, expires_at=now + expiry
        )
        # One statement: a new window starts when the stored one has expired, so two workers
        # can never both start one (the row lock / SQLite's write lock orders them).
        expired = table.c.expires_at <= now
        upsert = insert.on_conflict_do_update(
            index_elements=[table.c.key],
            set_={
                "count": sa.case((expired, amount), else_=table.c.count + amount),
                "expires_at": sa.case((expired, now + expiry), else_=table.c.expires_at),
            },
        ).returning(table.c.count)
        with self._guarded(), self.engine.begin() as conn:
            return int(conn.execute(upsert).scalar_one())

    def get(self, key: str) -> int:
        query = sa.select(table.c.count).where(table.c.key == key, table.c.expires_at > time.time())
        with self._guarded(), self.engine.connect() as conn:
            return int(conn.execute(query).scalar() or 0)

    def get_expiry(self, key: str) -> float:
        query = sa.select(table.c.expires_at).where(table.c.key == key)
        with self._guarded(), self.engine.connect() as conn:
            expires_at = conn.execute(query).scalar()
        return float(expires_at) if expires_at is not None else time.time()

    def check(self) -> bool:
        try:
            with self._guarded(), self.engine.connect() as conn:
                conn.execute(sa.select(1))
        except sa.exc.SQLAlchemyError:
            return False
        return True

    def reset(self) -> int | None:
        with self.engine.begin() as conn:
            return conn.execute(table.delete()).rowcount

    def clear(self, key: str) -> None:
        with self.engine.begin() as conn:
            conn.execute(table.delete().where(table.c.key == key))


def _too_many_requests(limit: RequestLimit) -> Response:
    retry_after = max(1, math.ceil(limit.window.reset_time - time.time()))
    # Problem builds the application's response class, which Flask-Limiter requires.
    return t.cast(Response, problems.rate_limited(retry_after).get_response())


def refuse_unanswered() -> Response | None:
    """``before_request`` hook after the limiter's: 503 when its counters found the database
    silent, before the claim waits for it again."""
    if not g.get("database_unanswered"):
        return None
    return StoreUnavailableProblem(
        "The database cannot be reached; the request was not run. Retry later with the same "
        "idempotency key."
    ).get_response()


def init_app(app: Flask, url: str) -> None:
    """Limit POST requests per API key to ``SAMPLE_RATE_LIMIT``, shared across workers.

    Call after registering authentication (the limit is per API key) and before the
    idempotency extension (a 429 must come before the claim, so it is never stored).
    """
    limiter = Limiter(
        current_api_key_id,
        application_limits=[
            ApplicationLimit(app.config["SAMPLE_RATE_LIMIT"], scope="post", methods=["POST"])
        ],
        storage_uri="sample-sql://",
        storage_options={"url": url},
        strategy="fixed-window",
        on_breach=_too_many_requests,
        # A broken counter store must not turn into a 500: the request goes on unlimited, and
        # the idempotency claim then answers 503 if the database is really down.
        swallow_errors=True,
    )
    limiter.init_app(app)
    app.before_request(refuse_unanswered)
