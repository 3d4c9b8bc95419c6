"""The explorer finds the defects that mattered: each past defect, re-created as a mutation of
today's code (:mod:`tests.support.explore.mutations`), is reported with its shortest trace, and
the same exploration of the unmutated code finds nothing."""

from __future__ import annotations

import pytest

from flask_idem.core.options import ViewOptions

from ..support.explore.engine import Report, explore
from ..support.explore.harness import Harness
from ..support.explore.mutations import MUTATIONS
from ..support.explore.world import Profile, World
from .conftest import REPORTS

#: The owner frozen past its lease while a reconciler (or an operator) says "not happened".
FROZEN_OWNER = Profile("frozen owner", crashes=0, store_faults=0, failures=False, max_depth=12)
#: A view that promised to declare contact, and commits its rows itself before failing.
COMMIT_AS_YOU_GO = Profile(
    "commit as you go",
    options=ViewOptions(release_before_contact=True),
    commits_own=True,
    crashes=0,
    store_faults=0,
    failures=False,
    reconciler=False,
    max_depth=8,
)
#: A stuck record released by an operator, and a retry re-running it that fails.
RERUN = Profile(
    "re-run of a released record",
    options=ViewOptions(release_before_contact=True),
    operator=True,
    reconciler=False,
    store_faults=0,
    max_depth=10,
)
#: A record abandoned past its lease, re-run by a retry (recovery="reexecute").
REEXECUTE = Profile(
    "re-run of an abandoned record",
    options=ViewOptions(recovery="reexecute"),
    crashes=0,
    store_faults=0,
    failures=False,
    reconciler=False,
    max_depth=8,
)

#: Two clients under one key, the second with another request (another amount).
OTHER_REQUEST = Profile(
    "another request",
    other_body=True,
    crashes=0,
    store_faults=0,
    failures=False,
    reconciler=False,
    max_depth=8,
)

DOUBLE_CHARGE = """\
 1. A claims: claimed record #1
 2. clock +11 s (leases run out): time passes
 3. reconciler reads the stuck records: stuck: record #1 in_progress
 4. reconciler settles: record #1 reopened
 5. A gets the downstream key: key of record #1 (contact declared)
 6. A calls the provider: provider charges the key of record #1
 7. B claims: claimed record #2
 8. B gets the downstream key: key of record #2 (contact declared)
 9. B calls the provider: provider charges the key of record #2
    => one charge: the provider charged the keys of record #1, record #2"""

FORGOTTEN_AFTER_CONTACT = """\
 1. A claims: claimed record #1
 2. A gets the downstream key: key of record #1 (contact declared)
 3. clock +11 s (leases run out): time passes
 4. reconciler reads the stuck records: stuck: record #1 in_progress
 5. reconciler settles: record #1 reopened
    => released after effect: record #1 deleted after contact declared"""

RELEASED_AFTER_COMMIT = """\
 1. A claims: claimed record #1
 2. A's view commits its own row, then raises: answered 500 (the view raised; key given up)
    => released after effect: record #1 deleted after its payment row committed"""

RERUN_RELEASED = """\
 1. A claims: claimed record #1
 2. A gets the downstream key: key of record #1 (contact declared)
 3. A's view raises: answered 500 (the view raised; key given up)
 4. operator runs flask idem release: release --not-happened: reopened
 5. B claims: found record #1 reopened: may run it again
 6. B takes the record over: took record #1 over
 7. B's view raises: answered 500 (the view raised; key given up)
    => released after effect: record #1 deleted after contact declared"""


KEY_PER_ATTEMPT = """\
 1. A claims: claimed record #1
 2. A gets the downstream key: key of record #1 (contact declared)
 3. A calls the provider: provider charges the key of record #1
 4. clock +11 s (leases run out): time passes
 5. B claims: found record #1 in_progress: may run it again
 6. B takes the record over: took record #1 over
 7. B gets the downstream key: key of record #1 (contact declared)
 8. B calls the provider: provider charges the key of record #1
    => one charge: the provider charged the keys of record #1, record #1"""

LIVE_LEASE_TAKEN = """\
 1. A claims: claimed record #1
 2. B claims: found record #1 in_progress: may run it again
 3. B takes the record over: took record #1 over
    => live lease taken: record #1 taken over while its lease ran"""

OTHER_REQUEST_REPLAYED = """\
 1. A claims: claimed record #1
 2. A gets the downstream key: key of record #1 (contact declared)
 3. A calls the provider: provider charges the key of record #1
 4. A commits and completes: answered 201 (completed)
 5. B claims: answered 201 (found record #1 completed: replayed)
    => other request: B (other request) got 201 from record #1 (first request)"""


def _explore(harness: Harness, profile: Profile, wanted: set[str]) -> Report:
    report = explore(
        World(harness, profile),
        name=profile.name,
        max_depth=profile.max_depth,
        stop_when=lambda r: wanted <= set(r.violations),
    )
    REPORTS.append(report)
    for violation in report.violations.values():
        print(f"{profile.name}:\n{violation.render()}")
    return report


@pytest.mark.parametrize(
    ("mutation", "profile", "expected"),
    [
        pytest.param(
            "reopen_deletes",
            FROZEN_OWNER,
            {"one charge": DOUBLE_CHARGE, "released after effect": FORGOTTEN_AFTER_CONTACT},
            id="not-happened forgets the record of a frozen owner",
        ),
        pytest.param(
            "release_after_commit",
            COMMIT_AS_YOU_GO,
            {"released after effect": RELEASED_AFTER_COMMIT},
            id="a view that committed is released",
        ),
        pytest.param(
            "rerun_not_contacted",
            RERUN,
            {"released after effect": RERUN_RELEASED},
            id="a re-run releases the record an earlier attempt contacted under",
        ),
        pytest.param(
            "key_per_attempt",
            REEXECUTE,
            {"one charge": KEY_PER_ATTEMPT},
            id="a re-run of the same record derives another downstream key",
        ),
        pytest.param(
            "live_lease_taken",
            REEXECUTE,
            {"live lease taken": LIVE_LEASE_TAKEN},
            id="a running owner is taken over as if abandoned",
        ),
        pytest.param(
            "fingerprint_skipped",
            OTHER_REQUEST,
            {"other request": OTHER_REQUEST_REPLAYED},
            id="another request under the key gets the first one's answer",
        ),
    ],
)
def test_the_explorer_finds_the_defect_with_its_shortest_trace(
    harness: Harness,
    monkeypatch: pytest.MonkeyPatch,
    mutation: str,
    profile: Profile,
    expected: dict[str, str],
) -> None:
    """Breadth-first, the first trace breaking an invariant is a shortest one."""
    MUTATIONS[mutation](monkeypatch)
    report = _explore(harness, profile, set(expected))
    found = {name: v.render() for name, v in report.violations.items() if name in expected}
    assert found == expected


@pytest.mark.parametrize(
    "profile",
    [FROZEN_OWNER, COMMIT_AS_YOU_GO, RERUN, REEXECUTE, OTHER_REQUEST],
    ids=lambda p: p.name,
)
def test_the_same_exploration_of_todays_code_finds_nothing(
    harness: Harness, profile: Profile
) -> None:
    """The mutation tests' scenarios, explored to their full depth without the mutation."""
    report = _explore(harness, profile, set())
    assert not report.violations, "\n\n".join(v.render() for v in report.violations.values())
    assert report.states > 30, report.summary()
