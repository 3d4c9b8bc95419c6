"""Every Python block of README.md and docs/ runs in the suite (Sybil): the docs are what a
stranger copies.

Each page is one program: its blocks run top to bottom in one namespace of their own, visible
ones and the page's invisible setup and check blocks alike (``<!-- invisible-code-block:
python`` HTML comments, which neither GitHub nor Sphinx shows). A page runs in a temporary
directory of its own, so a relative ``sqlite:///app.sqlite3`` (and a Flask app's instance
folder) is a fresh file there; its environment variables, loggers, patched attributes, fake
modules and open engines are put back or disposed of after its last block.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import sys
import tempfile
import types
import typing as t
from doctest import ELLIPSIS, NORMALIZE_WHITESPACE
from pathlib import Path

import pytest
from sybil import Sybil
from sybil.evaluators.doctest import DocTestEvaluator
from sybil.evaluators.python import PythonEvaluator
from sybil.parsers.abstract.doctest import DocTestStringParser
from sybil.parsers.myst import CodeBlockParser, PythonCodeBlockParser

T = t.TypeVar("T")


class PythonParser(PythonCodeBlockParser):
    """```python blocks (and invisible ones), each kept in ``page.blocks`` as it runs."""

    def __init__(self) -> None:
        super().__init__()
        self.codeblock_parser = CodeBlockParser("python", self._evaluate)
        self._python = PythonEvaluator()

    def _evaluate(self, example: t.Any) -> None:
        page = example.namespace["page"]
        page.stop_if_missing()
        page.blocks.append(str(example.parsed))
        self._python(example)


class PyconParser(PythonCodeBlockParser):
    """```pycon blocks: interactive sessions, checked as doctests."""

    def __init__(self) -> None:
        self.doctest_parser = DocTestStringParser(DocTestEvaluator(ELLIPSIS | NORMALIZE_WHITESPACE))
        self.codeblock_parser = CodeBlockParser("pycon", self._not_a_session)

    @staticmethod
    def _not_a_session(example: t.Any) -> None:
        raise AssertionError("a pycon block must start with '>>> '")


class Page:
    """What a page's invisible blocks may use (as ``page``) to reach outside their namespace,
    each undone after the page's last block."""

    def __init__(self) -> None:
        self.directory = Path(tempfile.mkdtemp(prefix="flask-idem-docs-"))
        #: The source of every Python block run so far, in order.
        self.blocks: list[str] = []
        self._saved = (os.getcwd(), dict(os.environ), _loggers())
        self._undo = contextlib.ExitStack()
        #: Why the rest of the page cannot run (a service it needs is missing), once so.
        self.missing: str | None = None
        #: Whether that fails the page's remaining blocks instead of skipping them (CI).
        self.missing_fails = False

    def patch(self, target: object, name: str, value: object) -> None:
        """Set ``target.name`` (a fake transport, say) until the page ends."""
        missing = object()
        old = getattr(target, name, missing)
        setattr(target, name, value)
        self._undo.callback(
            lambda: delattr(target, name) if old is missing else setattr(target, name, old)
        )

    def module(self, name: str, **attributes: t.Any) -> types.ModuleType:
        """A fake importable module (a broker client the suite does not install)."""
        module = types.ModuleType(name)
        vars(module).update(attributes)
        old = sys.modules.get(name)
        sys.modules[name] = module
        self._undo.callback(
            lambda: sys.modules.pop(name) if old is None else sys.modules.update({name: old})
        )
        return module

    def block(self, text: str) -> str:
        """The source of the one earlier block (before the running one) containing ``text``."""
        (found,) = [block for block in self.blocks[:-1] if text in block]
        return found

    def importable(self, name: str, source: str) -> Path:
        """Write the module ``name`` (the application a page's tests import) into the page's
        directory and make it importable, in this process and in its children."""
        path = self.directory / f"{name}.py"
        path.write_text(source)
        if str(self.directory) not in sys.path:
            sys.path.insert(0, str(self.directory))
            self._undo.callback(sys.path.remove, str(self.directory))
        self._undo.callback(sys.modules.pop, name, None)
        return path

    def redis(self) -> str:
        """The URL of a throwaway Redis server (``tests/support/redis_server.py``) until the page
        ends.

        Without one (no ``redis-server``, not root) the rest of the page skips, or fails under
        ``FLASK_IDEM_REQUIRE_REDIS=1`` (CI)."""
        from tests.support import debian, redis_server

        server = redis_server.RedisServer()
        try:
            server.start()
        except debian.NotInstallable as exc:
            self.missing = f"{redis_server.DID_NOT_RUN}: {exc}"
            self.missing_fails = redis_server.required()
            self.stop_if_missing()
        self._undo.callback(server.stop)
        return server.url

    def stop_if_missing(self) -> None:
        """Skip (or, in CI, fail) the running block when the page lacks a service it needs."""
        if self.missing is None:
            return
        if self.missing_fails:
            pytest.fail(self.missing, pytrace=False)
        pytest.skip(self.missing)

    def enter(self, context: t.ContextManager[T]) -> T:
        """Enter ``context`` (a ready store, say) until the page ends."""
        return self._undo.enter_context(context)

    @contextlib.contextmanager
    def xfail(self, reason: str) -> t.Iterator[None]:
        """A documented claim that is false today: its failed assertion is an xfail, and the
        block fails the suite once it passes (strict), so that the marker goes with the bug.
        Any other exception is a failure as usual."""
        try:
            yield
        except AssertionError as exc:
            pytest.xfail(f"{reason} (AssertionError: {exc})")
        pytest.fail(f"[XPASS(strict)] {reason}: remove page.xfail() from the block")

    def close(self) -> None:
        self._undo.close()

    def restore(self) -> None:
        """Put back the working directory, the environment and the loggers; remove the
        page's directory."""
        cwd, environ, loggers = self._saved
        os.chdir(cwd)
        for name in set(os.environ) - set(environ) - {"PYTEST_CURRENT_TEST"}:
            del os.environ[name]
        os.environ.update({k: v for k, v in environ.items() if k != "PYTEST_CURRENT_TEST"})
        _restore_loggers(loggers)
        shutil.rmtree(self.directory, ignore_errors=True)


