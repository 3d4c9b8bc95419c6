"""The names on the wire that the server writes and the client reads.

The headers flask_idem adds to an answer and the problem names a client decides on, in one
place with no Flask import: the server (:mod:`flask_idem.web.flow`, :mod:`flask_idem.core.problem`),
the client (:mod:`flask_idem.client`) and the test helpers (:mod:`flask_idem.testing`) read them
from here, so a rename cannot leave one side behind.
"""

from __future__ import annotations

import typing as t

#: The request header a client sends its key in, unless the server says otherwise
#: (``IDEMPOTENCY_HEADER``).
KEY_HEADER: t.Final = "Idempotency-Key"
#: On a stored answer given back to a retry: ``true``.
REPLAYED_HEADER: t.Final = "Idempotent-Replayed"
#: On an answer of a request that held the key: ``false`` when no retry will get it back.
STORED_HEADER: t.Final = "Idempotent-Stored"
#: On a stored first answer and on replays: whole seconds the key still replays the answer.
RETENTION_HEADER: t.Final = "Idempotency-Retention"
#: 409: the first request with the key is still running.
IN_PROGRESS: t.Final = "request-in-progress"
#: 409: an attempt may have taken effect and its outcome is not settled yet.
OUTCOME_PENDING: t.Final = "outcome-pending"
