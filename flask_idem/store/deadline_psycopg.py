"""The client-side deadline of :mod:`.engines` for psycopg 3 connections (``postgresql+psycopg``).

psycopg 3 runs every wait for the server (statements, fetches of a server-side cursor, COPY,
commit, rollback) through one method, :meth:`psycopg.Connection.wait`, so a connection class
that arms the :class:`~flask_idem.store.engines.Watchdog` around it bounds them all. Imported
only for psycopg 3 engines: psycopg 3 is not a dependency.
"""

from __future__ import annotations

import functools
import math
import time
import typing as t

import psycopg

from .commit_count import psycopg_class
from .engines import WATCHDOG


class DeadlineExceeded(psycopg.OperationalError):
    """The server did not answer a store connection within its deadline (a disconnect)."""


class DeadlineConnection(psycopg_class()):  # type: ignore[misc]
    """A psycopg 3 connection whose waits for the server end after a deadline, and which
    counts the ends of its transactions (:mod:`.commit_count`)."""

    #: Seconds any one operation after connecting may wait.
    flask_idem_deadline: float
    #: When the connection's setup must be over (see :func:`.engines.end_of_setup`).
    flask_idem_setup_ends = math.inf

    @classmethod
    def connect(cls, *args: t.Any, **kwargs: t.Any) -> t.Any:
        connection = super().connect(*args, **kwargs)
        connection.flask_idem_setup_ends = time.monotonic() + cls.flask_idem_deadline
        return connection

    def wait(self, gen: t.Any, *args: t.Any, **kwargs: t.Any) -> t.Any:
        if self.closed:
            return super().wait(gen, *args, **kwargs)
        wait = super().wait
        return WATCHDOG.bound(
            self, self.pgconn.socket, DeadlineExceeded, wait, gen, *args, **kwargs
        )


@functools.cache
def connection_class(deadline: float) -> type[DeadlineConnection]:
    """The connection class of an engine whose operations wait at most ``deadline`` seconds
    (connecting is bounded by libpq's ``connect_timeout``)."""
    return type(
        f"DeadlineConnection{int(deadline * 1000)}ms",
        (DeadlineConnection,),
        {"flask_idem_deadline": deadline},
    )
