"""The explorer's fixtures, and its numbers at the end of the run (how many states, how deep)."""

from __future__ import annotations

import contextlib
import typing as t

import pytest

from ..support.explore.engine import Report
from ..support.explore.harness import Harness

#: Every exploration of this run, for the terminal summary.
REPORTS: list[Report] = []


@pytest.fixture
def harness() -> t.Iterator[Harness]:
    """A fresh SQLite store on a controllable clock, and the app around it."""
    with contextlib.ExitStack() as stack:
        yield Harness(stack)


def pytest_terminal_summary(terminalreporter: t.Any) -> None:
    if REPORTS:
        terminalreporter.section("interleaving explorer")
        for report in REPORTS:
            terminalreporter.write_line(report.summary())
