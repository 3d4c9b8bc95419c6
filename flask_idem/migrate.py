"""Run flask_idem's own Alembic migrations from Python (deploy scripts, tests).

The migrations ship inside the package (``flask_idem.migrations``) and keep their own version
table, so an application runs them next to its own Alembic history without merging the two.
"""

from __future__ import annotations

import importlib.resources

import sqlalchemy as sa
from alembic import command
from alembic.config import Config

from .store import normalize_url


def alembic_config(url: str | sa.URL | None = None) -> Config:
    """An Alembic ``Config`` for flask_idem's migrations.

    :param url: the database; without it the environment reads ``DATABASE_URL``.
    """
    config = Config()
    config.set_main_option(
        "script_location", str(importlib.resources.files("flask_idem.migrations"))
    )
    if url is not None:
        rendered = normalize_url(url).render_as_string(hide_password=False)
        # ConfigParser interpolation: a literal "%" (URL-encoded passwords) must be doubled.
        config.set_main_option("sqlalchemy.url", rendered.replace("%", "%%"))
    return config


def upgrade(url: str | sa.URL | None = None, revision: str = "head") -> None:
    """Create or update the ``idempotency_keys`` schema."""
    command.upgrade(alembic_config(url), revision)


def downgrade(url: str | sa.URL | None = None, revision: str = "base") -> None:
    """Remove the schema (``base``) or step back to ``revision``."""
    command.downgrade(alembic_config(url), revision)
