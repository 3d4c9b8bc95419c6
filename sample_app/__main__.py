"""``python -m sample_app --port N``: serve the sample app for ``make run``.

It prints three curl commands to try: a first payment, its retry (replayed) and the same key
with another amount (refused). The key is new on every start, so the first command really is
a first request even when the database already holds earlier runs.
"""

from __future__ import annotations

import argparse
import secrets
import shlex

from . import create_app

API_KEY = "sk_test_alpha"


def curl_commands(base_url: str, key: str) -> list[str]:
    """The three commands of README's "Try it in five minutes"."""

    def post(amount: int) -> str:
        body = f'{{"amount": {amount}, "currency": "eur", "customer": "cus_42"}}'
        return " ".join(
            [
                "curl -i",
                shlex.quote(f"{base_url}/v1/payments"),
                "-H",
                shlex.quote(f"Authorization: Bearer {API_KEY}"),
                "-H",
                shlex.quote(f"Idempotency-Key: {key}"),
                "-H",
                shlex.quote("Content-Type: application/json"),
                "-d",
                shlex.quote(body),
            ]
        )

    return [post(4200), post(4200), post(9900)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=5000)
    args = parser.parse_args()
    app = create_app()
    base_url = f"http://{args.host}:{args.port}"
    first, replay, reuse = curl_commands(base_url, f"demo-{secrets.token_hex(4)}")
    print(
        f"Serving the sample app on {base_url}/\n\n"
        f"# 1. A first payment: 201 Created\n{first}\n\n"
        f"# 2. The same request again: the stored 201, with Idempotent-Replayed: true\n"
        f"{replay}\n\n"
        f"# 3. The same key with another amount: 422 idempotency-key-reused\n{reuse}\n",
        flush=True,
    )
    app.run(host=args.host, port=args.port, threaded=True)


if __name__ == "__main__":
    main()
