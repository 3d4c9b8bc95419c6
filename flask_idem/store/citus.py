"""Distribute the store over a Citus cluster: opt-in, idempotent, and a no-op without Citus.

``flask idem citus`` (or :func:`distribute`) runs, on the coordinator, only what is missing:

1. ``create_distributed_table('idempotency_keys', 'tenant')``, optionally colocated with an
   application table distributed by the same tenant value (``update_distributed_table_colocation``
   when the table is already distributed but elsewhere);
2. ``create_distributed_function('idempotency_claim(...)', 'p_tenant', colocate_with :=
   'idempotency_keys')``: Citus then delegates every claim, a ``SELECT * FROM
   idempotency_claim(...)`` sent outside a transaction block, to the worker holding the
   tenant's shard, where its advisory lock, lookup and insert run next to the data.

The partition upkeep functions stay on the coordinator: they run DDL, which Citus propagates
from there. Every other statement of the store is a single-tenant query (the ``tenant``
equality comes first in its ``WHERE``), which Citus routes to one shard;
``tests/store/test_citus.py`` checks that on plain PostgreSQL. See ``docs/citus.md``.
"""

from __future__ import annotations

import dataclasses
import re
import typing as t

import sqlalchemy as sa

from ..core.errors import IdempotencyError
from .messages import database_message

TABLE = "idempotency_keys"
DISTRIBUTION_COLUMN = "tenant"
CLAIM_FUNCTION = (
    "idempotency_claim(text, text, text, bytea, text, double precision, double precision)"
)
#: ``p_tenant``, the claim function's first argument.
CLAIM_DISTRIBUTION_ARGUMENT = "p_tenant"
#: Function delegation of ``SELECT * FROM f(...)`` (not only ``SELECT f(...)``) and
#: ``pg_catalog.pg_dist_object`` appeared in Citus 11.0.
MINIMUM_VERSION = (11, 0)


class CitusError(IdempotencyError):
    """Distribution was refused: no Citus, an old one, or a conflicting distribution."""


class CitusMissing(CitusError):
    """The database is plain PostgreSQL (or not PostgreSQL): there is nothing to distribute."""


@dataclasses.dataclass(frozen=True)
class Step:
    """One statement of the distribution and why it is needed."""

    reason: str
    sql: str
    parameters: dict[str, t.Any] = dataclasses.field(default_factory=dict)

    def rendered(self) -> str:
        """The statement with its parameters inlined, for ``--dry-run`` and logs."""

        def literal(match: re.Match[str]) -> str:
            return "'" + str(self.parameters[match.group(1)]).replace("'", "''") + "'"

        return re.sub(r"(?<!:):(\w+)", literal, self.sql) + ";"


def citus_version(connection: sa.Connection) -> str | None:
    """The installed Citus version in this database, or None."""
    return connection.execute(
        sa.text("SELECT extversion FROM pg_extension WHERE extname = 'citus'")
    ).scalar_one_or_none()


def _version_tuple(version: str) -> tuple[int, int]:
    major, _, rest = version.partition(".")
    minor = "".join(c for c in rest.split("-")[0].split(".")[0] if c.isdigit()) or "0"
    return int(major), int(minor)


def _table_step(colocate_with: str | None) -> Step:
    parameters = {"table": TABLE, "column": DISTRIBUTION_COLUMN}
    colocation = ""
    if colocate_with is not None:
        parameters["colocate_with"] = colocate_with
        colocation = ", colocate_with => :colocate_with"
    return Step(
        f"distribute {TABLE} by {DISTRIBUTION_COLUMN}"
        + (f", colocated with {colocate_with}" if colocate_with else ""),
        f"SELECT create_distributed_table(:table, :column{colocation})",
        parameters,
    )


def _function_step() -> Step:
    return Step(
        "delegate each claim to the worker holding its tenant's shard",
        "SELECT create_distributed_function(:function, :argument, colocate_with => :table)",
        {"function": CLAIM_FUNCTION, "argument": CLAIM_DISTRIBUTION_ARGUMENT, "table": TABLE},
    )


#: A table name, optionally schema-qualified: nothing else is ever put into SQL or a comment.
_TABLE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_$]{0,62}(\.[A-Za-z_][A-Za-z0-9_$]{0,62})?")


def _checked(colocate_with: str | None) -> str | None:
    if colocate_with is not None and not _TABLE_NAME.fullmatch(colocate_with):
        raise CitusError(
            "--colocate-with must be a table name (letters, digits, _ and $, optionally "
            "schema.table)"
        )
    return colocate_with


def full_plan(colocate_with: str | None = None) -> list[Step]:
    """Every step, as on a database where nothing is distributed yet."""
    return [_table_step(_checked(colocate_with)), _function_step()]


