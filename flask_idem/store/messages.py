"""What a database failure may say in a log line, a CLI error or a problem detail.

A failed statement carries what must never be logged: SQLAlchemy's ``StatementError`` prints
the statement and its parameters (the raw idempotency key, the claim token) unless the engine
was built with ``hide_parameters`` (an application's own Flask-SQLAlchemy engine is not), and
the server's message may quote a row (PostgreSQL's ``Key (...)=(...)`` detail). Everything
flask_idem logs or shows about an exception goes through :func:`describe` or
:func:`redacted` (an ``exc_info`` for log calls), which keep the class names, the code lines
of the traceback and the database's own words only.
"""

from __future__ import annotations

import types
import typing as t

import sqlalchemy as sa

from ..core.errors import IdempotencyError

#: SQLSTATE classes whose messages may quote the values of a row (data exceptions, integrity
#: violations): only their name is shown.
_VALUE_BEARING = ("22", "23")
#: Modules of the drivers' own exceptions (the cause of SQLAlchemy's ``DBAPIError``).
_DRIVERS = ("psycopg2", "psycopg", "sqlite3")


def database_message(exc: BaseException, *, rows: bool = True) -> str | None:
    """The database's own words for the failure behind ``exc`` (its cause chain), or None.

    PostgreSQL's primary message and detail (Citus explains its refusals in the detail), one
    line, so that an operator sees why a statement failed; never the statement or its
    parameters, and, unless ``rows`` is False (DDL that touches no row's values, such as
    ``flask idem citus``), never the messages of the classes that may quote a row's values.
    """
    for error in _chain(exc):
        if isinstance(error, sa.exc.DBAPIError):
            return _driver_words(error.orig, rows=rows)
    return None


def describe(exc: BaseException) -> str:
    """``exc`` and its causes in one line, safe to log: each one's class name, for a driver's
    error the database's words as :func:`database_message` shows them, for flask_idem's own
    errors their message."""
    return "; caused by ".join(_line(error) for error in _chain(exc))


class Redacted(Exception):
    """An exception as flask_idem logs it: the message is :func:`describe` of the original,
    the traceback the original's frames (code lines, never values), and nothing chained."""


ExcInfo = tuple[type[BaseException], BaseException, types.TracebackType | None]


def redacted(exc: BaseException) -> ExcInfo:
    """``exc_info`` for a log call about ``exc`` (``log.error(..., exc_info=redacted(exc))``).

    An exception with a database error anywhere in its chain (what Python's traceback
    prints: causes and contexts) is replaced by a :class:`Redacted` with the traceback of
    ``exc`` and the chain rendered by :func:`describe`; any other is logged as it is (it
    holds no statement).
    """
    chain = _chain(exc)
    if not any(isinstance(error, sa.exc.SQLAlchemyError) or _is_driver(error) for error in chain):
        return type(exc), exc, exc.__traceback__
    return Redacted, Redacted(describe(exc)), exc.__traceback__


def _chain(exc: BaseException) -> list[BaseException]:
    """``exc``, then what caused it (``raise ... from``, or the exception being handled), as
    far as Python's traceback would print it."""
    chain: list[BaseException] = []
    error: BaseException | None = exc
    while error is not None and all(error is not seen for seen in chain):
        chain.append(error)
        error = error.__cause__ or (None if error.__suppress_context__ else error.__context__)
    return chain


def _is_driver(error: BaseException) -> bool:
    return type(error).__module__.split(".")[0] in _DRIVERS


def _line(error: BaseException) -> str:
    name = type(error).__name__
    if isinstance(error, sa.exc.SQLAlchemyError):
        # Its message repeats the statement, the parameters and the driver's whole message.
        return f"{name} (statement not shown)"
    if _is_driver(error):
        words = _driver_words(error)
        return f"{name}: {words}" if words else name
    if isinstance(error, IdempotencyError) and str(error):
        return f"{name}: {error}"  # flask_idem's own messages name no values
    # Another exception chained with a database error may quote it (``f"failed: {exc}"``).
    return name


def _driver_words(driver_error: t.Any, *, rows: bool = True) -> str | None:
    """A driver error's primary message and detail, one line; only its class and SQLSTATE
    when its class may quote a row's values (and ``rows`` says the statement read some)."""
    diagnostics = getattr(driver_error, "diag", None)
    code = str(
        getattr(driver_error, "pgcode", None)
        or getattr(driver_error, "sqlstate", None)
        or getattr(diagnostics, "sqlstate", None)
        or ""
    )
    if rows and code[:2] in _VALUE_BEARING:
        return f"{type(driver_error).__name__} (SQLSTATE {code})"
    if diagnostics is None or diagnostics.message_primary is None:
        text = str(driver_error).strip()
        return text.splitlines()[0] if text else None
    parts = [diagnostics.message_primary, diagnostics.message_detail]
    return ": ".join(" ".join(part.split()) for part in parts if part)
