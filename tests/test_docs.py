"""The documentation cannot drift from the code: configuration keys, problem types, README."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

from flask_idem import problem
from flask_idem.config import DEFAULTS

DOCS = Path(__file__).parent.parent / "docs"
ROW = re.compile(r"^\| `(IDEMPOTENCY_\w+)` \| `(.*?)` \| (.+) \|$", re.M)


def test_configuration_reference_lists_every_key_with_its_default() -> None:
    rows = ROW.findall((DOCS / "configuration.md").read_text())
    assert [key for key, _, _ in rows] == list(DEFAULTS), "one entry per key, in config.py order"
    for key, default, meaning in rows:
        assert default == repr(DEFAULTS[key]), f"{key}: documented {default}"
        assert meaning.strip(), key


def _problems() -> list[type[problem.Problem]]:
    return [
        c
        for c in vars(problem).values()
        if inspect.isclass(c) and issubclass(c, problem.Problem) and c is not problem.Problem
    ]


def test_every_problem_type_has_its_page() -> None:
    index = (DOCS / "problems" / "index.md").read_text()
    base = DEFAULTS["IDEMPOTENCY_PROBLEM_BASE"]
    assert f"\n{base}\n" in index, "the index names the default base"
    pages = {path.stem for path in (DOCS / "problems").glob("*.md")} - {"index"}
    assert pages == {c.problem for c in _problems()}
    for cls in _problems():
        page = (DOCS / "problems" / f"{cls.problem}.md").read_text()
        assert f"| `type` | `{base}{cls.problem}` |" in page
        assert f"| status | {cls.code} |" in page and f"| title | {cls.title} |" in page
        assert f"[`{cls.problem}`]({cls.problem}.md) | {cls.code} | {cls.title} |" in index


def test_readme_starts_with_the_two_commands() -> None:
    readme = (DOCS.parent / "README.md").read_text().splitlines()
    commands = [line for line in readme[:12] if line.startswith("make ")]
    assert [line.split()[:2] for line in commands] == [["make", "run"], ["make", "test"]]