def plan(connection: sa.Connection, colocate_with: str | None = None) -> list[Step]:
    """The steps still missing on this Citus coordinator (empty when all is in place).

    :raises CitusError: when the table is distributed in a way the store cannot use.
    """
    colocate_with = _checked(colocate_with)
    steps: list[Step] = []
    table = connection.execute(
        sa.text(
            "SELECT citus_table_type, distribution_column, colocation_id FROM citus_tables "
            "WHERE table_name = CAST(:table AS regclass)"
        ),
        {"table": TABLE},
    ).first()
    wanted_colocation = None
    if colocate_with is not None:
        wanted_colocation = connection.execute(
            sa.text(
                "SELECT colocation_id FROM citus_tables "
                "WHERE table_name = to_regclass(:table) AND citus_table_type = 'distributed'"
            ),
            {"table": colocate_with},
        ).scalar_one_or_none()
        if wanted_colocation is None:
            raise CitusError(
                f"{colocate_with} is not a distributed table: distribute it by its tenant "
                "column first (create_distributed_table), then colocate with it"
            )
    if table is None:
        steps.append(_table_step(colocate_with))
    else:
        kind, column, colocation = table
        if kind != "distributed" or column != DISTRIBUTION_COLUMN:
            raise CitusError(
                f"{TABLE} is a Citus {kind} table distributed by {column or 'nothing'}; the "
                f"store needs it hash-distributed by {DISTRIBUTION_COLUMN} "
                "(undistribute_table first)"
            )
        if wanted_colocation is not None and colocation != wanted_colocation:
            steps.append(
                Step(
                    f"colocate {TABLE} with {colocate_with}",
                    "SELECT update_distributed_table_colocation(:table, colocate_with => :other)",
                    {"table": TABLE, "other": colocate_with},
                )
            )
    function = connection.execute(
        sa.text(
            "SELECT o.distribution_argument_index, o.colocationid, p.colocation_id "
            "FROM pg_catalog.pg_dist_object AS o "
            "LEFT JOIN citus_tables AS p ON p.table_name = CAST(:table AS regclass) "
            "WHERE o.classid = 'pg_proc'::regclass AND o.objid = CAST(:function AS regprocedure)"
        ),
        {"table": TABLE, "function": CLAIM_FUNCTION},
    ).first()
    # Distributed by its first argument and colocated with the table, unless the table moves
    # to another colocation group in this run (then the function must follow it).
    in_place = (
        function is not None
        and function.distribution_argument_index == 0
        and function.colocationid == function.colocation_id
        and not steps
    )
    if not in_place:
        steps.append(_function_step())
    return steps


def distribute(
    engine: sa.Engine, *, colocate_with: str | None = None, dry_run: bool = False
) -> list[Step]:
    """Distribute the store on the Citus coordinator ``engine`` points at, idempotently.

    Each step commits on its own: a run interrupted half-way is completed by the next one.

    :param colocate_with: an application table distributed by the same tenant value (same
        column type), so that business rows and their idempotency records share a worker.
    :param dry_run: only return the steps that would run.
    :returns: the steps run (or that would run).
    :raises CitusError: when the database is not PostgreSQL with Citus >= 11.0, or the table
        is distributed in a way the store cannot use; nothing has changed then.
    """
    if engine.dialect.name != "postgresql":
        raise CitusMissing(f"Citus runs on PostgreSQL; this store is on {engine.dialect.name}")
    # Distributing copies the table's rows and creates shards on every worker: seconds, past
    # the store's statement timeout and client-side deadline, so it runs on an engine of its
    # own, without them (as migrations do).
    ddl_engine = sa.create_engine(engine.url, poolclass=sa.pool.NullPool)
    try:
        return _distribute(ddl_engine, colocate_with, dry_run)
    except sa.exc.SQLAlchemyError as exc:
        # The server's own message (table names, Citus' reason), never statement parameters:
        # DDL quotes no row's values, so even a data exception's words are shown ("replication
        # factor (1) exceeds number of worker nodes (0)").
        reason = database_message(exc, rows=False) or type(exc).__name__
        raise CitusError(f"distribution failed: {reason}") from exc
    finally:
        ddl_engine.dispose()


def _distribute(engine: sa.Engine, colocate_with: str | None, dry_run: bool) -> list[Step]:
    with engine.connect() as connection:
        version = citus_version(connection)
        if version is None:
            raise CitusMissing(
                "the citus extension is not installed in this database (CREATE EXTENSION "
                "citus on the coordinator first); nothing was changed"
            )
        if _version_tuple(version) < MINIMUM_VERSION:
            raise CitusError(f"Citus {version} is too old: flask_idem needs Citus 11.0 or later")
        steps = plan(connection, colocate_with)
        if dry_run:
            return steps
        connection.commit()
        for step in steps:
            with connection.begin():
                connection.execute(sa.text(step.sql), step.parameters)
    return steps
