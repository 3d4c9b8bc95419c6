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
  ``alembic_version`` like any other branch. Autogenerate (``flask db migrate``) leaves
  flask_idem's tables alone, and every new revision of the application (``flask db migrate``,
  ``flask db revision``) is written into its own ``migrations/versions`` on its own branch
  (:func:`place_revisions`), never into the installed package.

Without a ``url``, :func:`upgrade` and :func:`downgrade` migrate the database of the current
application (its flask_idem store, else its Flask-SQLAlchemy engine), else ``DATABASE_URL``.
"""

from __future__ import annotations

import importlib.resources
import logging
import os
import sys
import typing as t
from pathlib import Path

import click
import sqlalchemy as sa
from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from alembic.util import CommandError
from flask import current_app, has_app_context
from flask.cli import AppGroup

from ..core.config import EXTENSION_NAME
from ..sessions import EXTENSION_KEY as FLASK_SQLALCHEMY
from ..state import AppState
from ..store import normalize_url
from ..store.table import TABLE_NAME, VERSION_TABLE, metadata

if t.TYPE_CHECKING:
    from alembic.operations.ops import MigrationScript
    from alembic.script import Script
    from flask_migrate import Migrate

#: The branch label of flask_idem's first revision: ``flask db upgrade flask_idem@head``.
BRANCH = "flask_idem"

IncludeObject = t.Callable[[t.Any, "str | None", str, bool, t.Any], bool]
ProcessRevisionDirectives = t.Callable[["MigrationContext", t.Any, "list[MigrationScript]"], None]

#: Every table flask_idem creates starts with this (partitions, later tables).
_PREFIX = "idempotency_"
_SEPARATORS = {"space": " ", "newline": "\n", "os": os.pathsep, ":": ":", ";": ";"}
#: Marks the hooks :func:`include_in` installed, so that installing them again is a no-op.
_OURS = "_flask_idem"


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


def app_database() -> sa.URL | None:
    """The database holding flask_idem's tables for the current application, if it has one.

    That is its flask_idem store's (``app.extensions["idempotency"]``), which is where the
    requests read and write, else the default engine of its Flask-SQLAlchemy (a deploy script
    may migrate before the extension is set up); None outside an application context.
    """
    if not has_app_context():
        return None
    if EXTENSION_NAME in current_app.extensions:
        return AppState.current().store.engine.url
    db = current_app.extensions.get(FLASK_SQLALCHEMY)
    return None if db is None else t.cast(sa.URL, db.engine.url)


def upgrade(url: str | sa.URL | None = None, revision: str = "head") -> None:
    """Create or update the ``idempotency_keys`` schema (standalone).

    :param url: the database; without it, the current application's (:func:`app_database`),
        else ``DATABASE_URL``.
    """
    command.upgrade(alembic_config(app_database() if url is None else url), revision)


def downgrade(url: str | sa.URL | None = None, revision: str = "base") -> None:
    """Remove the schema (``base``) or step back to ``revision`` (standalone).

    :param url: the database, found as for :func:`upgrade`.
    """
    command.downgrade(alembic_config(app_database() if url is None else url), revision)


def recorded_revision(
    connection: sa.Connection, migrate: t.Any, known: set[str]
) -> tuple[str | None, str]:
    """flask_idem's revision as recorded in the database, and the version table it was read in.

    Its own version table first (standalone migrations); else, in an application with
    Flask-Migrate (``migrate``: its ``app.extensions["migrate"]``), the application's, where
    flask_idem's revision is a head or, after ``flask db merge heads``, an ancestor of one.

    :param known: the revisions of this flask_idem.
    """
    heads = _heads(connection, VERSION_TABLE)
    if heads or migrate is None:
        return (heads[0] if heads else None), VERSION_TABLE
    table = migrate.configure_args.get("version_table", "alembic_version")
    heads = _heads(connection, table)
    direct = [head for head in heads if head in known]
    if direct or not heads:
        return (direct[0] if direct else None), table
    history = ScriptDirectory.from_config(migrate.migrate.get_config(migrate.directory))
    for recorded in heads:
        for script in history.iterate_revisions(recorded, "base"):
            if script.revision in known:
                return script.revision, table
    return None, table


def _heads(connection: sa.Connection, version_table: str) -> tuple[str, ...]:
    """The revisions recorded in ``version_table`` (none when it does not exist)."""
    context = MigrationContext.configure(connection, opts={"version_table": version_table})
    return context.get_current_heads()


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


def place_revisions(
    context: MigrationContext, revision: t.Any, directives: list[MigrationScript]
) -> None:
    """An Alembic ``process_revision_directives`` hook: an application's new revisions go into
    its own directory, on its own branch.

    Alembic builds a new revision on ``head`` and writes it into the directory of the head it
    builds on. With flask_idem's revisions among the ``version_locations``, the ``head`` of an
    application without revisions is flask_idem's: its first revision would be chained onto
    flask_idem's branch and written into the installed package. So a revision left on ``head``
    is built on the application's own head instead (``base``, a new root, while it has none;
    with several the choice stays the user's, and Alembic asks for ``--head``), and one
    without a ``version_path`` goes into the application's first location wherever Alembic
    would pick flask_idem's directory. A head or path given on the command line is kept.

    A no-op when flask_idem's revisions are not in the history. :func:`include_in` installs
    it; an ``env.py`` of plain Alembic that uses :func:`add_version_location` passes it to
    ``context.configure``.

    :param context: the migration context; its ``script`` is the history.
    :param revision: the database's current revision (not needed).
    :param directives: the revisions about to be written, changed in place.
    """
    scripts = context.script
    if scripts is None:
        return
    ours = Path(versions_directory()).resolve()
    own_locations = [
        location for location in scripts.version_locations if Path(location).resolve() != ours
    ]
    if len(own_locations) == len(scripts.version_locations) or not own_locations:
        return  # flask_idem's revisions are not in this history, or nothing else is
    for directive in directives:
        if directive.head == "head":
            heads = [head for head in scripts.get_revisions("heads") if not _is_ours(head, ours)]
            if len(heads) < 2:
                directive.head = heads[0].revision if heads else "base"
        if directive.version_path is None and _lands_in(scripts, directive.head, ours):
            directive.version_path = own_locations[0]


def _is_ours(script: Script, ours: Path) -> bool:
    return Path(script.path).resolve().parent == ours


def _lands_in(scripts: ScriptDirectory, head: t.Any, ours: Path) -> bool:
    """Whether Alembic would put a revision on ``head`` into ``ours`` (the directory of the
    first head it builds on), or fail for want of one (``base``)."""
    try:
        built_on = [script for script in scripts.get_revisions(head) if script is not None]
    except CommandError:
        return False  # an unknown head: Alembic says so itself
    return not built_on or _is_ours(built_on[0], ours)


def _hide_own_tables(own: IncludeObject | None) -> IncludeObject:
    """:func:`include_object` after the application's own hook, if it has one."""

    def hook(obj: t.Any, name: str | None, type_: str, reflected: bool, other: t.Any) -> bool:
        if own is not None and not own(obj, name, type_, reflected, other):
            return False
        return include_object(obj, name, type_, reflected, other)

    return hook


