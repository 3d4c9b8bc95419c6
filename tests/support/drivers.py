"""Running a test module on both PostgreSQL drivers, psycopg2 (the default) and psycopg 3.

Importing ``pg_url_on_each_driver`` (or ``db_url_on_each_driver``) into a test module overrides
its ``pg_url`` (``db_url``) there only, so the rest of the suite does not run twice."""

from __future__ import annotations

import types
import typing as t

import pytest
import sqlalchemy as sa

#: The PostgreSQL drivers flask_idem supports; psycopg2 is the default.
PG_DRIVERS = ("postgresql+psycopg2", "postgresql+psycopg")


def spelled_for(url: str, driver: str) -> str:
    return sa.make_url(url).set(drivername=driver).render_as_string(hide_password=False)


@pytest.fixture(name="pg_url", params=PG_DRIVERS, ids=["psycopg2", "psycopg"])
def pg_url_on_each_driver(request: pytest.FixtureRequest, pg_url: str) -> str:
    """conftest's migrated database, through each driver."""
    return spelled_for(pg_url, request.param)


@pytest.fixture(
    name="db_url", params=[*PG_DRIVERS, "sqlite"], ids=["postgresql", "psycopg", "sqlite"]
)
def db_url_on_each_driver(request: pytest.FixtureRequest, pg_url: str, sqlite_url: str) -> str:
    """conftest's ``db_url`` with PostgreSQL through each driver."""
    return sqlite_url if request.param == "sqlite" else spelled_for(pg_url, request.param)


def driver_of(url: str) -> types.ModuleType:
    """The driver module ``url`` connects with (its errors, its cursor class)."""
    if sa.make_url(url).get_driver_name() == "psycopg":
        import psycopg
        import psycopg.errors

        return psycopg
    import psycopg2.errors
    import psycopg2.extensions

    return psycopg2


def cursor_class(url: str) -> type[t.Any]:
    """The driver's plain cursor class, to subclass for a ``cursor_factory``."""
    driver = driver_of(url)
    return t.cast(type, driver.Cursor if driver.__name__ == "psycopg" else driver.extensions.cursor)


def is_idle(dbapi_connection: t.Any) -> bool:
    """Whether a driver connection is outside any transaction."""
    info = getattr(dbapi_connection, "info", None)
    if hasattr(info, "transaction_status"):
        import psycopg.pq

        return bool(info.transaction_status == psycopg.pq.TransactionStatus.IDLE)
    import psycopg2.extensions

    return bool(dbapi_connection.status == psycopg2.extensions.STATUS_READY)
