"""Blinker signals sent by flask_idem, one per state transition, with the application as sender.

Receivers get keyword arguments ``event`` (the transition's name, as in the table below),
``tenant``, ``endpoint``, ``key_hash`` (never the raw key, which is a client-chosen value that
may be logged widely), ``fingerprint`` (the first 12 hex digits of the request's fingerprint,
or None), ``state`` (the record's state afterwards, None when it was deleted), ``replayed``,
``status`` (the HTTP status answered or stored, when there is one) and ``duration`` (seconds:
of the claim for claim-time decisions, of the view or job since its claim for the end of an
attempt; None outside a request or job), plus signal-specific ones (``reason``, ``stored``,
``stage``, ``actor``, ``action``). Each transition is also logged once on the
``flask_idem.events`` logger (see :mod:`flask_idem.events`).
"""

from __future__ import annotations

from blinker import Namespace

_signals = Namespace()

#: A request took a key and its view is about to run.
claimed = _signals.signal("idempotency-claimed")
#: A retry took over a record nobody owned (expired lease, unknown, reopened) to run it again.
taken_over = _signals.signal("idempotency-taken-over")
#: A response snapshot was stored (``status``), or marked unstorable (``stored=False``).
completed = _signals.signal("idempotency-completed")
#: A retry got the stored response back (``status``).
replayed = _signals.signal("idempotency-replayed")
#: A duplicate arrived while the first request still ran (409 ``request-in-progress``).
conflict = _signals.signal("idempotency-conflict")
#: A retry of an operation whose outcome is unknown was refused (409 ``outcome-pending``).
pending = _signals.signal("idempotency-pending")
#: A retry of an operation whose response was not stored was refused (409
#: ``response-not-stored``).
not_stored = _signals.signal("idempotency-not-stored")
#: A key came back with a different request (422 ``idempotency-key-reused``).
mismatch = _signals.signal("idempotency-mismatch")
#: A new key was refused over its tenant's limit (429 ``idempotency-key-rate-limited``);
#: nothing was claimed.
rate_limited = _signals.signal("idempotency-rate-limited")
#: A key was given back so that a retry executes afresh (``reason``).
released = _signals.signal("idempotency-released")
#: A request ended with a possible side effect and no stored outcome (``reason``).
unknown = _signals.signal("idempotency-unknown")
#: A request lost its lease to a takeover before it could store its answer (409).
lease_lost = _signals.signal("idempotency-lease-lost")
#: The store failed (``stage``: ``claim``, ``complete`` or ``give_up``).
store_unavailable = _signals.signal("idempotency-store-unavailable")
#: A stuck record was settled from outside its request (``actor``: ``reconciler`` or
#: ``operator``; ``action``: ``completed``, ``reopened``).
settled = _signals.signal("idempotency-settled")
