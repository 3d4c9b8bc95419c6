"""``alembic upgrade head`` installs, on PostgreSQL, exactly the functions the store's code
expects (flask_idem/store/expected_functions.py), and the comparison sees any change to them."""

from __future__ import annotations

import typing as t

import pytest
import sqlalchemy as sa

from flask_idem.ops.migrate import upgrade
from flask_idem.store import create_engine
from flask_idem.store.expected_functions import EXPECTED_FUNCTIONS, drift, installed_digests

# Every function of the database outside the system schemas that no extension brought: on a
# fresh database, what the migrations installed.
_INSTALLED = sa.text(
    "SELECT p.oid::regprocedure::text FROM pg_proc AS p "
    "JOIN pg_namespace AS n ON n.oid = p.pronamespace "
    "WHERE n.nspname NOT IN ('pg_catalog', 'information_schema') AND NOT EXISTS ("
    "SELECT 1 FROM pg_depend AS d WHERE d.classid = 'pg_proc'::regclass "
    "AND d.objid = p.oid AND d.deptype = 'e')"
)

#: A function's text as the driver's statement (its '%' are not parameter markers).
VERBATIM = {"no_parameters": True}


def _signature(name: str) -> str:
    (function,) = (f for f in EXPECTED_FUNCTIONS if f.signature.startswith(f"{name}("))
    return function.signature


@pytest.fixture
def head_engine(fresh_pg_database: t.Callable[[], str]) -> t.Iterator[sa.Engine]:
    url = fresh_pg_database()
    upgrade(url)
    engine = create_engine(url)
    yield engine
    engine.dispose()


@pytest.mark.parametrize("granularity", ["day", "month"])
def test_head_installs_exactly_the_functions_the_store_expects(
    fresh_pg_database: t.Callable[[], str], monkeypatch: pytest.MonkeyPatch, granularity: str
) -> None:
    """Guards the store against a migration that adds, drops or changes a function without
    its expectation being updated: the set and every normalized definition must match, on
    partitions of any granularity (one digest holds for all)."""
    monkeypatch.setenv("IDEMPOTENCY_PARTITION_GRANULARITY", granularity)
    url = fresh_pg_database()
    upgrade(url)
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            installed = set(conn.execute(_INSTALLED).scalars())
            digests = installed_digests(conn)
    finally:
        engine.dispose()
    expected = {function.signature for function in EXPECTED_FUNCTIONS}
    assert len(expected) == len(EXPECTED_FUNCTIONS), "one entry per function"
    assert installed == expected, "head installs other functions than EXPECTED_FUNCTIONS lists"
    wrong = {f.signature: digest for f, digest in digests.items() if digest != f.digest}
    assert not wrong, (
        "the migrations install these functions otherwise than the store expects; if a new "
        "revision changed them on purpose, check the store's calls, then set their digests in "
        f"flask_idem/store/expected_functions.py to: {wrong}"
    )


def test_drift_sees_one_changed_character_a_changed_attribute_and_a_missing_function(
    head_engine: sa.Engine,
) -> None:
    """Guards the digest's reach: a body edited by one character, an attribute outside the
    body (SECURITY DEFINER) and a dropped function are each reported, and nothing else is."""
    reserve, drop, audit = (
        _signature(name)
        for name in (
            "idempotency_claim_reserve",
            "idempotency_drop_expired_partitions",
            "idempotency_audit_partitions",
        )
    )
    with head_engine.begin() as conn:
        assert drift(conn) == {}
        definition = conn.execute(
            sa.text("SELECT pg_get_functiondef(to_regprocedure(:f))"), {"f": reserve}
        ).scalar_one()
        assert definition.count("'4s'") == 2
        conn.exec_driver_sql(definition.replace("'4s'", "'5s'", 1), execution_options=VERBATIM)
        conn.exec_driver_sql(f"ALTER FUNCTION {drop} SECURITY DEFINER")
        conn.exec_driver_sql(f"DROP FUNCTION {audit}")
        found = {function.signature: how for function, how in drift(conn).items()}
    assert found == {reserve: "changed", drop: "changed", audit: "missing"}
