"""The documentation cannot drift from the code: configuration keys, problem types, README;
and every page has the one title the site's navigation is built from."""

from __future__ import annotations

import inspect
import json
import re
import typing as t
from pathlib import Path

import flask_idem
from flask_idem.core import problem
from flask_idem.core.config import DEFAULTS

DOCS = Path(__file__).parents[2] / "docs"
ROW = re.compile(r"^\| `(IDEMPOTENCY_\w+)` \| `(.*?)` \| (.+) \|$", re.M)
#: A fenced block opens with three or more backticks or tildes (MyST directives too).
TITLE_FENCE = re.compile(r"^(`{3,}|~{3,})")
INCLUDE = re.compile(r"^[`~]{3,}\{include\}\s+(\S+)")
START_LINE = re.compile(r"^:start-line:\s*(\d+)")
#: The pages whose Python blocks the suite runs (conftest.py at the root of the repository).
PAGES = [DOCS.parent / "README.md", *sorted(DOCS.glob("*.md")), *sorted(DOCS.glob("problems/*.md"))]
FENCE = re.compile(r"^[ \t]*(`{3,}|~{3,})(.*)$", re.M)
#: Spellings of Python that Sybil's parsers would not collect, so never run.
UNCOLLECTED_PYTHON = {"py", "py3", "python3", "ipython", "pycon3", "python-console"}


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


def _titles(page: Path, start: int = 0) -> list[str]:
    """The top-level (``# ``) headings of ``page`` from line ``start`` on, outside fenced
    blocks and HTML comments (the suite's invisible code blocks), with those of the files it
    includes (``{include}``, from their ``:start-line:``)."""
    titles: list[str] = []
    fence: str | None = None
    included: list[t.Any] | None = None
    comment = False
    for line in page.read_text().splitlines()[start:]:
        if comment or (fence is None and line.startswith("<!--")):
            comment = "-->" not in line
            continue
        if fence is None:
            opened = TITLE_FENCE.match(line)
            if opened:
                fence = opened.group(1)
                target = INCLUDE.match(line)
                included = [page.parent / target.group(1), 0] if target else None
            elif line.startswith("# "):
                titles.append(line)
        elif re.fullmatch(rf"{re.escape(fence[0])}{{{len(fence)},}}\s*", line):
            if included is not None:
                titles += _titles(included[0], included[1])
            fence = None
        elif included is not None and (found := START_LINE.match(line)):
            included[1] = int(found.group(1))
    return titles


def test_every_page_has_exactly_one_title() -> None:
    pages = sorted(path for path in DOCS.rglob("*.md") if "_build" not in path.parts)
    assert DOCS / "changelog.md" in pages
    wrong = {
        str(page.relative_to(DOCS)): titles for page in pages if len(titles := _titles(page)) != 1
    }
    assert not wrong, f"one `# ` title per page (the navigation shows each): {wrong}"


def _fences(text: str) -> list[str]:
    """The info string of every opening fence in ``text``."""
    infos, opened = [], None
    for match in FENCE.finditer(text):
        fence, info = match.group(1), match.group(2).strip()
        if opened is None:
            opened = fence
            infos.append(info)
        elif fence[0] == opened[0] and len(fence) >= len(opened) and not info:
            opened = None
    return infos


def test_every_code_block_says_its_language() -> None:
    """A block without a language, or with a spelling of Python the suite does not collect,
    would be copied by a stranger without ever having run."""
    for page in PAGES:
        for info in _fences(page.read_text()):
            assert info, f"{page.name}: a fenced block without a language (use text)"
            language = info.split()[0]
            assert language.lower() not in UNCOLLECTED_PYTHON, f"{page.name}: ```{language}"
            assert language == language.lower(), f"{page.name}: ```{language}"


def test_every_problem_page_shows_its_document() -> None:
    base = DEFAULTS["IDEMPOTENCY_PROBLEM_BASE"]
    for cls in _problems():
        page = (DOCS / "problems" / f"{cls.problem}.md").read_text()
        (example,) = re.findall(r"^```json\n(.*?)^```$", page, re.M | re.S)
        document = json.loads(example)
        assert list(document) == ["type", "title", "status", "detail", "instance"], cls.problem
        assert (document["type"], document["title"], document["status"]) == (
            f"{base}{cls.problem}",
            cls.title,
            cls.code,
        )


def test_the_documented_job_retry_tuple_covers_every_retryable_outcome() -> None:
    """Every exception docs/jobs.md's outcome table says to retry is in
    ``RETRYABLE_JOB_ERRORS`` (the recipes' ``autoretry_for``), and nothing it says is final."""
    table = (DOCS / "jobs.md").read_text().split("## The outcome model, for jobs")[1]
    rows = [row for row in table.splitlines() if row.startswith("| ")]
    cells = [cell for row in rows for cell in row.strip("|").split(" | ")]

    def named(cell: str) -> set[type]:
        found = (getattr(flask_idem, name, None) for name in re.findall(r"`(\w+)`", cell))
        return {error for error in found if inspect.isclass(error)}

    retried = set().union(
        *(named(cell) for cell in cells if "retry" in cell.replace("not retryable", ""))
    )
    final = set().union(*(named(cell) for cell in cells if "not retryable" in cell))
    assert {flask_idem.StoreUnavailable, flask_idem.JobInProgress} <= retried
    assert retried == set(flask_idem.RETRYABLE_JOB_ERRORS) and not retried & final
    assert all(error.retryable for error in retried if issubclass(error, flask_idem.JobError))
    assert not any(error.retryable for error in final)
