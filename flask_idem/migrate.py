"""flask_idem's Alembic migrations: standalone, or inside an application's own history.

The revisions ship inside the package (``flask_idem.migrations``) on their own branch, labelled
``flask_idem``. They run in one of two ways, never both on one database:

* **Standalone** (no Flask-Migrate): :func:`upgrade` and :func:`downgrade` from Python, or
  ``flask idem db upgrade|downgrade|current``. The extension then keeps its own version table
  (``flask_idem_alembic_version``), so an application's own Alembic history beside it is never
  touched.
* **In the application's history** (Flask-Migrate): :func:`include_in` adds the package's
  revisions to the application's ``version_locations``; ``flask db upgrade heads`` then brings
  the application's branch and the ``flask_idem`` branch up, tracked in the application's
  ``alembic_version`` like any other branch, and autogenerate (``flask db migrate``) leaves
  flask_idem's tables alone.
"""

from __future__ import annotations

import importlib.resources
import os
import sys
import typing as t

import click
import sqlalchemy as sa
from alembic import command
from alembic.config import Config
from flask.cli import AppGroup

from .store import normalize_url
from .table import VERSION_TABLE, metadata

if t.TYPE_CHECKING:
    from flask_migrate import Migrate

#: The branch label of flask_idem's first revision: ``flask db upgrade flask_idem@head``.
BRANCH = "flask_idem"

IncludeObject = t.Callable[[t.Any, "str | None", str, bool, t.Any], bool]

#: Every table flask_idem creates starts with this (partitions, later tables).
_PREFIX = "idempotency_"
_SEPARATORS = {"space": " ", "newline": "\n", "os": os.pathsep, ":": ":", ";": ";"}


def versions_directory() -> str:
    """The directory holding flask_idem's revision files (for ``version_locations``)."""
    return str(importlib.resources.files("flask_idem.migrations") / "versions")


def alembic_config(url: str | sa.URL | None = None) -> Config:
    """An Alembic ``Config`` for flask_idem's standalone migrations.

    :param url: the database; without it the environment reads ``DATABASE_URL``.
    """
    config = Config()
    config.set_main_option(
        "script_location", str(importlib.resources.files("flask_idem.migrations"))
    )
    if url is not None:
        rendered = normalize_url(url).render_as_string(hide_password=False)
        # ConfigParser interpolation: a literal "%" (URL-encoded passwords) must be doubled.
        config.set_main_option("sqlalchemy.url", rendered.replace("%", "%%"))
    return config


def upgrade(url: str | sa.URL | None = None, revision: str = "head") -> None:
    """Create or update the ``idempotency_keys`` schema (standalone)."""
    command.upgrade(alembic_config(url), revision)


def downgrade(url: str | sa.URL | None = None, revision: str = "base") -> None:
    """Remove the schema (``base``) or step back to ``revision`` (standalone)."""
    command.downgrade(alembic_config(url), revision)


# -- inside an application's history (Flask-Migrate) ----------------------------------------


def is_own_table(name: str | None) -> bool:
    """Whether a table belongs to flask_idem: its tables, their PostgreSQL partitions
    (``idempotency_keys_20261201``, ``idempotency_keys_default``) and its version table."""
    if name is None:
        return False
    return name in metadata.tables or name == VERSION_TABLE or name.startswith(_PREFIX)


def include_object(
    obj: t.Any, name: str | None, type_: str, reflected: bool, compare_to: t.Any
) -> bool:
    """An Alembic ``include_object`` hook that hides flask_idem's tables from autogenerate.

    They are in the database but not in the application's ``MetaData``: without this hook
    ``flask db migrate`` would write a revision dropping them.
    """
    table = obj.table.name if type_ in ("index", "column", "unique_constraint") else name
    if type_ == "foreign_key_constraint":
        table = obj.parent.name
    return not is_own_table(table)


def _chain(first: IncludeObject, second: IncludeObject) -> IncludeObject:
    def both(obj: t.Any, name: str | None, type_: str, reflected: bool, other: t.Any) -> bool:
        return first(obj, name, type_, reflected, other) and second(
            obj, name, type_, reflected, other
        )

    return both


