"""``python -m bench [run] [--quick]``, ``python -m bench growth``, ``python -m bench sealing``,
``python -m bench profile``, ``python -m bench instructions``, ``python -m bench report``.

``run`` (the default) is ``make bench``; ``--quick`` is ``make bench-quick``. ``growth`` fills
the table to millions of records and times the claim and partition expiry. ``sealing``
measures compression and encryption of stored responses, on and off (``make bench
BENCH_MODE=sealing``). ``profile`` shows where one request's CPU and SQL time go, per app
(:mod:`bench.profile`). ``instructions`` counts each app's CPU instructions per request under
valgrind, the same on every run (:mod:`bench.instructions`). ``report FILE`` re-prints a
results file, ``--markdown`` as the table for README.
"""

from __future__ import annotations

import argparse
import json
import sys
import typing as t
from pathlib import Path

from . import report


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(",") if part)


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(part) for part in text.split(",") if part)


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    commands = parser.add_subparsers(dest="command")

    run = commands.add_parser("run", help="the A/B bench (default)")
    run.add_argument("--quick", action="store_true", help="fewer, shorter rounds (< 1 minute)")
    run.add_argument("--rounds", type=int)
    run.add_argument("--seconds", type=float, help="time limit of one run")
    run.add_argument("--requests", type=int, help="request limit of one run")
    run.add_argument("--workers", type=int, help="gunicorn sync workers per app (4)")
    run.add_argument("--concurrency", type=_ints, help="comma-separated, e.g. 1,8")
    run.add_argument("--storms", type=int)
    run.add_argument("--client", choices=("auto", "wrk", "python"))
    run.add_argument("--output", type=Path, help="directory for the JSON (bench/results)")

    growth = commands.add_parser("growth", help="claim latency at 1, 5 and 10 million records")
    growth.add_argument("--sizes", type=_floats, default=(1, 5, 10), help="millions, e.g. 1,5,10")
    growth.add_argument("--samples", type=int, default=400, help="claims timed per size and kind")
    growth.add_argument("--drop-rows", type=int, default=1_000_000, help="rows in the day dropped")
    growth.add_argument("--output", type=Path)

    sealing = commands.add_parser(
        "sealing", help="cost of compression and encryption of stored responses, on and off"
    )
    sealing.add_argument("--quick", action="store_true", help="fewer iterations (< 1 minute)")
    sealing.add_argument("--output", type=Path)

    prof = commands.add_parser("profile", help="CPU and SQL time per request, per app (cProfile)")
    prof.add_argument("--requests", type=int, default=1_000, help="requests per app and scenario")
    prof.add_argument("--apps", type=lambda text: tuple(text.split(",")), default=())
    counted = commands.add_parser(
        "instructions", help="app instructions per request, per app (valgrind; deterministic)"
    )
    counted.add_argument("--requests", type=int, default=100, help="requests per app and scenario")
    counted.add_argument("--apps", type=lambda text: tuple(text.split(",")), default=())
    counted.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    trail = commands.add_parser("trail", help="the audit trail (IDEMPOTENCY_AUDIT) on and off")
    trail.add_argument("--quick", action="store_true", help="fewer operations (< 1 minute)")
    trail.add_argument("--output", type=Path)

    show = commands.add_parser("report", help="re-print a results file")
    show.add_argument("file", type=Path)
    show.add_argument("--markdown", action="store_true")

    if not argv or argv[0] not in (
        "run",
        "growth",
        "sealing",
        "profile",
        "instructions",
        "trail",
        "report",
        "-h",
        "--help",
    ):
        argv = ["run", *argv]
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse(argv)
    if args.command == "report":
        document = json.loads(args.file.read_text())
        if document.get("kind") == "growth":
            from .growth import format_text as growth_text

            print(growth_text(document))
        elif document.get("kind") == "trail":
            from .trail import format_text as trail_text

            print(trail_text(document))
        elif document.get("kind") == "sealing":
            from .sealing import format_text as sealing_text

            print(sealing_text(document))
        else:
            print(
                report.format_markdown(document) if args.markdown else report.format_text(document)
            )
        return 0
    if args.command == "profile":
        from . import profile

        profile.run(args.requests, args.apps)
        return 0
    if args.command == "instructions":
        from . import instructions

        if args.child:
            instructions.child_main(args.child)
        instructions.run(args.requests, args.apps)
        return 0
    if args.command == "trail":
        from . import trail as trail_bench

        trail_options = (
            trail_bench.TrailOptions.quick() if args.quick else trail_bench.TrailOptions()
        )
        document = trail_bench.run(trail_options)
        return _written(document, trail_bench.format_text, args.output)
    if args.command == "sealing":
        from . import sealing as sealing_bench

        options = (
            sealing_bench.SealingOptions.quick() if args.quick else sealing_bench.SealingOptions()
        )
        document = sealing_bench.run(options)
        return _written(document, sealing_bench.format_text, args.output)
    if args.command == "growth":
        from . import growth

        document = growth.run(
            growth.GrowthOptions(sizes=args.sizes, samples=args.samples, drop_rows=args.drop_rows)
        )
        return _written(document, growth.format_text, args.output)

    from .runner import Options, run

    overrides: dict[str, t.Any] = {
        name: value
        for name, value in (
            ("rounds", args.rounds),
            ("seconds", args.seconds),
            ("max_requests", args.requests),
            ("workers", args.workers),
            ("concurrencies", args.concurrency),
            ("storms", args.storms),
            ("client", args.client),
        )
        if value is not None
    }
    options = Options.quick(**overrides) if args.quick else Options(**overrides)
    document = report.complete(run(options))
    return _written(document, report.format_text, args.output)


def _written(
    document: report.Document, format_text: t.Callable[[t.Any], str], output: Path | None
) -> int:
    """Write a results document, print it and where it went."""
    path = report.write(document, output or report.RESULTS_DIR)
    print(format_text(document))
    print(f"\nwritten to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
