"""``flask idem check``: is the store's database ready for this flask_idem? One finding per check.

A deploy runs it before traffic; each finding is ``ok``, ``warning`` (works, but not as
flask_idem is meant to run) or ``error`` (protected requests fail, or will):

* **database**: reachable, and a version flask_idem supports;
* **schema**: the revision flask_idem's tables are at against this package's head, read from
  ``flask_idem_alembic_version`` (standalone migrations) or from the application's
  Flask-Migrate history (:func:`flask_idem.ops.migrate.include_in`), merged or not;
* **functions** (PostgreSQL, at the head): the SQL functions the migrations installed are the
  ones this flask_idem expects (:mod:`flask_idem.store.expected_functions`), not edited by hand
  or installed by another build;
* **partitions** (PostgreSQL): a partition for the records claimed now (else they land in
  DEFAULT), and ``IDEMPOTENCY_PARTITIONS_AHEAD`` more after it;
* **session settings** (PostgreSQL) of a store connection, as flask_idem relies on them:
  ``statement_timeout`` and ``lock_timeout`` (a blocked statement must not hold a worker),
  READ COMMITTED (both claims refuse anything else) and ``log_min_error_statement = panic``
  (a failing statement must not write raw keys into the server log);
* **key secrets** (Citus): ``IDEMPOTENCY_KEY_SECRETS`` lists one entry only, as a rotation's
  locks do not reach the workers (docs/encryption.md).
"""

from __future__ import annotations

import dataclasses
import enum
import typing as t

import sqlalchemy as sa
from alembic.script import ScriptDirectory
from alembic.util import CommandError

from ..core.errors import UPGRADE_HINT, StoreUnavailable
from ..store import PostgresStore, RequestStore
from ..store.citus import citus_version
from ..store.expected_functions import EXPECTED_FUNCTIONS, drift
from ..store.pooler import SENT, STARTUP_MARKER
from ..store.sql import translate_errors
from .migrate import alembic_config, recorded_revision

#: The oldest PostgreSQL the migrations and claims run on.
POSTGRESQL_MINIMUM = (13,)
#: Where the settings of a store session come from, for the advice that goes with them.
_SESSION_DOCS = "flask_idem.store.create_engine or engine_options (docs/timeouts.md)"
_LOG_GRANT = "GRANT SET ON PARAMETER log_min_error_statement, ... TO the role (docs/timeouts.md)"
#: Behind a transaction pooler the start-up settings never reach a server: only the role's do.
_ROLE_DOCS = "ALTER ROLE ... SET, as the pooler drops start-up settings (docs/operations.md)"
# In a transaction: the isolation of business transactions (an engine's isolation_level) as
# well as the default that autocommitted claims run at.
_SESSION = sa.text(
    "SELECT current_setting('statement_timeout') AS statement_timeout, "
    "current_setting('lock_timeout') AS lock_timeout, "
    "current_setting('default_transaction_isolation') AS default_isolation, "
    "current_setting('transaction_isolation') AS isolation, "
    "current_setting('log_min_error_statement') AS log_min_error_statement, "
    f"current_setting('{STARTUP_MARKER}', true) AS startup_marker"
)


class Status(enum.Enum):
    OK = "ok"
    WARNING = "warning"
    ERROR = "error"


@dataclasses.dataclass(frozen=True)
class Finding:
    """One line of the check: what was checked, how it stands, and what to do about it."""

    check: str
    status: Status
    detail: str


def run(store: RequestStore, *, partitions_ahead: int, migrate: t.Any = None) -> list[Finding]:
    """Every check that applies to ``store``'s database, in order.

    :param partitions_ahead: the partitions wanted after the current one
        (``IDEMPOTENCY_PARTITIONS_AHEAD``).
    :param migrate: the application's Flask-Migrate state (``app.extensions["migrate"]``),
        where flask_idem's revisions are recorded when it includes them in its history.
    """
    try:
        with translate_errors(), store.engine.connect() as connection:
            findings = [_database(connection)]
            schema, revision = _schema(connection, migrate)
            findings.append(schema)
            if store.engine.dialect.name == "postgresql":
                # Judged at the head only: below it the schema finding already says to upgrade,
                # and above it the functions are a newer release's, not this one's to judge.
                if schema.status is Status.OK:
                    findings.append(_functions(connection))
                findings += _session(connection)
                if store.keys.rotating and citus_version(connection) is not None:
                    findings.append(_rotation_on_citus(len(store.keys.secrets)))
    except StoreUnavailable as exc:
        return [Finding("database", Status.ERROR, str(exc))]
    if isinstance(store, PostgresStore) and revision is not None:
        findings.append(_partitions(store, partitions_ahead))
    return findings


def _database(connection: sa.Connection) -> Finding:
    dialect = connection.dialect
    version = dialect.server_version_info or ()
    spelled = ".".join(str(part) for part in version)
    where = connection.engine.url.render_as_string(hide_password=True)
    if dialect.name == "postgresql" and version < POSTGRESQL_MINIMUM:
        return Finding(
            "database", Status.ERROR, f"PostgreSQL {spelled}: flask_idem needs 13 or later"
        )
    return Finding("database", Status.OK, f"{dialect.name} {spelled} at {where}")


