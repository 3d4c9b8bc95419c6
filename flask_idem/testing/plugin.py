"""pytest plugin of flask_idem (entry point ``pytest11``; loaded once flask-idem is installed).

Fixtures:

``idem_database_url``
    A migrated, empty database for flask_idem, emptied again after the test:
    ``IDEMPOTENCY_TEST_DATABASE_URL`` when set, else a SQLite file in the test's temporary
    directory. An application configured with it alone (``IDEMPOTENCY_DATABASE_URL``) is
    ready to serve. Override it in a ``conftest.py`` to point at the test suite's own
    PostgreSQL (an override is migrated by ``idem_store``, not by itself).
``idem_store``
    A migrated, empty store on that database (:func:`flask_idem.testing.ready_store`), for
    ``Idempotency(app, store=idem_store)``.
"""

from __future__ import annotations

import os
import typing as t
from pathlib import Path

import pytest

from ..store import SQLStore
from . import ready_store

#: Environment variable naming the database of ``idem_store`` (PostgreSQL or SQLite).
DATABASE_URL_VARIABLE = "IDEMPOTENCY_TEST_DATABASE_URL"


@pytest.fixture
def idem_database_url(tmp_path: Path) -> t.Iterator[str]:
    """A migrated, empty database for flask_idem (its tables are emptied again afterwards)."""
    url = os.environ.get(DATABASE_URL_VARIABLE) or f"sqlite:///{tmp_path}/flask-idem.sqlite3"
    with ready_store(url):
        yield url


@pytest.fixture
def idem_store(idem_database_url: str) -> t.Iterator[SQLStore]:
    """A migrated, empty flask_idem store, emptied again after the test.

    It migrates the database itself (a no-op at head), for an override of
    ``idem_database_url`` that returns a URL as it is.
    """
    with ready_store(idem_database_url) as store:
        yield store
