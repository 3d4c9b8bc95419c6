"""Sessions behind a transaction pooler (PgBouncer): no start-up options, no session state.

flask_idem's engines send their session settings (READ COMMITTED, the statement and lock
timeouts) as ``-c`` options in the start-up packet, which costs no round trip on a direct
connection. A transaction pooler hands each transaction to any of its server connections, so
the start-up packet of the client never reaches a server: PgBouncer refuses the ``options``
parameter by default ("unsupported startup parameter: options") and drops it with
``ignore_startup_parameters = options``. A session ``SET`` would be worse than nothing: it
stays on a server connection that other clients then use.

So an engine whose options were refused connects again without them (and from then on
without trying), and a session whose options did not arrive (:data:`STARTUP_MARKER` unset)
is treated as pooled. An engine the application built (Flask-SQLAlchemy's) gets the marker
alone, through the same fallback, so that its pooled sessions are told apart too; it never
gets flask_idem's settings. A pooled session gets no session ``SET`` and prepares no statement
(:func:`behind_pooler`); the claim functions bound their own transaction instead (migration
0008, ``set_config(..., true)``), the transactions of flask_idem's own engines are begun
``READ COMMITTED`` by the driver, and their client-side deadline (:mod:`.engines`) is a
client's own and holds as it is. What only the role can give (bounds for the other store
statements, a quiet log for their failures) is checked once: a warning names the missing
``ALTER ROLE`` settings (docs/operations.md, "Behind a pooler").
"""

from __future__ import annotations

import logging
import threading
import typing as t
import weakref

import sqlalchemy as sa

log = logging.getLogger("flask_idem")

#: A start-up option flask_idem's engines send with their settings: a session that does not
#: show it did not get them.
STARTUP_MARKER = "flask_idem.startup"
#: ``connection_record.info`` key: True when the connection was opened with flask_idem's
#: start-up options, False when they were refused; absent for an engine no store prepared.
SENT = "flask_idem.startup_options"
#: ``connection_record.info`` key: True when the options were flask_idem's settings
#: (:func:`flask_idem.store.engine_options`), False when the engine is the application's own
#: and only got the marker.
SETTINGS = "flask_idem.startup_settings"
#: A ``connect_args`` entry that is no driver argument: the psycopg 3 connection class whose
#: ``connect`` opens the engine's connections (:mod:`.deadline_psycopg`).
CONNECTION_CLASS = "flask_idem_connection_class"
#: What PgBouncer answers to a start-up parameter it does not pass on.
_REFUSED = "unsupported startup parameter"
#: The session's settings a pooled store session relies on the role for, and their wanted value.
_ROLE_SETTINGS: tuple[tuple[str, t.Callable[[str], bool]], ...] = (
    ("statement_timeout", lambda value: value != "0"),
    ("lock_timeout", lambda value: value != "0"),
    ("log_min_error_statement", lambda value: value == "panic"),
)
_SESSION_QUERY = "SELECT current_setting(%s, true), " + ", ".join(
    f"current_setting('{name}')" for name, _ in _ROLE_SETTINGS
)

_warned = False


def startup_option() -> str:
    """The marker option, for :func:`flask_idem.store.engine_options`."""
    return f"-c {STARTUP_MARKER}=on"


def connect_without_refused_options(engine: sa.Engine) -> None:
    """Let ``engine`` connect through a pooler that refuses start-up options (idempotent).

    The first refusal is the only failed attempt: the engine's later connections go without
    them at once.
    """
    with _lock:
        if engine in _engines:
            return
        _engines.add(engine)
    sa.event.listen(engine, "do_connect", _Fallback().do_connect)


_engines: weakref.WeakSet[sa.Engine] = weakref.WeakSet()
_lock = threading.Lock()


class _Fallback:
    """One engine's ``do_connect`` listener, and whether its options were refused."""

    def __init__(self) -> None:
        self.refused = False

    def do_connect(
        self, dialect: sa.Dialect, record: t.Any, cargs: list[t.Any], cparams: dict[str, t.Any]
    ) -> t.Any:
        connection_class = cparams.pop(CONNECTION_CLASS, None)
        connect = dialect.connect if connection_class is None else connection_class.connect
        own_options = cparams.get("options")
        record.info[SETTINGS] = STARTUP_MARKER in str(own_options or "")
        if not record.info[SETTINGS]:
            # The application's engine: the marker alone, so that a pooled session is told
            # apart from a direct one; its own settings are its own.
            cparams["options"] = f"{own_options or ''} {startup_option()}".strip()
        if not self.refused:
            try:
                connection = connect(*cargs, **cparams)
            except dialect.loaded_dbapi.OperationalError as exc:
                if _REFUSED not in str(exc):
                    raise
                self.refused = True
                log.info(
                    "the server refused start-up options (a transaction pooler?): going without"
                )
            else:
                record.info[SENT] = True
                return connection
        if record.info[SETTINGS] or own_options is None:
            cparams.pop("options")
        else:
            cparams["options"] = own_options  # the application's: refused as they were before
        record.info[SENT] = False
        return connect(*cargs, **cparams)


def behind_pooler(dbapi_connection: t.Any, record: t.Any) -> bool:
    """Whether a new session of a store engine lacks the start-up marker it sent (refused or
    dropped by a pooler): then it gets no session ``SET`` (see the module docstring), prepares
    no statement, its transactions begin READ COMMITTED (on flask_idem's own engines only: the
    application's keep their isolation), and a missing role setting is warned of once.

    A session of an engine that sent no marker (no store prepared it) is not judged: False.
    """
    sent = record.info.get(SENT)
    if sent is None:
        return False
    autocommit = dbapi_connection.autocommit
    dbapi_connection.autocommit = True
    try:
        with dbapi_connection.cursor() as cursor:
            cursor.execute(_SESSION_QUERY, (STARTUP_MARKER,))
            marker, *values = cursor.fetchone()
    finally:
        if not dbapi_connection.closed:
            dbapi_connection.autocommit = autocommit
    if sent and marker == "on":
        return False
    if record.info.get(SETTINGS):
        # The claim functions insist on READ COMMITTED; the driver says so in each BEGIN,
        # never with a session SET (psycopg2 >= 2.7, psycopg 3).
        dbapi_connection.isolation_level = _read_committed(dbapi_connection)
    if hasattr(dbapi_connection, "prepare_threshold"):
        # psycopg 3 prepares a statement run often; the next transaction may be on another
        # server connection, which never saw it (PgBouncer 1.18 keeps no prepared statements).
        dbapi_connection.prepare_threshold = None
    _warn_missing_role_settings(values)
    return True


def _read_committed(dbapi_connection: t.Any) -> t.Any:
    """The driver's READ COMMITTED constant for ``dbapi_connection``."""
    import psycopg2.extensions

    if isinstance(dbapi_connection, psycopg2.extensions.connection):
        return psycopg2.extensions.ISOLATION_LEVEL_READ_COMMITTED
    import psycopg

    return psycopg.IsolationLevel.READ_COMMITTED


def _warn_missing_role_settings(values: list[str]) -> None:
    global _warned
    settings = zip(_ROLE_SETTINGS, values, strict=True)
    missing = [name for (name, wanted), value in settings if not wanted(value)]
    if not missing or _warned:
        return
    _warned = True
    log.warning(
        "store sessions run behind a transaction pooler without %s on the role: claims bound "
        "their own transaction, other store statements have no bound on the server and may "
        "reach the server log with their parameters; set them on the role "
        "(ALTER ROLE ... SET, docs/operations.md, 'Behind a pooler')",
        ", ".join(missing),
    )
