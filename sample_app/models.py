"""The sample app's own tables (SQLAlchemy Core), next to the extension's ``idempotency_keys``.

``make migrate`` runs ``alembic upgrade head`` for the extension and then
``flask --app sample_app init-db``, which creates whatever is missing here. A real application
would keep these in its own Alembic history; ``create_all`` keeps the sample short.
"""

from __future__ import annotations

import click
import sqlalchemy as sa
from flask import current_app
from sqlalchemy.dialects import postgresql, sqlite

from flask_idem.store import create_engine

metadata = sa.MetaData(
    naming_convention={
        "ix": "ix_%(table_name)s_%(column_0_N_name)s",
        "uq": "uq_%(table_name)s_%(column_0_N_name)s",
        "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
        "pk": "pk_%(table_name)s",
    }
)

payments = sa.Table(
    "payments",
    metadata,
    # Insertion order, so that "newest first" does not depend on clock resolution.
    sa.Column("seq", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("id", sa.String(32), nullable=False, unique=True),
    sa.Column("tenant", sa.String(255), nullable=False, index=True),
    sa.Column("amount", sa.BigInteger, nullable=False),
    sa.Column("currency", sa.String(3), nullable=False),
    sa.Column("customer", sa.String(255), nullable=False),
    sa.Column("description", sa.Text, nullable=True),
    sa.Column("metadata", sa.JSON, nullable=True),
    sa.Column("status", sa.String(16), nullable=False),
    # One payment per charge: the view and the reconciler can never both record it.
    sa.Column("provider_charge_id", sa.String(32), nullable=False, unique=True),
    sa.Column("created", sa.BigInteger, nullable=False),
)

refunds = sa.Table(
    "refunds",
    metadata,
    sa.Column("seq", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("id", sa.String(32), nullable=False, unique=True),
    sa.Column("tenant", sa.String(255), nullable=False),
    sa.Column("payment_id", sa.String(32), sa.ForeignKey(payments.c.id), nullable=False),
    sa.Column("amount", sa.BigInteger, nullable=False),
    sa.Column("created", sa.BigInteger, nullable=False),
    sa.Index(None, "payment_id"),
)

#: One row per provider event received (the effect of ``POST /v1/webhooks/provider``). No unique
#: constraint on the event id, on purpose: the idempotency claim of the event id is what
#: deduplicates, and the tests count these rows to show it. The delivery id is diagnostic
#: only: the first delivery's is kept.
webhook_events = sa.Table(
    "webhook_events",
    metadata,
    sa.Column("seq", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("tenant", sa.String(255), nullable=False),
    sa.Column("event_id", sa.String(255), nullable=False, index=True),
    sa.Column("type", sa.String(64), nullable=False),
    sa.Column("delivery_id", sa.String(255), nullable=True),
    sa.Column("received", sa.BigInteger, nullable=False),
)

#: The fake payment provider's ledger. It belongs to the "external service": only
#: :mod:`sample_app.provider` touches it, through its own engine.
provider_charges = sa.Table(
    "provider_charges",
    metadata,
    sa.Column("id", sa.String(32), primary_key=True),
    sa.Column("tenant", sa.String(255), nullable=False),
    sa.Column("downstream_key", sa.String(255), nullable=False),
    sa.Column("amount", sa.BigInteger, nullable=False),
    sa.Column("currency", sa.String(3), nullable=False),
    sa.Column("customer", sa.String(255), nullable=False),
    # Kept with the charge, as real providers do: a reconciler rebuilds the payment from it.
    sa.Column("description", sa.Text, nullable=True),
    sa.Column("metadata", sa.JSON, nullable=True),
    sa.Column("status", sa.String(16), nullable=False),
    sa.Column("created", sa.BigInteger, nullable=False),
    # The provider's own deduplication: one charge per (merchant, downstream key).
    sa.UniqueConstraint("tenant", "downstream_key"),
)

#: Fixed-window counters of the rate limiter, shared by every worker process.
rate_limit_counters = sa.Table(
    "rate_limit_counters",
    metadata,
    sa.Column("key", sa.String(512), primary_key=True),
    sa.Column("count", sa.Integer, nullable=False),
    sa.Column("expires_at", sa.Float, nullable=False),
)


def dialect_insert(
    bind: sa.Engine | sa.Connection, table: sa.Table
) -> postgresql.Insert | sqlite.Insert:
    """An INSERT supporting ``ON CONFLICT`` in ``bind``'s dialect (PostgreSQL or SQLite)."""
    if bind.dialect.name == "postgresql":
        return postgresql.insert(table)
    return sqlite.insert(table)


def create_tables(url: str) -> None:
    """Create the sample app's tables that do not exist yet."""
    engine = create_engine(url)
    try:
        metadata.create_all(engine)
    finally:
        engine.dispose()


@click.command("init-db")
def init_db_command() -> None:
    """Create the sample app's tables (run ``alembic upgrade head`` for the extension's)."""
    create_tables(current_app.config["IDEMPOTENCY_DATABASE_URL"])
    click.echo("sample app tables ready")


def _mapped(table: sa.Table) -> type:
    """An ORM class for one of the tables above, in the app's Flask-SQLAlchemy registry."""
    from .extensions import db

    return type(table.name.title().replace("_", ""), (db.Model,), {"__table__": table})


#: ORM views of the Core tables, for the Flask-SQLAlchemy style of the refunds endpoint.
Payment = _mapped(payments)
Refund = _mapped(refunds)