def _place_revisions(own: ProcessRevisionDirectives | None) -> ProcessRevisionDirectives:
    """:func:`place_revisions` after the application's own hook, or after Flask-Migrate's
    skipping of empty autogenerated revisions, which its ``env.py`` installs only when
    ``configure_args`` has no hook."""

    def hook(context: MigrationContext, revision: t.Any, directives: list[MigrationScript]) -> None:
        if own is not None:
            own(context, revision, directives)
        elif _autogenerated(context) and all(
            ops.is_empty() for directive in directives for ops in directive.upgrade_ops_list
        ):
            directives[:] = []
            # Flask-Migrate's message, on its logger, which its alembic.ini shows.
            logging.getLogger("alembic.env").info("No changes in schema detected.")
        place_revisions(context, revision, directives)

    return hook


def _autogenerated(context: MigrationContext) -> bool:
    config = context.config
    return config is not None and bool(getattr(config.cmd_opts, "autogenerate", False))


def _install_hooks(configure_args: dict[str, t.Any]) -> None:
    """Put flask_idem's hooks into Flask-Migrate's ``configure_args``, each wrapping the
    application's own; a no-op when they are there (every command runs the callbacks)."""
    wrappers: dict[str, t.Callable[[t.Any], t.Any]] = {
        "include_object": _hide_own_tables,
        "process_revision_directives": _place_revisions,
    }
    for name, wrap in wrappers.items():
        existing = configure_args.get(name)
        if not getattr(existing, _OURS, False):
            hook = wrap(existing)
            setattr(hook, _OURS, True)
            configure_args[name] = hook


