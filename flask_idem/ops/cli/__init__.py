"""``flask idem ...``: partition upkeep, stuck requests, inspection, release, reconciliation, the
next-day audit against downstream services, distribution over Citus and encryption keys.

Every command prints for a terminal by default and JSON with ``--json`` (for scripts and
alerting), and exits non-zero when the store fails. The table holds no raw key: a record is
named by its key hash (the ``key_hash`` of the logs and signals), ``--show-keys`` prints keys
as stored (digests), and an operator who has the raw key types it on standard input (never on
the command line), where the command digests it as the claim did; stored bodies only with
``IDEMPOTENCY_INSPECT_BODIES``.

One module per command group: :mod:`.upkeep`, :mod:`.records`, :mod:`.settle`,
:mod:`.encryption_keys` (``flask idem keys``); ``flask idem db`` is
:mod:`flask_idem.ops.migrate`'s; what they share is in :mod:`.common`.
"""

from __future__ import annotations

# Importing the modules registers their commands on the group.
from . import encryption_keys, records, settle, upkeep
from .common import idem_group

__all__ = ["encryption_keys", "idem_group", "records", "settle", "upkeep"]
