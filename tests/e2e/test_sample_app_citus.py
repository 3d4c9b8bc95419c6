"""The sample app's HTTP contract (``tests/e2e/test_sample_app.py``) once on Citus.

Every contract test on the ``main`` or ``slow`` server (an in-flight duplicate, a worker killed
with -9 mid-request) runs again here, against a sample app whose database is the Citus
coordinator: migrated with ``make migrate``, then distributed
with :func:`flask_idem.store.citus.distribute` (the app's own tables stay local on the coordinator).
"""

from __future__ import annotations

import inspect
import typing as t

import pytest

from flask_idem.store import citus, create_engine
from tests.e2e import test_sample_app as contract
from tests.support.citus_cluster import CitusCluster
from tests.support.sample_server import SampleServer, migrate, spelled

pytestmark = pytest.mark.postgresql


def _distributed(citus_server: CitusCluster, name: str, spelling: str) -> str:
    """A new database on the cluster, migrated as the sample app is, then distributed."""
    url = spelled(citus_server.create_database(name), spelling)
    migrate(url)
    engine = create_engine(url)
    try:
        citus.distribute(engine)
    finally:
        engine.dispose()
    return url


@pytest.fixture(scope="module")
def main(
    citus_server: CitusCluster, tmp_path_factory: pytest.TempPathFactory
) -> t.Iterator[SampleServer]:
    """The contract's ``main`` server, on the coordinator."""
    server = SampleServer(
        _distributed(citus_server, "flask_idem_sample", "postgresql+psycopg2"),
        tmp_path_factory.mktemp("citus-main"),
        threads=4,
        FLASK_IDEMPOTENCY_TTL=str(contract.TTL),
    )
    yield server
    server.stop()


@pytest.fixture(scope="module")
def slow(
    citus_server: CitusCluster, tmp_path_factory: pytest.TempPathFactory
) -> t.Iterator[SampleServer]:
    """The contract's ``slow`` server (in-flight duplicates, a worker killed with -9)."""
    server = SampleServer(
        _distributed(citus_server, "flask_idem_sample_slow", "postgresql"),
        tmp_path_factory.mktemp("citus-slow"),
        SAMPLE_PROVIDER_LATENCY_MS=str(contract.SLOW_LATENCY_MS),
        FLASK_IDEMPOTENCY_LEASE=str(contract.LEASE),
    )
    yield server
    server.stop()


#: Contract tests whose own SQL Citus refuses (not the app's): this one moves a record a day
#: back with ``created_at - interval '1 day'``, a STABLE operator on a column in an UPDATE.
REFUSED_BY_CITUS = {"test_records_are_partitioned_and_deduplicate_across_partitions"}


def _on_citus(name: str, test: t.Callable[..., t.Any]) -> bool:
    """Its servers are the ones above (the rate limiter's is not about the store)."""
    parameters = set(inspect.signature(test).parameters)
    return (
        bool({"main", "slow"} & parameters)
        and "limited" not in parameters
        and (name not in REFUSED_BY_CITUS)
    )


globals().update(
    {
        name: test
        for name, test in vars(contract).items()
        if name.startswith("test_") and callable(test) and _on_citus(name, test)
    }
)
