"""Whether a SQL string ends the transaction it runs in (PostgreSQL, SQLite).

Shared by the commit guard (:mod:`flask_idem.commits`, statements sent through SQLAlchemy) and
the store's driver connections (:mod:`.commit_count`, statements sent through a raw driver
cursor), so both read SQL the same way. :func:`may_end` is the cheap prefilter every statement
pays; :func:`ends_transaction` tokenizes only the few it lets through.
"""

from __future__ import annotations

import re

#: A statement (or a comment) starting with a word that may end the transaction.
_ENDING_START = r"\s*(?:commit|end|rollback|abort|prepare|/\*|--)"
_STARTS_ENDING = re.compile(_ENDING_START, re.IGNORECASE)
_ANY_ENDING = re.compile(rf";{_ENDING_START}", re.IGNORECASE)
#: Comments, quoted text and identifiers, and the words and separators between them. A ``--``
#: comment ends at a line feed or a carriage return, as in PostgreSQL's lexer.
_TOKEN = re.compile(
    r"""
      (?P<space>\s+|--[^\n\r]*)
    | (?P<quoted>[eE]'(?:[^'\\]|\\.|'')*'|'(?:[^']|'')*'|"(?:[^"]|"")*")
    | (?P<dollar>\$(?P<tag>[A-Za-z_][A-Za-z_0-9]*)?\$)
    | (?P<comment>/\*)
    | (?P<separator>;)
    | (?P<word>[A-Za-z_][A-Za-z_0-9$]*)
    | (?P<other>.)
    """,
    re.VERBOSE | re.DOTALL,
)
_ENDING_WORDS = frozenset({"commit", "end", "abort"})
_ROLLBACK_NOISE = frozenset({"work", "transaction"})


def may_end(sql: str) -> bool:
    """The prefilter: False for every statement that certainly ends nothing. An anchored
    match, and a search only in a string holding a ``;`` (which SQLAlchemy's statements and
    flask_idem's do not): a regular search over every statement cost a protected request
    several percent of its instructions."""
    if _STARTS_ENDING.match(sql) is not None:
        return True
    return ";" in sql and _ANY_ENDING.search(sql) is not None


def ends_transaction(sql: str) -> bool:
    """Whether any statement of ``sql`` ends the transaction it runs in (PostgreSQL, SQLite)."""
    statements: list[list[str]] = [[]]
    position = 0
    while position < len(sql):
        match = _TOKEN.match(sql, position)
        assert match is not None  # ``other`` matches any character
        position = match.end()
        kind = match.lastgroup
        if kind == "dollar":
            close = sql.find(match.group("dollar"), position)
            position = len(sql) if close < 0 else close + len(match.group("dollar"))
        elif kind == "comment":
            position = _end_of_comment(sql, position)
        elif kind == "separator":
            statements.append([])
        elif kind == "word" and len(statements[-1]) < 4:
            statements[-1].append(match.group().lower())
        elif kind in ("quoted", "other") and len(statements[-1]) < 4:
            statements[-1].append("")
    return any(_ends(words) for words in statements)


def _end_of_comment(sql: str, position: int) -> int:
    """Where a ``/*`` comment opened before ``position`` ends (PostgreSQL nests them)."""
    depth = 1
    while depth and position < len(sql):
        if sql.startswith("/*", position):
            depth, position = depth + 1, position + 2
        elif sql.startswith("*/", position):
            depth, position = depth - 1, position + 2
        else:
            position += 1
    return position


def _ends(words: list[str]) -> bool:
    if not words:
        return False
    first, rest = words[0], words[1:]
    if first in _ENDING_WORDS:
        return True
    if first == "prepare":
        return rest[:1] == ["transaction"]
    if first == "rollback":
        while rest and rest[0] in _ROLLBACK_NOISE:
            rest = rest[1:]
        return rest[:1] != ["to"]  # ROLLBACK TO SAVEPOINT keeps the transaction
    return False