def add_version_location(config: Config) -> Config:
    """Add flask_idem's revisions to an Alembic configuration's ``version_locations``.

    The application's own ``<script_location>/versions`` stays first: :func:`place_revisions`
    writes the application's new revisions there (Alembic alone would write them beside the
    head they build on, which may be flask_idem's). Without a ``path_separator`` in the
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
        flask_idem.ops.migrate.include_in(migrate)

    Then ``flask db upgrade heads`` (``heads``: the application's branch and the
    ``flask_idem`` branch; a plain ``flask db upgrade`` refuses two heads until they are
    merged with ``flask db merge heads``) creates and updates both. It registers a
    :meth:`Migrate.configure <flask_migrate.Migrate.configure>` callback that adds the
    revisions to ``version_locations`` (:func:`add_version_location`), and two hooks, each
    chained after the application's own: ``include_object`` (:func:`include_object`), so
    that autogenerate never proposes to drop flask_idem's tables, and
    ``process_revision_directives`` (:func:`place_revisions`, after Flask-Migrate's skipping
    of empty autogenerated revisions when the application has no hook of its own), so that
    ``flask db migrate`` and ``flask db revision`` write the application's revisions into its
    own ``migrations/versions``. The callback also sets ``revision_environment``: without it
    ``flask db revision`` does not run ``env.py``, so no hook sees its revision (it, and
    ``flask db merge``, then connect to the database, as ``flask db migrate`` does).

    Flask-Migrate's single-database templates (``flask``, ``aioflask``) only: flask_idem's
    revisions take no ``engine_name``, which the ``flask-multidb`` template passes.

    :param migrate: the application's ``flask_migrate.Migrate``, before or after its
        ``init_app``.
    :returns: ``migrate``.
    """

    def configure(config: Config) -> Config:
        state = current_app.extensions.get("migrate")
        if state is not None:
            _install_hooks(state.configure_args)
        config.set_main_option("revision_environment", "true")
        return add_version_location(config)

    # Before init_app, which copies these into the application's configure_args.
    _install_hooks(migrate.alembic_ctx_kwargs)
    migrate.configure(configure)
    return migrate


# -- flask idem db ... (standalone) -----------------------------------------------------------

db_group = AppGroup(
    "db",
    help="flask_idem's own migrations, for applications without Flask-Migrate (with it, use "
    "flask_idem.ops.migrate.include_in and `flask db upgrade heads`).",
)


def _app_config() -> Config:
    """The standalone configuration on the application's flask_idem database."""
    config = alembic_config(app_database())
    # Alembic binds sys.stdout when its module loads; print where click prints now.
    config.stdout = sys.stdout
    return config


@db_group.command("upgrade")
@click.argument("revision", default="head")
@click.option("--sql", is_flag=True, help="Print the SQL instead of running it (offline).")
def db_upgrade(revision: str, sql: bool) -> None:
    """Create or update flask_idem's tables up to REVISION (default: head)."""
    config = _app_config()
    if not sql:
        _refuse_a_flask_migrate_database(config)
    command.upgrade(config, revision, sql=sql)


def _refuse_a_flask_migrate_database(config: Config) -> None:
    """flask_idem's tables without its own version table are the application's Flask-Migrate
    history's: a standalone upgrade would create them again (a raw DuplicateTable)."""
    url = config.get_main_option("sqlalchemy.url")
    if url is None:
        return
    engine = sa.create_engine(url.replace("%%", "%"))
    try:
        tables = set(sa.inspect(engine).get_table_names())
    except sa.exc.SQLAlchemyError:
        return  # Alembic reports the database's own error
    finally:
        engine.dispose()
    if TABLE_NAME in tables and VERSION_TABLE not in tables:
        raise click.ClickException(
            "flask_idem's tables are in this database, migrated in the application's "
            "Flask-Migrate history (alembic_version): run `flask db upgrade heads` instead. "
            "To switch to standalone migrations, see 'Switching' in docs/flask-sqlalchemy.md."
        )


@db_group.command("downgrade")
@click.argument("revision", default="-1")
@click.option("--sql", is_flag=True, help="Print the SQL instead of running it (offline).")
def db_downgrade(revision: str, sql: bool) -> None:
    """Step flask_idem's tables back to REVISION (default: one step; ``base`` drops them)."""
    command.downgrade(_app_config(), revision, sql=sql)


@db_group.command("current")
def db_current() -> None:
    """Print the revision flask_idem's tables are at (empty when never migrated), also when
    the application's Flask-Migrate history records it."""
    config = _app_config()
    migrate = current_app.extensions.get("migrate")
    url = config.get_main_option("sqlalchemy.url")
    if migrate is None or url is None:
        command.current(config)
        return
    ours = ScriptDirectory.from_config(alembic_config())
    known = {script.revision for script in ours.walk_revisions()}
    engine = sa.create_engine(url.replace("%%", "%"))
    try:
        with engine.connect() as connection:
            revision, table = recorded_revision(connection, migrate, known)
    finally:
        engine.dispose()
    if revision is not None:
        head = " (head)" if revision in ours.get_heads() else ""
        where = "" if table == VERSION_TABLE else f" (in the application's {table})"
        click.echo(f"{revision}{head}{where}")