def _schema(connection: sa.Connection, migrate: t.Any) -> tuple[Finding, str | None]:
    """The schema finding, and the flask_idem revision the database is at (None: none)."""
    ours = ScriptDirectory.from_config(alembic_config())
    known = {script.revision for script in ours.walk_revisions()}
    (head,) = ours.get_heads()
    try:
        revision, source = recorded_revision(connection, migrate, known)
    except CommandError as exc:  # Flask-Migrate's directory is not where the app says
        detail = f"cannot read the application's migration history: {exc}"
        return Finding("schema", Status.WARNING, detail), None
    if revision is None:
        detail = f"flask_idem's tables are not migrated: {UPGRADE_HINT}"
        return Finding("schema", Status.ERROR, detail), None
    if revision == head:
        return Finding("schema", Status.OK, f"at {revision}, the head ({source})"), revision
    if revision in known:
        detail = f"at {revision}, older than this flask_idem's head {head}: {UPGRADE_HINT}"
        return Finding("schema", Status.ERROR, detail), revision
    detail = (
        f"at {revision}, a revision this flask_idem does not know (head {head}): a newer "
        "release migrated it; upgrade the package"
    )
    return Finding("schema", Status.WARNING, detail), revision


def _functions(connection: sa.Connection) -> Finding:
    wrong = drift(connection)
    if not wrong:
        detail = f"all {len(EXPECTED_FUNCTIONS)} as this flask_idem's migrations install them"
        return Finding("functions", Status.OK, detail)
    listed = ", ".join(f"{function.signature} {how}" for function, how in wrong.items())
    detail = (
        f"{listed}: not as this flask_idem's head revision installs them (edited by hand, or "
        "installed by another build of flask_idem), so claims may not behave as this release "
        "relies on; install them again from the revision that creates them "
        "(flask_idem/migrations/versions)"
    )
    return Finding("functions", Status.ERROR, detail)


def _partitions(store: PostgresStore, wanted: int) -> Finding:
    try:
        current = store.current_partition()
        ahead = store.partitions_ahead() or 0
    except StoreUnavailable as exc:
        return Finding("partitions", Status.ERROR, str(exc))
    counted = f"{ahead} ahead (IDEMPOTENCY_PARTITIONS_AHEAD = {wanted})"
    if current is None:
        detail = (
            f"no partition for the records claimed now, they land in DEFAULT; {counted}: "
            "run `flask idem maintain`, from cron"
        )
        return Finding("partitions", Status.ERROR, detail)
    if ahead < wanted:
        detail = f"{current} is current, only {counted}: run `flask idem maintain`, from cron"
        return Finding("partitions", Status.WARNING, detail)
    return Finding("partitions", Status.OK, f"{current} is current, {counted}")


def _rotation_on_citus(entries: int) -> Finding:
    """A rotation's extra locks are the coordinator's, while a claim of one entry locks on
    the tenant's worker: servers of two rotation steps would not wait for each other."""
    detail = (
        f"IDEMPOTENCY_KEY_SECRETS lists {entries} entries on Citus, where a rotation's locks "
        "do not reach the workers' claims (two servers could claim one key twice): list one "
        "entry only (docs/encryption.md)"
    )
    return Finding("key secrets", Status.ERROR, detail)


def _session(connection: sa.Connection) -> list[Finding]:
    settings = connection.execute(_SESSION).one()._mapping
    # An engine that sent flask_idem's start-up settings, on a session that lacks them: a pooler.
    pooled = connection.info.get(SENT) is not None and settings["startup_marker"] != "on"
    findings = []
    for name in ("statement_timeout", "lock_timeout"):
        value = settings[name]
        if value == "0":
            advice = _ROLE_DOCS if pooled else _SESSION_DOCS
            detail = f"0, no bound: a blocked store statement holds its worker; see {advice}"
            findings.append(Finding(name, Status.WARNING, detail))
        else:
            findings.append(Finding(name, Status.OK, value))
    default, isolation = settings["default_isolation"], settings["isolation"]
    if default == isolation == "read committed":
        findings.append(Finding("isolation", Status.OK, "read committed"))
    else:
        detail = (
            f"default_transaction_isolation is {default}, the engine's transactions run at "
            f"{isolation}: claims refuse anything but read committed (503); see {_SESSION_DOCS}"
        )
        findings.append(Finding("isolation", Status.ERROR, detail))
    level = settings["log_min_error_statement"]
    if level == "panic":
        findings.append(Finding("log_min_error_statement", Status.OK, level))
    else:
        detail = (
            f"{level}: the server logs failing statements with their raw keys and bodies; "
            f"{_ROLE_DOCS if pooled else _LOG_GRANT}"
        )
        findings.append(Finding("log_min_error_statement", Status.WARNING, detail))
    return findings
