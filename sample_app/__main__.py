"""``python -m sample_app --port N``: serve the sample app for ``make run``."""

from __future__ import annotations

import argparse

from . import create_app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=5000)
    args = parser.parse_args()
    print(f"Serving the sample app on http://{args.host}:{args.port}/")
    create_app().run(host=args.host, port=args.port, threaded=True)


if __name__ == "__main__":
    main()
