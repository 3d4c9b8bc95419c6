"""A queue worker for ``tests/e2e/test_job_processes.py``: ``python -m tests.support.job_worker``.

It serves the sample app's ``renew_subscription`` job in a plain process (an app context, no
request), one message at a time: a JSON line ``{"id": ..., "args": {...}}`` on stdin, then one
line on stdout, ``{"id": ..., "ack": result}`` or ``{"id": ..., "retry": "JobInProgress"}``
(the queue redelivers it later). ``DATABASE_URL`` names the sample database.
"""

from __future__ import annotations

import json
import sys

from flask_idem.core.errors import JobError
from sample_app import create_app
from sample_app.jobs import renew_subscription


def main() -> None:
    app = create_app()
    with app.app_context():
        print(json.dumps({"ready": True}), flush=True)
        for line in sys.stdin:
            message = json.loads(line)
            try:
                answer = {"ack": renew_subscription(**message["args"])}
            except JobError as exc:
                answer = {"retry": type(exc).__name__}
            print(json.dumps({"id": message["id"], **answer}), flush=True)


if __name__ == "__main__":
    main()
