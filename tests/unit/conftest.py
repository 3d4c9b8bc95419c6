"""The unit tier needs no database and no server: ``make test-unit`` runs it where PostgreSQL
is missing (a test may fork itself, as the deadline watchdog's does, never start a program). A
test here that asks for a database fails, saying where it belongs, instead of starting a
cluster."""

from __future__ import annotations

import pytest


def _no_database() -> None:
    pytest.fail(
        "a test in tests/unit asked for a database: move it to tests/store (store primitives) "
        "or tests/flask (the extension through the test client)",
        pytrace=False,
    )


@pytest.fixture(scope="session")
def pg_server_url() -> None:
    """Refused here: the unit tier runs without PostgreSQL."""
    _no_database()


@pytest.fixture(scope="session")
def sqlite_url() -> None:
    """Refused here: the unit tier touches no database file either."""
    _no_database()
