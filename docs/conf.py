"""Sphinx configuration of the flask_idem documentation (``make docs``)."""

from __future__ import annotations

import logging
import os
import sys
import zlib
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent))

import flask_idem  # noqa: E402

# Alembic announces its plugins at INFO when autodoc imports flask_idem.ops.migrate.
logging.getLogger("alembic").setLevel(logging.WARNING)

project = "flask_idem"
author = "flask_idem contributors"
copyright = "2026, flask_idem contributors"  # noqa: A001
release = flask_idem.__version__
version = release

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.intersphinx",
    "sphinx.ext.viewcode",
]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
exclude_patterns = ["_build", "_inventories", "README.md"]
myst_enable_extensions = ["colon_fence", "deflist"]
# Anchors for "[text](page.md#a-heading)" links, as GitHub renders them.
myst_heading_anchors = 3

html_theme = "furo"
html_title = f"flask_idem {release}"

autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "show-inheritance": True}

# -- intersphinx -----------------------------------------------------------------------------
# The build must pass with -W on machines that reach no documentation site (CI reaches only
# package registries). So by default each mapping reads a small local inventory, written below
# from INVENTORIES: the upstream names these pages refer to, with their upstream URLs. The links
# in the built site point at the real Flask, SQLAlchemy and Alembic documentation. With
# DOCS_INTERSPHINX=online the upstream inventories are fetched instead (complete, but needs
# the network).
TARGETS = {
    "python": "https://docs.python.org/3/",
    "flask": "https://flask.palletsprojects.com/en/stable/",
    "sqlalchemy": "https://docs.sqlalchemy.org/en/20/",
    "alembic": "https://alembic.sqlalchemy.org/en/latest/",
    "flask_sqlalchemy": "https://flask-sqlalchemy.readthedocs.io/en/stable/",
}
#: name, Sphinx role, page (relative to the target) for each upstream object these docs name.
INVENTORIES: dict[str, list[tuple[str, str, str]]] = {
    "python": [
        ("contextlib.contextmanager", "py:function", "library/contextlib.html"),
        ("datetime.datetime", "py:class", "library/datetime.html"),
        ("typing.Callable", "py:data", "library/typing.html"),
    ],
    "flask": [
        ("flask.Flask", "py:class", "api/"),
        ("flask.app.Flask", "py:class", "api/"),
        ("flask.Blueprint", "py:class", "api/"),
        ("flask.g", "py:data", "api/"),
        ("flask.Request", "py:class", "api/"),
        ("flask.Response", "py:class", "api/"),
        ("flask.testing.FlaskClient", "py:class", "api/"),
        ("flask.Flask.test_client", "py:method", "api/"),
    ],
    "sqlalchemy": [
        ("sqlalchemy.engine.Engine", "py:class", "core/connections.html"),
        ("sqlalchemy.engine.Connection", "py:class", "core/connections.html"),
        ("sqlalchemy.engine.URL", "py:class", "core/engines.html"),
        ("sqlalchemy.create_engine", "py:function", "core/engines.html"),
        ("sqlalchemy.orm.Session", "py:class", "orm/session_api.html"),
        ("sqlalchemy.orm.Session.commit", "py:method", "orm/session_api.html"),
    ],
    "alembic": [
        ("alembic.config.Config", "py:class", "api/config.html"),
        ("alembic.command.upgrade", "py:function", "api/commands.html"),
    ],
    "flask_sqlalchemy": [
        ("flask_sqlalchemy.SQLAlchemy", "py:class", "api/"),
        ("flask_sqlalchemy.SQLAlchemy.session", "py:attribute", "api/"),
    ],
}


def _write_inventory(name: str, path: Path) -> None:
    lines = [f"{obj} {role} 1 {page}#$ -\n" for obj, role, page in INVENTORIES[name]]
    header = (
        "# Sphinx inventory version 2\n"
        f"# Project: {name}\n# Version: \n"
        "# The remainder of this file is compressed using zlib.\n"
    )
    path.write_bytes(header.encode() + zlib.compress("".join(lines).encode()))


_inventory_dir = HERE / "_build" / "inventories"
_inventory_dir.mkdir(parents=True, exist_ok=True)
intersphinx_mapping: dict[str, tuple[str, str | None]] = {}
for _name, _url in TARGETS.items():
    if os.environ.get("DOCS_INTERSPHINX") == "online":
        intersphinx_mapping[_name] = (_url, None)
    else:
        _path = _inventory_dir / f"{_name}.inv"
        _write_inventory(_name, _path)
        intersphinx_mapping[_name] = (_url, str(_path))
intersphinx_timeout = 10
