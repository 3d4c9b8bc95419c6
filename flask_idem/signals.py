"""Blinker signals sent by flask_idem, with the application as sender.

Receivers get ``tenant``, ``endpoint`` and ``key_hash`` (never the raw key, which is a
client-chosen value that may be logged widely) plus signal-specific keyword arguments.
"""

from __future__ import annotations

from blinker import Namespace

_signals = Namespace()

#: A request took a key and its view is about to run.
claimed = _signals.signal("idempotency-claimed")
#: A response snapshot was stored (``status``), or marked unstorable (``stored=False``).
completed = _signals.signal("idempotency-completed")
#: A retry got the stored response back (``status``).
replayed = _signals.signal("idempotency-replayed")
#: A duplicate arrived while the first request still ran (409 ``request-in-progress``).
conflict = _signals.signal("idempotency-conflict")
#: A key came back with a different request (422 ``idempotency-key-reused``).
mismatch = _signals.signal("idempotency-mismatch")
#: A key was given back so that a retry executes afresh (``reason``).
released = _signals.signal("idempotency-released")
#: A request ended with a possible side effect and no stored outcome (``reason``).
unknown = _signals.signal("idempotency-unknown")
