"""The sample app's HTTP contract (``tests/test_sample_app.py``) once on Citus.

Every contract test that needs only the ``main`` server runs again here, against a sample app
whose database is the Citus coordinator: migrated with ``make migrate``, then distributed
with :func:`flask_idem.citus.distribute` (the app's own tables stay local on the coordinator).
"""

from __future__ import annotations

import inspect
import typing as t

import pytest

from flask_idem import citus
from flask_idem.store import create_engine

from . import test_sample_app as contract
from .citus_cluster import CitusCluster
from .sample_server import SampleServer, migrate, spelled

pytestmark = pytest.mark.postgresql


@pytest.fixture(scope="module")
def main(
    citus_server: CitusCluster, tmp_path_factory: pytest.TempPathFactory
) -> t.Iterator[SampleServer]:
    """The contract's ``main`` server, on the coordinator."""
    url = spelled(citus_server.create_database("flask_idem_sample"), "postgresql+psycopg2")
    migrate(url)
    engine = create_engine(url)
    try:
        citus.distribute(engine)
    finally:
        engine.dispose()
    server = SampleServer(
        url,
        tmp_path_factory.mktemp("citus-main"),
        threads=4,
        FLASK_IDEMPOTENCY_TTL=str(contract.TTL),
    )
    yield server
    server.stop()


#: Contract tests whose own SQL Citus refuses (not the app's): this one moves a record a day
#: back with ``created_at - interval '1 day'``, a STABLE operator on a column in an UPDATE.
REFUSED_BY_CITUS = {"test_records_are_partitioned_and_deduplicate_across_partitions"}


def _on_main_only(name: str, test: t.Callable[..., t.Any]) -> bool:
    parameters = inspect.signature(test).parameters
    return (
        "main" in parameters
        and not {"slow", "limited"} & set(parameters)
        and name not in REFUSED_BY_CITUS
    )


globals().update(
    {
        name: test
        for name, test in vars(contract).items()
        if name.startswith("test_") and callable(test) and _on_main_only(name, test)
    }
)
