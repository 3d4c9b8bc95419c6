"""Stores: where claims, leases and response snapshots live."""

from __future__ import annotations

import typing as t

import sqlalchemy as sa

from ..errors import ConfigurationError
from .base import Store
from .postgresql import PostgresStore
from .sql import SQLStore
from .sqlite import SQLiteStore

__all__ = ["PostgresStore", "SQLStore", "SQLiteStore", "Store", "create_engine", "create_store"]

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
#: request fails closed with 503 instead of hanging a worker.
PG_CONNECT_ARGS: dict[str, int] = {
    "connect_timeout": 5,
    "keepalives": 1,
    "keepalives_idle": 10,
    "keepalives_interval": 3,
    "keepalives_count": 3,
    "tcp_user_timeout": 15_000,
}


def create_engine(url: str | sa.URL, **options: t.Any) -> sa.Engine:
    """An engine with the pool and connection settings the store relies on.

    Statement parameters are hidden from error messages and logs: they carry idempotency keys,
    claim tokens and response bodies.

    :param options: more :func:`sqlalchemy.create_engine` arguments (e.g. ``pool_pre_ping``).
    """
    parsed = normalize_url(url)
    if parsed.get_backend_name() == "sqlite":
        # Threads of one server share the file; SQLite's own locking serialises the writers.
        return sa.create_engine(
            parsed, connect_args={"check_same_thread": False}, hide_parameters=True, **options
        )
    return sa.create_engine(
        parsed,
        pool_size=10,
        max_overflow=20,
        pool_timeout=5,
        connect_args=PG_CONNECT_ARGS,
        hide_parameters=True,
        **options,
    )


def create_store(target: str | sa.URL | sa.Engine) -> SQLStore:
    """Build the store matching a database URL or an existing engine."""
    engine = target if isinstance(target, sa.Engine) else create_engine(target)
    try:
        store_class = _STORES[engine.dialect.name]
    except KeyError:
        raise ConfigurationError(
            f"flask_idem has no store for {engine.dialect.name!r}; use PostgreSQL or SQLite"
        ) from None
    return store_class(engine)
