"""Every interleaving of the bounded scenarios keeps every invariant, on today's code.

``FLASK_IDEM_EXPLORE=deep`` explores the deeper nightly profiles instead of the default ones.
"""

from __future__ import annotations

import pytest

from ..support.explore import profiles
from ..support.explore.engine import explore
from ..support.explore.harness import Harness
from ..support.explore.world import Profile, World
from .conftest import REPORTS

#: Lower bounds on what each default profile explores: an explorer that silently stopped
#: exploring (an action never enabled, a fingerprint that merges everything) fails here.
MIN_STATES = 300


@pytest.mark.parametrize("profile", profiles.selected(), ids=lambda p: p.name)
def test_every_interleaving_keeps_the_invariants(harness: Harness, profile: Profile) -> None:
    """The outcome protocol (claims, takeovers, leases, completions, give-ups, reconciliation,
    operator releases, purges) under crashes, store failures and the clock breaks none of
    the invariants of :mod:`tests.support.explore.invariants` in any order."""
    report = explore(World(harness, profile), name=profile.name, max_depth=profile.max_depth)
    REPORTS.append(report)
    print(report.summary())
    rendered = "\n\n".join(v.render() for v in report.violations.values())
    assert not report.violations, rendered
    assert report.states >= MIN_STATES, report.summary()
    assert report.depth == profile.max_depth, report.summary()
    assert report.finished_runs > 0, report.summary()
