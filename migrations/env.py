"""Alembic environment of flask_idem's schema.

It keeps its own version table (``flask_idem_alembic_version``), so an application that has
its own Alembic history runs both side by side in one database without either seeing the other.
"""

from __future__ import annotations

import os

import sqlalchemy as sa
from alembic import context

from flask_idem.store import create_engine, normalize_url
from flask_idem.store.table import VERSION_TABLE, metadata

config = context.config


def database_url() -> str:
    url = config.get_main_option("sqlalchemy.url") or os.environ.get("DATABASE_URL")
    if not url:
        raise SystemExit(
            "flask_idem migrations need a database: pass url= to "
            "flask_idem.ops.migrate.upgrade() or downgrade() (or call them in an app context "
            "of an application with Idempotency or Flask-SQLAlchemy), or set DATABASE_URL "
            "(sqlalchemy.url for alembic)"
        )
    return url


def run_migrations(connection: sa.Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=metadata,
        version_table=VERSION_TABLE,
        render_as_batch=connection.dialect.name == "sqlite",
        transaction_per_migration=True,
    )
    with context.begin_transaction():
        context.run_migrations()


def run_offline() -> None:
    context.configure(
        url=normalize_url(database_url()),
        target_metadata=metadata,
        version_table=VERSION_TABLE,
        literal_binds=True,
    )
    with context.begin_transaction():
        context.run_migrations()


def run_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        run_migrations(connection)
        return
    # No statement timeout: index builds and DDL on a big table may outlast a claim's bound.
    engine = create_engine(database_url(), statement_timeout=None)
    try:
        with engine.connect() as connection:
            run_migrations(connection)
            connection.commit()
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_offline()
else:
    run_online()
