"""The commit guard: an attempt that committed anything itself is never released.

Whatever a protected view writes in its business transaction (``idem.connection()``, or
``db.session`` with ``db=``) commits with its stored response, or rolls back with the attempt.
A commit of the view's own publishes the rows first. A durable view on the store's own
connection may do it (SQLAlchemy 2.0's commit as you go: the completion then runs in the next
transaction), but the attempt can then never prove it committed nothing: a failure afterwards
leaves the key ``unknown``, never released, or every retry would commit the rows again. An
atomic view's own commit would publish its claim half-way (or, on PostgreSQL, the rows without
any record), and ``db.session``'s transaction is the session's to settle: those are refused.
What counts, on the business transaction of a claimed attempt:

- ``Connection.commit()`` (also of the session's connection; ``db.session.commit()`` itself is
  refused in every view by :mod:`flask_idem.sessions`);
- a statement that ends the transaction (``COMMIT``, ``END``, ``ROLLBACK``, ``ABORT``,
  ``PREPARE TRANSACTION``, in any case, after comments, inside a multi-statement string);
  ``SAVEPOINT``, ``RELEASE SAVEPOINT`` and ``ROLLBACK TO SAVEPOINT`` end nothing;
- a transaction ended below SQLAlchemy, which :func:`ended_outside` tells when the attempt
  answers or gives up: the driver connection's own ``commit()`` or ``rollback()``, a
  ``COMMIT`` or ``ROLLBACK`` sent through a raw driver cursor (psycopg 3's
  ``Connection.execute`` too), also when the view wrote again after it. psycopg2 and
  psycopg 3 leave nothing to tell such an end from a transaction that never started, so the
  PostgreSQL store engine's driver connections count them
  (:mod:`flask_idem.store.commit_count`; zeroed when the attempt claims, or opens its business
  transaction later); SQLite's store transactions all begin with an explicit ``BEGIN``, so
  sqlite3 shows one ended as no transaction at all. Such an attempt's answer is never stored
  (its rows did not commit with it) and the key is left ``unknown``, atomic or durable;
- a commit on *another* connection of the store's engine in the attempt's context while it
  runs (``with db.engine.begin()``, ``Session(db.engine)``, a raw pooled driver connection),
  flask_idem's own store statements aside: its rows stay, so the attempt is never released.

A view that replaced ``db.session`` (``db.session.remove()``) is never released either
(:meth:`flask_idem.attempt.Attempt.note_replaced_session`): the fresh session is no business
transaction, so its commits are neither refused nor seen.

In an atomic view, and on ``db.session``'s connection, the first two raise
:class:`~flask_idem.sessions.SessionSettled` before anything commits (a crash of the view; a
refused ``commit()`` rolls the transaction back, so the view's answer is never stored even when
it catches the exception). So do the PostgreSQL store connections' own ends below SQLAlchemy
(:func:`_refuse_below`, installed into :mod:`.store.commit_count`): seen only afterwards, a
process killed in between would leave the rows published without their record. Otherwise
they, and a commit on another connection, set :attr:`~flask_idem.attempt.Attempt.committed`.

The checks wrap the store engine's dialect (``do_commit``, ``do_rollback``, ``do_execute``)
instead of listening to connection events, in :mod:`flask_idem.store.fast_path` (the one
module that reaches below SQLAlchemy's public API; it says what that saves). With
``IDEMPOTENCY_SQLALCHEMY_FAST_PATH`` off they are SQLAlchemy event listeners (:func:`_listen`),
the same checks on public API. A statement is
looked at only when a cheap prefilter (:func:`flask_idem.store.statements.may_end`) finds one
of those words at its start or after a ``;``; the raw cursors of the PostgreSQL store
connections run the same prefilter. Counting the driver's commits and rollbacks costs one
Python call and a context variable per commit or rollback.
"""

from __future__ import annotations

import re
import typing as t

import sqlalchemy as sa
from flask import has_app_context

from .sessions import SessionSettled, business_connections
from .state import current_attempt
from .store import commit_count, fast_path
from .store.statements import ends_transaction, may_end

if t.TYPE_CHECKING:
    from .attempt import Attempt


