"""Breadth-first search over a model's states: every order of its actions, up to a depth.

The engine knows nothing of flask_idem. A :class:`Model` saves and loads its whole state (the
store's rows included), lists the actions enabled in it, applies one and says which invariants
it broke, and gives a fingerprint that identifies states worth exploring once. Because the
search is breadth-first, the first trace found for an invariant is one of the shortest that
break it.
"""

from __future__ import annotations

import collections
import dataclasses
import time
import typing as t

Saved = t.TypeVar("Saved")


class Model(t.Protocol[Saved]):
    """What the engine explores."""

    def save(self) -> Saved:
        """The whole current state, to come back to."""

    def load(self, saved: Saved) -> None:
        """Go back to a saved state (the store's rows too)."""

    def enabled(self) -> list[str]:
        """The actions that can happen next (their labels; empty: the run is over)."""

    def apply(self, action: str) -> tuple[str, list[Broken]]:
        """Do ``action``: what happened, for the trace, and the invariants it broke."""

    def at_rest(self) -> list[Broken]:
        """The invariants broken by a run that is over (nothing is enabled any more)."""

    def fingerprint(self) -> t.Hashable:
        """Equal for states whose futures are the same (explored once)."""


@dataclasses.dataclass(frozen=True)
class Broken:
    """An invariant a state or a step broke, and how."""

    invariant: str
    message: str


@dataclasses.dataclass(frozen=True)
class Violation:
    """The first (so a shortest) trace that broke an invariant."""

    invariant: str
    message: str
    trace: tuple[str, ...]

    def render(self) -> str:
        """The trace as numbered steps, then what broke."""
        steps = [f"{number:2d}. {step}" for number, step in enumerate(self.trace, 1)]
        return "\n".join([*steps, f"    => {self.invariant}: {self.message}"])


@dataclasses.dataclass
class Report:
    """What a search explored and what it found."""

    name: str
    states: int = 0
    transitions: int = 0
    #: The longest trace that reached a new state.
    depth: int = 0
    #: Runs that ended before the depth bound (nothing enabled any more).
    finished_runs: int = 0
    seconds: float = 0.0
    violations: dict[str, Violation] = dataclasses.field(default_factory=dict)

    def summary(self) -> str:
        found = ", ".join(sorted(self.violations)) or "no invariant broken"
        return (
            f"{self.name}: {self.states} states, {self.transitions} transitions, depth "
            f"{self.depth}, {self.finished_runs} finished runs, {self.seconds:.1f} s: {found}"
        )


def explore(
    model: Model[t.Any],
    *,
    name: str,
    max_depth: int,
    stop_when: t.Callable[[Report], bool] | None = None,
) -> Report:
    """Explore every order of ``model``'s actions breadth-first, ``max_depth`` steps deep.

    A state that broke an invariant is not explored further (its trace is reported, the first
    one per invariant). ``stop_when`` ends the search early (a mutation test stops once its
    invariant broke).
    """
    report = Report(name)
    started = time.monotonic()
    root = model.save()
    seen = {model.fingerprint()}
    report.states = 1
    queue: collections.deque[tuple[t.Any, tuple[str, ...]]] = collections.deque([(root, ())])
    while queue:
        saved, trace = queue.popleft()
        model.load(saved)
        actions = model.enabled()
        if not actions:
            report.finished_runs += 1
            _note(report, model.at_rest(), trace)
            continue
        if len(trace) >= max_depth:
            continue
        for action in actions:
            model.load(saved)
            happened, broken = model.apply(action)
            report.transitions += 1
            step = trace + (f"{action}: {happened}",)
            if broken:
                _note(report, broken, step)
                if stop_when is not None and stop_when(report):
                    report.seconds = time.monotonic() - started
                    return report
                continue
            fingerprint = model.fingerprint()
            if fingerprint in seen:
                continue
            seen.add(fingerprint)
            report.states += 1
            report.depth = max(report.depth, len(step))
            queue.append((model.save(), step))
    report.seconds = time.monotonic() - started
    return report


def _note(report: Report, broken: list[Broken], trace: tuple[str, ...]) -> None:
    for each in broken:
        if each.invariant not in report.violations:
            report.violations[each.invariant] = Violation(each.invariant, each.message, trace)
