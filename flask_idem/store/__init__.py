"""Stores: where claims, leases and response snapshots live."""

from __future__ import annotations

import typing as t

import sqlalchemy as sa

from ..core.errors import ConfigurationError
from . import engines, pooler
from .base import OperatorStore, RequestStore, Store, operator_store
from .commit_count import Tally, resynchronise
from .engines import OneDeadline
from .messages import redacted
from .postgresql import PostgresStore
from .sql import SQLStore, translate_errors
from .sqlite import SQLiteStore

# What the layers above use of the store: the interfaces and stores, and the few services a
# request needs around them (errors as StoreUnavailable, redacted database errors, one
# deadline for a checkout and a claim, the count of an attempt's commits below SQLAlchemy).
__all__ = [
    "resynchronise",
    "OneDeadline",
    "OperatorStore",
    "PostgresStore",
    "RequestStore",
    "SQLStore",
    "SQLiteStore",
    "Store",
    "Tally",
    "create_engine",
    "create_store",
    "engine_options",
    "operator_store",
    "prepare_engine",
    "redacted",
    "translate_errors",
]

_STORES: dict[str, type[SQLStore]] = {
    PostgresStore.dialect: PostgresStore,
    SQLiteStore.dialect: SQLiteStore,
}


def normalize_url(url: str | sa.URL) -> sa.URL:
    """Pin PostgreSQL URLs to psycopg2, whatever spelling they come in.

    SQLAlchemy 2.1 maps a bare ``postgresql://`` to psycopg 3, which is not a dependency, and
    PaaS providers still hand out ``postgres://``.
    """
    parsed = sa.make_url(url)
    if parsed.drivername in ("postgres", "postgresql"):
        parsed = parsed.set(drivername="postgresql+psycopg2")
    return parsed


#: libpq settings that turn a dead or silent database into an error within seconds, so that a
#: request fails closed with 503 instead of hanging a worker (see :mod:`.engines` for the
#: statement deadline a frozen server needs on top of these).
PG_CONNECT_ARGS: dict[str, int] = {
    "connect_timeout": engines.CONNECT_TIMEOUT,
    "keepalives": 1,
    "keepalives_idle": 10,
    "keepalives_interval": 3,
    "keepalives_count": 3,
    "tcp_user_timeout": 15_000,
}


def engine_options(
    url: str | sa.URL,
    *,
    statement_timeout: float | None = engines.STATEMENT_TIMEOUT,
    connect_timeout: int = engines.CONNECT_TIMEOUT,
) -> dict[str, t.Any]:
    """The :func:`sqlalchemy.create_engine` arguments the store relies on, for engines built
    elsewhere: Flask-SQLAlchemy's ``SQLALCHEMY_ENGINE_OPTIONS`` with ``Idempotency(db=db)``.

    Statement parameters are hidden from error messages and logs (they carry idempotency keys,
    claim tokens and response bodies); on PostgreSQL sessions use READ COMMITTED, statement
    and lock timeouts and the client-side deadline (:mod:`flask_idem.store.engines`).

    :param statement_timeout: seconds a statement may run or wait for a lock (PostgreSQL
        ``statement_timeout`` and ``lock_timeout``, a client-side deadline one second later
        for a silent server; the SQLite busy timeout); None for no bound (migrations).
    :param connect_timeout: seconds to open a PostgreSQL connection.
    """
    if statement_timeout is not None and not 0 < statement_timeout < 86400:
        raise ConfigurationError("statement_timeout must be between 0 and 86400 seconds")
    if normalize_url(url).get_backend_name() == "sqlite":
        # Threads of one server share the file; SQLite's own locking serialises the writers,
        # each waiting at most ``timeout`` for a lock (then "database is locked": 503).
        sqlite_args = {"check_same_thread": False, "timeout": statement_timeout or 60.0}
        return {"connect_args": sqlite_args, "hide_parameters": True}
    connect_args: dict[str, t.Any] = {**PG_CONNECT_ARGS, "connect_timeout": connect_timeout}
    # The claim functions refuse any other isolation (their lookup must see the record the
    # previous lock holder committed): whatever the database's or role's default, our
    # sessions use READ COMMITTED.
    session = [pooler.startup_option(), "-c default_transaction_isolation=read\\ committed"]
    if statement_timeout is not None:
        milliseconds = int(statement_timeout * 1000)
        session += [f"-c statement_timeout={milliseconds}", f"-c lock_timeout={milliseconds}"]
        deadline = statement_timeout + engines.DEADLINE_GRACE
        if normalize_url(url).get_driver_name() == "psycopg":
            from . import deadline_psycopg

            # Not a psycopg argument: the engine's connect (:mod:`.pooler`) takes it out.
            connect_args[pooler.CONNECTION_CLASS] = deadline_psycopg.connection_class(deadline)
        else:
            connect_args["connection_factory"] = engines.connection_factory(deadline)
    connect_args["options"] = " ".join(session)
    return {
        "pool_size": 10,
        "max_overflow": 20,
        "pool_timeout": 5,
        "connect_args": connect_args,
        "hide_parameters": True,
    }


def prepare_engine(engine: sa.Engine) -> sa.Engine:
    """Make an engine safe for the store: fork-safe pools, and on PostgreSQL sessions that keep
    statement texts out of the server log, also behind a transaction pooler (:mod:`.pooler`:
    an engine built elsewhere gets only the start-up marker that tells its pooled sessions
    apart). Idempotent; applied to every store's engine."""
    if engine.dialect.name == "postgresql":
        pooler.connect_without_refused_options(engine)
        if not sa.event.contains(engine, "connect", engines.quiet_server_log):
            sa.event.listen(engine, "connect", engines.quiet_server_log)
            sa.event.listen(engine, "connect", engines.remember_citus)
            sa.event.listen(engine, "connect", engines.end_of_setup)  # after the setup's
    engines.make_fork_safe(engine)
    return engine


def create_engine(
    url: str | sa.URL,
    *,
    statement_timeout: float | None = engines.STATEMENT_TIMEOUT,
    connect_timeout: int = engines.CONNECT_TIMEOUT,
    **options: t.Any,
) -> sa.Engine:
    """An engine with the pool and connection settings the store relies on (see
    :func:`engine_options`), fork-safe and quiet in the server log (:func:`prepare_engine`).

    :param options: more :func:`sqlalchemy.create_engine` arguments (e.g. ``pool_pre_ping``).
    """
    arguments = engine_options(
        url, statement_timeout=statement_timeout, connect_timeout=connect_timeout
    )
    return prepare_engine(sa.create_engine(normalize_url(url), **{**arguments, **options}))


def create_store(target: str | sa.URL | sa.Engine) -> SQLStore:
    """Build the store matching a database URL or an existing engine."""
    engine = target if isinstance(target, sa.Engine) else create_engine(target)
    # Also an engine the application built: a forked worker must never reuse its pool, and
    # the server log must never get the store's statements.
    prepare_engine(engine)
    try:
        store_class = _STORES[engine.dialect.name]
    except KeyError:
        raise ConfigurationError(
            f"flask_idem has no store for {engine.dialect.name!r}; use PostgreSQL or SQLite"
        ) from None
    return store_class(engine)
