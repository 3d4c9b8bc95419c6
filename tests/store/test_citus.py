"""Citus compatibility, guarded on plain PostgreSQL, and ``flask idem citus``.

Citus has no package on CI machines, so the rules its planner applies to a distributed table
are checked on the statements the PostgreSQL store really sends (captured at the driver while
every primitive runs):

- a ``RETURNING`` returns stored columns only: Citus refuses any non-IMMUTABLE function there
  ("non-IMMUTABLE functions are not allowed in the RETURNING clause"), ``now()`` included;
- in the ``WHERE`` and ``SET`` of an ``UPDATE``/``DELETE``, no VOLATILE function, and no
  STABLE function or operator applied to a column ("STABLE functions used in UPDATE queries
  cannot be called with column references"): Citus evaluates ``now()`` and other column-free
  expressions on the coordinator, and what remains must be immutable. PostgreSQL itself judges
  that, as it judges an index predicate;
- every statement on the table is a single-tenant query, its ``WHERE`` opening with the
  ``tenant`` equality (Citus routes it to one shard), except the operators' cross-tenant
  listing and maintenance, which are not on the request path.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import functools
import hashlib
import json
import re
import typing as t

import flask
import pytest
import sqlalchemy as sa

from flask_idem import Idempotency, Scope, StoredResponse
from flask_idem.core.idempotency_keys import key_hash
from flask_idem.store import SQLStore, Store, citus, create_engine, create_store
from flask_idem.store.citus import Step
from tests.support.helpers import Counter, shift

Factory = t.Callable[..., tuple[flask.Flask, Idempotency, Counter]]

FP = hashlib.sha256(b"request").digest()
RESPONSE = StoredResponse(201, (("Content-Type", "application/json"),), b'{"id":1}')
TABLE = "idempotency_keys"
#: Statements allowed to span tenants: none of them runs while serving a request.
CROSS_TENANT = {
    "stuck": "operators' listing",
    "maintain": "partition upkeep",
    "created_between": "the next-day audit",
    "health": "the metrics gauges, read at scrape time",
    "key_usage": "flask idem keys",
}


#: Every store primitive: the abstract ones, and the reserved record's completion.
PRIMITIVES = {*Store.__abstractmethods__, "complete_reserved", "find_hashed", "history_hashed"}


class Captured(t.NamedTuple):
    primitive: str
    sql: str


@contextlib.contextmanager
def capture_primitives(store: SQLStore) -> t.Iterator[tuple[list[Captured], set[str]]]:
    """Every statement sent while a store primitive runs, tagged with that primitive."""
    seen: list[Captured] = []
    called: set[str] = set()
    running: list[str] = []

    def wrap(name: str) -> None:
        original = getattr(store, name)

        @functools.wraps(original)
        def wrapper(*args: t.Any, **kwargs: t.Any) -> t.Any:
            called.add(name)
            running.append(name)
            try:
                return original(*args, **kwargs)
            finally:
                running.pop()

        setattr(store, name, wrapper)

    def record(_conn: t.Any, _cursor: t.Any, statement: str, *_args: t.Any) -> None:
        if running:
            seen.append(Captured(running[0], statement))

    for name in PRIMITIVES:
        wrap(name)
    sa.event.listen(store.engine, "before_cursor_execute", record)
    try:
        yield seen, called
    finally:
        sa.event.remove(store.engine, "before_cursor_execute", record)
        for name in PRIMITIVES:
            del store.__dict__[name]


def exercise(store: SQLStore) -> None:
    """Every primitive, on every path that builds a different statement."""
    a, b, c, d = (Scope("tenant-a", "POST /p", f"k{n}") for n in range(4))
    first = store.claim(a, FP, ttl=600, lease=30)
    store.claim(a, FP, ttl=600, lease=30)
    store.renew(a, first.token, lease=30)
    store.renew(a, first.token, lease=30, created_at=first.record.created_at)
    store.get(a)
    store.find("tenant-a", "k0")
    store.find("tenant-a", "k0", endpoint="POST /p")
    store.find_hashed("tenant-a", key_hash(a), endpoint="POST /p")
    shift(store, a, 31, "lease_expires_at")
    store.stuck()
    takeover = store.take_over(a, first.token, lease=30)
    assert takeover is not None
    store.complete(a, takeover.token, RESPONSE, created_at=first.record.created_at)
    store.release(b, store.claim(b, FP, ttl=600, lease=30).token)
    token = store.claim(c, FP, ttl=600, lease=30).token
    store.mark_unknown(c, token)
    assert store.resolve(c, RESPONSE, token=token)
    token = store.claim(b, FP, ttl=600, lease=30).token
    store.mark_unknown(b, token)
    assert store.reopen(b, token=token)
    atomic = store.begin()
    try:
        claimed = store.claim_atomic(atomic, Scope("tenant-a", "POST /p", "atomic"), FP, ttl=600)
        assert claimed is not None and claimed.claimed
        if claimed.reservation is not None:
            assert claimed.reservation.complete(RESPONSE)
        else:
            store.complete(claimed.record.scope, claimed.token, RESPONSE, connection=atomic)
        atomic.commit()
    finally:
        atomic.close()
    token = store.claim(d, FP, ttl=600, lease=30).token
    connection = store.begin()
    try:
        store.complete(d, token, None, connection=connection)
        connection.commit()
    finally:
        connection.close()
    day = first.record.created_at
    assert store.created_between(day, day + dt.timedelta(days=1), endpoints=["POST /p"])
    store.history("tenant-a", "k0")
    store.history_hashed("tenant-a", key_hash(a))
    store.health()
    store.key_usage()
    store.evict(a)
    store.maintain(ahead=7, dry_run=True)


@pytest.fixture(scope="module")
def pg_statements(pg_url: str) -> list[Captured]:
    """What the PostgreSQL store sends, for the whole contract above."""

    store = create_store(pg_url)
    try:
        with store.engine.begin() as conn:
            conn.exec_driver_sql(f"TRUNCATE {TABLE}")
        with capture_primitives(store) as (seen, called):
            exercise(store)
        missing = set(Store.__abstractmethods__) - called
        assert not missing, f"add these primitives to exercise(): {sorted(missing)}"
        with store.engine.begin() as conn:
            conn.exec_driver_sql(f"TRUNCATE {TABLE}")
    finally:
        store.engine.dispose()
    return seen


# -- reading SQLAlchemy's compiled PostgreSQL statements ---------------------------------------


def _split_top(text: str, separator: str = ",") -> list[str]:
    """Split at ``separator`` outside parentheses and string literals."""
    parts, depth, quoted, current = [], 0, False, []
    for char in text:
        if char == "'":
            quoted = not quoted
        elif not quoted and char == "(":
            depth += 1
        elif not quoted and char == ")":
            depth -= 1
        if char == separator and depth == 0 and not quoted:
            parts.append("".join(current).strip())
            current = []
        else:
            current.append(char)
    parts.append("".join(current).strip())
    return parts


def clauses(sql: str) -> dict[str, str]:
    """The SET, WHERE and RETURNING parts of an UPDATE or DELETE on the table."""
    text = " ".join(sql.split())
    returning = ""
    if " RETURNING " in text:
        text, returning = text.rsplit(" RETURNING ", 1)
    where = ""
    if " WHERE " in text:
        text, where = text.split(" WHERE ", 1)
    assignments = text.split(" SET ", 1)[1] if " SET " in text else ""
    return {"set": assignments, "where": where, "returning": returning}


def _columns(sql: str) -> set[str]:
    return set(re.findall(rf"\b{TABLE}\.(\w+)", sql))


def _coordinator_evaluated(expression: str) -> str:
    """The expression as a Citus worker receives it: the statement's parameters and the
    database clock (``now()`` or ``statement_timestamp()``, either ``+/- make_interval(...)``:
    STABLE functions of no column) evaluated on the coordinator."""
    expression = re.sub(r"%\(\w+\)s", "NULL", expression)
    clock = r"(now|statement_timestamp)\(\)(\s*[+-]\s*make_interval\([^()]*\))?"
    return re.sub(clock, "CAST('2026-01-01 00:00:00+00' AS TIMESTAMP WITH TIME ZONE)", expression)


def mutable(engine: sa.Engine, expression: str, *, predicate: bool) -> str | None:
    """PostgreSQL's verdict on ``expression``: None when immutable, else its error message.

    Asked as an index predicate (``predicate``) or index expression on a scratch copy of the
    table, in a transaction that is rolled back: PostgreSQL refuses both unless immutable.
    """
    index = f"(tenant) WHERE {expression}" if predicate else f"(({expression}))"
    with engine.connect() as conn:
        transaction = conn.begin()
        try:
            conn.exec_driver_sql(f"CREATE TEMP TABLE {TABLE} (LIKE public.{TABLE})")
            conn.exec_driver_sql(f"CREATE INDEX ON pg_temp.{TABLE} {index}")
        except sa.exc.DBAPIError as exc:
            return str(exc.orig).splitlines()[0]
        finally:
            transaction.rollback()
    return None


@functools.cache
def volatile_functions(url: str) -> frozenset[str]:
    """Every VOLATILE function name the server knows (clock_timestamp, random, ...)."""
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            names = conn.execute(sa.text("SELECT proname FROM pg_proc WHERE provolatile = 'v'"))
            return frozenset(names.scalars())
    finally:
        engine.dispose()


def citus_refusals(engine: sa.Engine, statement: Captured) -> list[str]:
    """Why Citus would refuse this statement on a table distributed by tenant (or [])."""
    sql = " ".join(statement.sql.split())
    kind = sql.split(" ", 1)[0].upper()
    if kind not in ("INSERT", "UPDATE", "DELETE"):
        return []
    found = []
    parts = clauses(sql)
    for item in _split_top(parts["returning"]) if parts["returning"] else []:
        if not re.fullmatch(rf"{TABLE}\.\w+( AS \w+)?", item):
            found.append(
                f"RETURNING {item!r} is not a stored column (Citus refuses non-IMMUTABLE "
                "functions there, now() included)"
            )
    if parts["where"]:
        verdict = mutable(engine, _coordinator_evaluated(parts["where"]), predicate=True)
        if verdict:
            found.append(f"WHERE: {verdict}")
    volatile = volatile_functions(engine.url.render_as_string(hide_password=False))
    for assignment in _split_top(parts["set"]) if parts["set"] else []:
        column, _, value = (part.strip() for part in assignment.partition("="))
        value = _coordinator_evaluated(value)
        called = set(re.findall(r"\b(\w+)\s*\(", value))
        if called & volatile:
            found.append(f"SET {column}: VOLATILE {', '.join(sorted(called & volatile))}")
        elif _columns(value) and (verdict := mutable(engine, value, predicate=False)):
            found.append(f"SET {column}: {verdict}")
    return found


def tenant_first(statement: Captured) -> bool:
    """The statement names one tenant before anything else (Citus routes it to one shard)."""
    sql = " ".join(statement.sql.split())
    if sql.startswith("SELECT * FROM idempotency_claim"):
        return re.match(r"SELECT \* FROM idempotency_claim(_\w+)?\(%\(tenant\)s,", sql) is not None
    if sql.startswith(f"INSERT INTO {TABLE} "):
        # One row, its tenant first: Citus routes it by the tenant it carries.
        return re.match(rf"INSERT INTO {TABLE} \(tenant, .*\) SELECT %\(\w+\)s ", sql) is not None
    parts = clauses(sql)
    return re.match(rf"\(?{TABLE}\.tenant = %\(\w+\)s", parts["where"]) is not None


# -- the guard ---------------------------------------------------------------------------------


def test_every_primitive_was_captured(pg_statements: list[Captured]) -> None:
    sent = {statement.primitive for statement in pg_statements}
    assert sent >= PRIMITIVES - {"begin"}, sent
    kinds = {" ".join(s.sql.split()).split(" ", 1)[0] for s in pg_statements}
    assert {"SELECT", "UPDATE", "DELETE"} <= kinds


def test_no_statement_citus_would_refuse(pg_url: str, pg_statements: list[Captured]) -> None:
    engine = create_engine(pg_url)
    try:
        refused = {
            f"{s.primitive}: {' '.join(s.sql.split())[:90]}...": reasons
            for s in pg_statements
            if (reasons := citus_refusals(engine, s))
        }
    finally:
        engine.dispose()
    assert not refused, json.dumps(refused, indent=2)


def test_request_path_statements_name_one_tenant_first(pg_statements: list[Captured]) -> None:
    on_the_table = [s for s in pg_statements if TABLE in s.sql or "idempotency_claim" in s.sql]
    assert on_the_table
    wide = [
        f"{s.primitive}: {' '.join(s.sql.split())[:120]}"
        for s in on_the_table
        if s.primitive not in CROSS_TENANT and not tenant_first(s)
    ]
    assert not wide, "\n".join(wide)


@pytest.mark.parametrize(
    ("sql", "refusal"),
    [
        (
            f"UPDATE {TABLE} SET claim_token=%(t)s WHERE {TABLE}.tenant = %(p)s "
            f"RETURNING {TABLE}.lease_expires_at, now() AS db_now",
            "RETURNING 'now() AS db_now'",
        ),
        (
            f"UPDATE {TABLE} SET claim_token=%(t)s WHERE {TABLE}.tenant = %(p)s "
            f"RETURNING {TABLE}.lease_expires_at - make_interval(0, 0, 0, 0, 0, 0, 30.0)",
            "RETURNING",
        ),
        (
            f"DELETE FROM {TABLE} WHERE {TABLE}.tenant = %(p)s AND {TABLE}.completed_at + "
            f"({TABLE}.expires_at - {TABLE}.created_at) > now()",
            "WHERE: functions in index predicate must be marked IMMUTABLE",
        ),
        (
            f"UPDATE {TABLE} SET lease_expires_at={TABLE}.lease_expires_at + "
            f"make_interval(0, 0, 0, 0, 0, 0, 30.0) WHERE {TABLE}.tenant = %(p)s",
            "SET lease_expires_at: functions in index expression must be marked IMMUTABLE",
        ),
        (
            f"UPDATE {TABLE} SET claim_token=md5(random()::text) WHERE {TABLE}.tenant = %(p)s",
            "SET claim_token: VOLATILE random",
        ),
    ],
)
def test_the_guard_catches_what_citus_refuses(pg_url: str, sql: str, refusal: str) -> None:
    engine = create_engine(pg_url)
    try:
        reasons = citus_refusals(engine, Captured("test", sql))
    finally:
        engine.dispose()
    assert any(reason.startswith(refusal) for reason in reasons), reasons


def test_the_guard_accepts_what_citus_evaluates_on_the_coordinator(pg_url: str) -> None:
    sql = (
        f"UPDATE {TABLE} SET lease_expires_at=(now() + make_interval(0, 0, 0, 0, 0, 0, 30.0)), "
        f"completed_at=now() WHERE {TABLE}.tenant = %(p)s AND {TABLE}.lease_expires_at <= now() "
        f"AND (CAST(%(c)s AS TIMESTAMP WITH TIME ZONE) IS NULL OR {TABLE}.created_at = %(c)s) "
        f"RETURNING {TABLE}.lease_expires_at"
    )
    engine = create_engine(pg_url)
    try:
        assert citus_refusals(engine, Captured("test", sql)) == []
    finally:
        engine.dispose()


def test_the_claim_function_returns_stored_columns_only(pg_store: SQLStore) -> None:
    """It runs on the worker, where Citus plans its statements against the local shard."""
    with pg_store.engine.connect() as conn:
        source = conn.execute(
            sa.text("SELECT prosrc FROM pg_proc WHERE proname = 'idempotency_claim'")
        ).scalar_one()
    returning = re.findall(r"RETURNING\s+([^)]*?)\)", source)
    assert returning and all(item.strip() == "*" for item in returning), returning
    assert "k.tenant = p_tenant" in source


def test_take_over_reads_the_clock_from_the_lease(store: SQLStore, scope: Scope) -> None:
    """No ``now()`` in its RETURNING, yet the record still carries the database clock."""
    token = store.claim(scope, FP, ttl=600, lease=30).token
    shift(store, scope, 31, "lease_expires_at")
    clock = "SELECT now()" if store.dialect == "postgresql" else "SELECT datetime('now')"
    with store.engine.connect() as conn:
        before = conn.execute(sa.text(clock)).scalar_one()
    takeover = store.take_over(scope, token, lease=12.345678)
    with store.engine.connect() as conn:
        after = conn.execute(sa.text(clock)).scalar_one()
    assert takeover is not None
    now = takeover.record.now
    if store.dialect == "sqlite":  # second-precision text
        assert str(before) <= now.strftime("%Y-%m-%d %H:%M:%S") <= str(after)
    else:
        assert before <= now <= after
        assert takeover.record.lease_remaining == 12.345678


# -- flask idem citus --------------------------------------------------------------------------

CLAIM_SIGNATURE = (
    "'idempotency_claim(text, text, text, bytea, text, double precision, double precision)'"
)


def _citus(app: flask.Flask, *args: str) -> t.Any:
    return app.test_cli_runner().invoke(args=["idem", "citus", *args])


def _tables(store: SQLStore) -> list[str]:
    return sorted(sa.inspect(store.engine).get_table_names())


def test_citus_is_refused_without_the_extension(app_factory: Factory, store: SQLStore) -> None:
    app, _, _ = app_factory()
    before = _tables(store)
    result = _citus(app)
    assert result.exit_code == 1, result.output
    if store.dialect == "postgresql":
        assert "the citus extension is not installed in this database" in result.output
        assert "nothing was changed" in result.output
        with store.engine.connect() as conn:
            assert citus.citus_version(conn) is None
    else:
        assert "Citus runs on PostgreSQL; this store is on sqlite" in result.output
    assert _tables(store) == before


def test_citus_dry_run_prints_the_whole_plan(app_factory: Factory, store: SQLStore) -> None:
    app, _, _ = app_factory()
    result = _citus(app, "--dry-run")
    assert result.exit_code == 0, result.output
    assert "-- distribute idempotency_keys by tenant\n" in result.stdout
    assert "SELECT create_distributed_table('idempotency_keys', 'tenant');" in result.stdout
    assert (
        f"SELECT create_distributed_function({CLAIM_SIGNATURE}, 'p_tenant', "
        "colocate_with => 'idempotency_keys');"
    ) in result.stdout
    assert "the full plan follows" in result.stderr


def test_citus_dry_run_colocated_as_json(app_factory: Factory, store: SQLStore) -> None:
    app, _, _ = app_factory()
    result = _citus(app, "--dry-run", "--colocate-with", "payments", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["dry_run"] is True
    assert [step["sql"] for step in report["steps"]] == [
        "SELECT create_distributed_table('idempotency_keys', 'tenant', "
        "colocate_with => 'payments');",
        f"SELECT create_distributed_function({CLAIM_SIGNATURE}, 'p_tenant', "
        "colocate_with => 'idempotency_keys');",
    ]
    assert "citus" in report["note"] or "PostgreSQL" in report["note"]


def test_citus_command_is_listed(app_factory: Factory) -> None:
    app, _, _ = app_factory()
    result = app.test_cli_runner().invoke(args=["idem", "--help"])
    assert "citus" in result.output


@pytest.mark.parametrize(
    "name", ["payments\nDROP TABLE idempotency_keys; --", "a b", "x;y", "t\x00", "1abc", ""]
)
def test_citus_refuses_what_is_not_a_table_name(
    app_factory: Factory, store: SQLStore, name: str
) -> None:
    app, _, _ = app_factory()
    result = _citus(app, "--dry-run", "--colocate-with", name)
    assert result.exit_code == 1, result.output
    assert "must be a table name" in result.output
    assert "DROP TABLE" not in result.stdout


def test_rendered_steps_quote_their_values() -> None:
    step = Step("why", "SELECT f(:a, x => :b)", {"a": "it's", "b": "t"})
    assert step.rendered() == "SELECT f('it''s', x => 't');"


@pytest.mark.parametrize(
    ("version", "parsed"), [("13.2-1", (13, 2)), ("11.0", (11, 0)), ("10.2-1", (10, 2))]
)
def test_citus_versions(version: str, parsed: tuple[int, int]) -> None:
    assert citus._version_tuple(version) == parsed
    assert (parsed >= citus.MINIMUM_VERSION) == (parsed[0] >= 11)