def guard_commits(engine: sa.Engine, *, fast: bool = True) -> None:
    """Refuse a claimed attempt's own end of its business transaction on ``engine`` (once per
    engine, which several applications may share).

    ``fast`` (``IDEMPOTENCY_SQLALCHEMY_FAST_PATH``): the dialect is wrapped
    (:func:`flask_idem.store.fast_path.wrap_dialect`); off, the same checks listen to
    SQLAlchemy's public events (:func:`_listen`), at the cost of SQLAlchemy dispatching
    events around every statement of the engine.
    """
    fast_path.open_counting(engine)
    if fast:
        fast_path.wrap_dialect(engine, _GUARD)
    else:
        _listen(engine)


def _listen(engine: sa.Engine) -> None:
    """The commit guard on public API: the ``commit`` event refuses or notes a commit before
    it happens, ``before_cursor_execute`` a statement ending the transaction; every end
    SQLAlchemy makes itself (``commit``, ``rollback``, the pool's reset of a returned
    connection) is announced to the driver's count first, which leaves it out
    (:func:`.store.commit_count.sqlalchemy_ends_next`)."""
    if sa.event.contains(engine, "commit", _on_commit):
        return
    sa.event.listen(engine, "commit", _on_commit)
    sa.event.listen(engine, "rollback", _on_rollback)
    sa.event.listen(engine, "before_cursor_execute", _on_statement)
    sa.event.listen(engine, "reset", _on_reset)
    sa.event.listen(engine, "checkout", _on_checkout)


def _on_commit(connection: sa.Connection) -> None:
    pooled = connection.connection  # what the dialect's do_commit is given

    def rollback() -> None:
        commit_count.through_sqlalchemy(lambda: connection.dialect.do_rollback(pooled))

    _GUARD.before_commit(pooled, rollback)
    commit_count.sqlalchemy_ends_next(pooled.dbapi_connection)


def _on_rollback(connection: sa.Connection) -> None:
    _note_rollback(lambda c: c is connection)
    if not connection.closed and not connection.invalidated:
        commit_count.sqlalchemy_ends_next(connection.connection.dbapi_connection)


def _on_statement(
    connection: sa.Connection,
    cursor: t.Any,
    statement: str,
    parameters: t.Any,
    context: t.Any,
    executemany: bool,
) -> None:
    if _refuse_ending(statement, connection):
        commit_count.sqlalchemy_ends_next(connection.connection.dbapi_connection)


def _on_reset(dbapi_connection: t.Any, _record: t.Any, state: t.Any) -> None:
    if not state.transaction_was_reset and not state.terminate_only:
        commit_count.sqlalchemy_ends_next(dbapi_connection)


def _on_checkout(dbapi_connection: t.Any, _record: t.Any, _proxy: t.Any) -> None:
    commit_count.forget_announced_end(dbapi_connection)


class _Guard:
    """The commit guard's answers to the wrapped dialect (:class:`.fast_path.DialectGuard`)."""

    @staticmethod
    def before_commit(dbapi_connection: t.Any, rollback: t.Callable[[], None]) -> None:
        attempt = _running_attempt()
        if attempt is None:
            return
        if not _business(attempt, lambda c: c.connection is dbapi_connection):
            _note_elsewhere(attempt)
        elif _refused(attempt):
            # SQLAlchemy counts a failed commit's transaction as over and would never roll
            # it back (SQLite's write lock held until the pool resets the connection): roll
            # back here. The view's writes are gone, so its answer is never stored.
            rollback()
            attempt.lose_work()
            raise SessionSettled(
                "an atomic view, or one whose business transaction is db.session's, must not "
                "commit it: flask_idem commits it with the stored response"
            )
        else:
            attempt.note_committed()  # commit as you go: allowed, but never released after it

    @staticmethod
    def before_rollback(dbapi_connection: t.Any) -> None:
        _note_rollback(lambda c: c.connection is dbapi_connection)

    @staticmethod
    def ending(statement: str, connection: sa.Connection) -> bool:
        return _refuse_ending(statement, connection)

    through_sqlalchemy = staticmethod(commit_count.through_sqlalchemy)


_GUARD = _Guard()
#: An ending statement that may be a rollback (``ROLLBACK``, ``ABORT``), not only a commit.
_ROLLS_BACK = re.compile(r"\b(rollback|abort)\b", re.IGNORECASE)


