"""Observers (signal receivers, tracers) never change an outcome.

A receiver or an OpenTelemetry span processor that raises must not turn a stored 201 into a
500, leave a view that never ran ``unknown``, or keep a job's lease renewed forever: its
exception is logged once per observer and exception type, by the exception's class only (its
message may quote a key or a body), and flask_idem goes on.
"""

from __future__ import annotations

import logging
import threading
import typing as t

log = logging.getLogger("flask_idem.observers")

_reported: set[tuple[str, str]] = set()
_reported_lock = threading.Lock()


def observer_name(observer: t.Any) -> str:
    """``module.qualname`` of a receiver or a trace, for the log (never its arguments)."""
    kind = observer if callable(observer) and hasattr(observer, "__qualname__") else type(observer)
    return f"{getattr(kind, '__module__', '?')}.{getattr(kind, '__qualname__', repr(kind))}"


def call_observer(name: str, call: t.Callable[[], t.Any], *, key_hash: str | None = None) -> None:
    """Run ``call``; an ``Exception`` from it is reported (see the module) and swallowed."""
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - an observer must never change an outcome
        error = f"{type(exc).__module__}.{type(exc).__qualname__}"
        with _reported_lock:
            first = (name, error) not in _reported
            _reported.add((name, error))
        if first:
            log.error(
                "observer %s raised %s (ignored: observers never change an outcome; "
                "logged once per observer and exception type)",
                name,
                error,
                extra={"observer": name, "error": error, "key_hash": key_hash},
            )
