"""A client process for ``tests/e2e/test_outbox_e2e.py``: ``python -m tests.support.outbox_client``.

``send DATABASE BASE_URL OPERATION CUSTOMER`` commits one payment operation to the outbox in
DATABASE and sends it; ``resume DATABASE BASE_URL`` sends every pending one. Either way it starts
with the API key in ``OUTBOX_API_KEY`` and refreshes to the sample app's ``sk_test_alpha`` on a
401, then prints the operations it finished with as one JSON line. The test kills it with SIGKILL
at the points it wants, so nothing it holds in memory survives.
"""

from __future__ import annotations

import json
import os
import sys

import httpx
import sqlalchemy as sa

from flask_idem.client import IdempotentClient, RetryPolicy
from flask_idem.outbox import Outbox


def main(command: str, database: str, base_url: str, *operation: str) -> None:
    engine = sa.create_engine(database)
    outbox = Outbox(engine)
    outbox.create_table()
    http = httpx.Client(
        base_url=base_url,
        headers={"Authorization": f"Bearer {os.environ['OUTBOX_API_KEY']}"},
        timeout=120,
    )
    client = IdempotentClient(
        http,
        policy=RetryPolicy(max_attempts=4, total_timeout=60, base_delay=0.05, max_delay=0.2),
        refresh_credentials=lambda response: {"Authorization": "Bearer sk_test_alpha"},
    )
    if command == "send":
        name, customer = operation
        payment = {"amount": 4200, "currency": "usd", "customer": customer}
        entries = [outbox.send(client, name, "POST", "/v1/payments", json=payment)]
    else:
        entries = outbox.resume(client)
    print(
        json.dumps(
            [
                {
                    "operation": entry.operation,
                    "state": entry.state.value,
                    "status": entry.response_status,
                    "body": entry.json() if entry.done else None,
                }
                for entry in entries
            ]
        ),
        flush=True,
    )
    engine.dispose()


if __name__ == "__main__":
    main(*sys.argv[1:])