def _refuse_ending(statement: str, connection: sa.Connection) -> bool:
    """Refuse, or note, a statement of the business transaction that ends it. True when the
    statement ends a transaction: the guard looked at it, so the driver's count leaves it out
    (see :mod:`.store.commit_count`)."""
    if not may_end(statement) or not ends_transaction(statement):
        return False
    attempt = _running_attempt()
    if attempt is None:
        return True
    if not _business(attempt, lambda c: c is connection):
        _note_elsewhere(attempt)
    elif _refused(attempt):
        raise SessionSettled(
            "an atomic view, or one whose business transaction is db.session's, must not end "
            "it with a statement (COMMIT, END, ROLLBACK): flask_idem commits it with the "
            "stored response"
        )
    else:
        attempt.note_committed()  # it may commit: from now on the attempt is never released
        if _ROLLS_BACK.search(statement) is not None:
            attempt.note_rolled_back()  # or it rolled back what the view wrote
    return True


def _note_rollback(is_it: t.Callable[[sa.Connection], bool]) -> None:
    """A rollback of the business transaction by the view or a hook (flask_idem's own is not
    seen here): what it wrote before is gone (see :attr:`.Attempt.rolled_back`)."""
    attempt = _running_attempt()
    if attempt is not None and _business(attempt, is_it):
        attempt.note_rolled_back()


def _refuse_below(dbapi_connection: t.Any) -> None:
    """Refuse an end below SQLAlchemy of a refused business transaction before it happens:
    seen only afterwards, a process killed in between would leave the rows published without
    their record, and the retry would run again."""
    attempt = _running_attempt()
    if attempt is None or not _refused(attempt):
        return
    if _business(attempt, lambda c: c.connection.dbapi_connection is dbapi_connection):
        raise SessionSettled(
            "an atomic view, or one whose business transaction is db.session's, must not end "
            "it through the driver (commit(), rollback(), COMMIT through a cursor): flask_idem "
            "commits it with the stored response"
        )


commit_count.refuse_ends_with(_refuse_below)


def _note_elsewhere(attempt: Attempt) -> None:
    """A commit on another connection of the store's engine, in the attempt's context: what
    it wrote stays whatever the attempt does next (flask_idem's own primitives aside)."""
    if not commit_count.in_store_primitive():
        attempt.note_committed()


def _refused(attempt: Attempt) -> bool:
    """An atomic claim would be published half-way; a session's transaction is the session's
    to settle (as ``db.session.commit()``, refused by :mod:`flask_idem.sessions`)."""
    return attempt.atomic or attempt.session is not None


def _running_attempt() -> Attempt | None:
    """The claimed attempt of this context while its view or job runs (flask_idem's own
    commit and rollback of it are not the view's)."""
    if not has_app_context():
        return None
    attempt = current_attempt()
    if attempt is None or not attempt.guarding:
        return None
    return attempt


def _business(attempt: Attempt, is_it: t.Callable[[sa.Connection], bool]) -> bool:
    """Whether ``is_it`` picks out one of the attempt's business connections."""
    return any(is_it(c) for c in _connections(attempt))


def _connections(attempt: Attempt) -> list[sa.Connection]:
    found = [] if attempt.connection is None else [attempt.connection]
    if attempt.session is not None:
        found += business_connections(attempt.session)
    return [c for c in found if not c.closed and not c.invalidated]


def count_commits_from_now(attempt: Attempt) -> None:
    """The attempt claimed: an end of its business transaction below SQLAlchemy counts from
    here (one opened later is counted from its start, see :func:`.commit_count.zero`), and so
    does a driver's commit on any connection of the store's engine in this context."""
    attempt.tally = commit_count.tally_attempt()
    for connection in _connections(attempt):
        commit_count.zero(connection)


def count_ends_from_start(connection: sa.Connection) -> None:
    """A business transaction opened after the claim: an end of it below SQLAlchemy counts
    from its start."""
    commit_count.zero(connection)


def committed_elsewhere(attempt: Attempt) -> bool:
    """Whether the attempt's context committed below SQLAlchemy on some connection of the
    store's engine (``commit()`` of a driver connection, a raw cursor's ``COMMIT``)."""
    return attempt.tally is not None and attempt.tally.commits > 0


def ended_outside(attempt: Attempt) -> bool:
    """Whether the attempt's business transaction was committed or rolled back below
    SQLAlchemy, behind the guard's back (how each driver shows it:
    :func:`.store.commit_count.ended_below`)."""
    return any(commit_count.ended_below(connection) for connection in _connections(attempt))
