"""The bounded scenarios the suite explores: a default set (every ``make test``) and a deeper
one for nightly runs (``FLASK_IDEM_EXPLORE=deep``)."""

from __future__ import annotations

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
        "recovery=reexecute",
        options=ViewOptions(recovery="reexecute"),
        lease_jumps=2,
        reconciler=False,
        max_depth=12,
    ),
)

#: Every actor and fault together, a third client, deeper runs: for nightly runs.
DEEP: tuple[Profile, ...] = tuple(
    Profile(
        f"{options_name} (deep)",
        options=options,
        clients=3,
        lease_jumps=2,
        ttl_jumps=1,
        crashes=2,
        store_faults=1,
        commits_own=options.release_before_contact,
        operator=True,
        upkeep=True,
        max_depth=16,
    )
    for options_name, options in (
        ("recovery=fail", ViewOptions()),
        ("release_before_contact", ViewOptions(release_before_contact=True)),
        ("recovery=reexecute", ViewOptions(recovery="reexecute")),
    )
)


def selected() -> tuple[Profile, ...]:
    """The profiles ``FLASK_IDEM_EXPLORE`` asks for: ``deep``, else the default ones."""
    return DEEP if os.environ.get("FLASK_IDEM_EXPLORE") == "deep" else DEFAULT