def add_version_location(config: Config) -> Config:
    """Add flask_idem's revisions to an Alembic configuration's ``version_locations``.

    The application's own ``<script_location>/versions`` stays first, so new revisions of the
    application keep landing in its own directory. Without a ``path_separator`` in the
    configuration, ``os`` (``os.pathsep``) is set, as Alembic recommends.
    """
    ours = versions_directory()
    separator_name = config.get_main_option("path_separator") or config.get_main_option(
        "version_path_separator"
    )
    if separator_name is None:
        separator_name = "os"
        config.set_main_option("path_separator", separator_name)
    separator = _SEPARATORS[separator_name]
    current = config.get_main_option("version_locations")
    if current:
        locations = [part.strip() for part in current.split(separator) if part.strip()]
    else:
        script_location = config.get_main_option("script_location") or "migrations"
        locations = [os.path.join(script_location, "versions")]
    if ours not in locations:
        locations.append(ours)
    # ConfigParser interpolation: a "%" in a path must be doubled.
    config.set_main_option("version_locations", separator.join(locations).replace("%", "%%"))
    return config


def include_in(migrate: Migrate) -> Migrate:
    """Put flask_idem's revisions into an application's Flask-Migrate history.

    ::

        db = SQLAlchemy(app)
        migrate = Migrate(app, db)
        flask_idem.migrate.include_in(migrate)

    Then ``flask db upgrade heads`` (``heads``: the application's branch and the
    ``flask_idem`` branch; a plain ``flask db upgrade`` refuses two heads until they are
    merged with ``flask db merge heads``) creates and updates both. It registers a
    :meth:`Migrate.configure <flask_migrate.Migrate.configure>` callback that adds the
    revisions to ``version_locations`` (:func:`add_version_location`), and an
    ``include_object`` hook (:func:`include_object`, chained after the application's own) so
    that autogenerate never proposes to drop flask_idem's tables.

    :param migrate: the application's ``flask_migrate.Migrate``, before or after its
        ``init_app``.
    :returns: ``migrate``.
    """

    def configure(config: Config) -> Config:
        from flask import current_app

        state = current_app.extensions.get("migrate")
        if state is not None:
            _hide_own_tables(state.configure_args)
        return add_version_location(config)

    _hide_own_tables(migrate.alembic_ctx_kwargs)
    migrate.configure(configure)
    return migrate


def _hide_own_tables(configure_args: dict[str, t.Any]) -> None:
    existing = configure_args.get("include_object")
    if existing is None:
        configure_args["include_object"] = include_object
    elif existing is not include_object and not getattr(existing, "_flask_idem", False):
        chained = _chain(existing, include_object)
        chained._flask_idem = True  # type: ignore[attr-defined]
        configure_args["include_object"] = chained


# -- flask idem db ... (standalone) -----------------------------------------------------------

db_group = AppGroup(
    "db",
    help="flask_idem's own migrations, for applications without Flask-Migrate (with it, use "
    "flask_idem.migrate.include_in and `flask db upgrade heads`).",
)


def _app_config() -> Config:
    """The standalone configuration on the application's flask_idem database."""
    from .state import AppState

    engine = AppState.current().store.engine
    config = alembic_config(engine.url)
    # Alembic binds sys.stdout when its module loads; print where click prints now.
    config.stdout = sys.stdout
    return config


@db_group.command("upgrade")
@click.argument("revision", default="head")
@click.option("--sql", is_flag=True, help="Print the SQL instead of running it (offline).")
def db_upgrade(revision: str, sql: bool) -> None:
    """Create or update flask_idem's tables up to REVISION (default: head)."""
    command.upgrade(_app_config(), revision, sql=sql)


@db_group.command("downgrade")
@click.argument("revision", default="-1")
@click.option("--sql", is_flag=True, help="Print the SQL instead of running it (offline).")
def db_downgrade(revision: str, sql: bool) -> None:
    """Step flask_idem's tables back to REVISION (default: one step; ``base`` drops them)."""
    command.downgrade(_app_config(), revision, sql=sql)


@db_group.command("current")
def db_current() -> None:
    """Print the revision flask_idem's tables are at (empty when never migrated)."""
    command.current(_app_config())
