"""The bounded scenarios the suite explores: a default set (every ``make test``) and a deeper
one for nightly runs (``FLASK_IDEM_EXPLORE=deep``)."""

from __future__ import annotations

import dataclasses
import os

from flask_idem.core.options import ViewOptions

from .world import Profile

#: Each profile puts a few actors and faults together, bounded so that the default run takes
#: about a minute on a loaded two-core machine.
DEFAULT: tuple[Profile, ...] = (
    Profile("frozen owner, reconciler", lease_jumps=2, store_faults=0, max_depth=14),
    Profile(
        "operator, failing store", reconciler=False, operator=True, store_faults=1, max_depth=12
    ),
    Profile(
        "TTL and upkeep",
        ttl_jumps=1,
        upkeep=True,
        failures=False,
        store_faults=0,
        reconciler=False,
        max_depth=12,
    ),
    Profile(
        "release_before_contact, commit as you go",
        options=ViewOptions(release_before_contact=True),
        commits_own=True,
        operator=True,
        store_faults=0,
        max_depth=10,
    ),
    Profile(
        "another request under the key",
        options=ViewOptions(recovery="reexecute"),
        other_body=True,
        lease_jumps=2,
        operator=True,
        max_depth=10,
    ),
    Profile(
        "recovery=reexecute",
        options=ViewOptions(recovery="reexecute"),
        lease_jumps=2,
        reconciler=False,
        max_depth=12,
    ),
)

#: The default scenarios with a third client, and a crash and a failing store call each at
#: least: for nightly runs (minutes; the default profiles exhaust their smaller state spaces
#: before their depth, a third client multiplies the states).
DEEP: tuple[Profile, ...] = tuple(
    dataclasses.replace(
        p,
        name=f"{p.name} (deep)",
        clients=3,
        crashes=max(p.crashes, 1),
        store_faults=max(p.store_faults, 1),
    )
    for p in DEFAULT
)


def selected() -> tuple[Profile, ...]:
    """The profiles ``FLASK_IDEM_EXPLORE`` asks for: ``deep``, else the default ones."""
    return DEEP if os.environ.get("FLASK_IDEM_EXPLORE") == "deep" else DEFAULT