def _loggers() -> dict[str, tuple[int, bool, list[logging.Handler], bool]]:
    loggers = [logging.getLogger()] + [
        logger
        for logger in logging.Logger.manager.loggerDict.values()
        if isinstance(logger, logging.Logger)
    ]
    return {
        logger.name: (logger.level, logger.disabled, list(logger.handlers), logger.propagate)
        for logger in loggers
    }


def _restore_loggers(saved: dict[str, tuple[int, bool, list[logging.Handler], bool]]) -> None:
    # Alembic's env.py of a Flask-Migrate history runs logging.config.fileConfig, which
    # disables every logger that exists and replaces the root handlers.
    for logger in [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]:
        if not isinstance(logger, logging.Logger):
            continue
        level, disabled, handlers, propagate = saved.get(logger.name, (0, False, [], True))
        logger.setLevel(level)
        logger.disabled = disabled
        logger.handlers[:] = handlers
        logger.propagate = propagate


def setup(namespace: dict[str, t.Any]) -> None:
    page = Page()
    # Flask(__name__) roots an app in the current directory when the name is no module.
    namespace.update(__name__="docs_page", page=page)
    os.chdir(page.directory)


def teardown(namespace: dict[str, t.Any]) -> None:
    page: Page = namespace["page"]
    try:
        page.close()
        _dispose(namespace)
    finally:
        page.restore()


def _dispose(namespace: dict[str, t.Any]) -> None:
    """Close the engines the page's apps and stores opened (no connection outlives a page)."""
    import sqlalchemy as sa
    from flask import Flask

    from flask_idem import Store

    for value in list(namespace.values()):
        if isinstance(value, Flask):
            state = value.extensions.get("idempotency")
            if state is not None:
                state.store.engine.dispose()
            sqlalchemy = value.extensions.get("sqlalchemy")
            if sqlalchemy is not None:
                with value.app_context():
                    for engine in sqlalchemy.engines.values():
                        engine.dispose()
        if isinstance(value, Store):
            value.engine.dispose()
        if isinstance(value, sa.Engine):
            value.dispose()


pytest_collect_file = Sybil(
    parsers=[PythonParser(), PyconParser()],
    patterns=["README.md", "docs/*.md", "docs/problems/*.md"],
    excludes=["docs/_build/*"],
    setup=setup,
    teardown=teardown,
).pytest()
