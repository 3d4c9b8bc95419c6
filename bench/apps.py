"""The two apps the bench compares: one payment endpoint, bare and behind flask_idem.

Gunicorn loads them by factory (``bench.apps:bare()``, ``bench.apps:protected()``) and reads
the database from ``BENCH_DATABASE_URL``. Both run exactly one ``INSERT`` and answer the same
201 JSON, so the difference between them is what idempotency costs and nothing else. The
protected app uses flask_idem with its defaults; its ``INSERT`` goes through
``idem.connection()`` so the payment commits with the stored response, as users are told to do.
"""

from __future__ import annotations

import os
import secrets
import time
import typing as t

import sqlalchemy as sa
from flask import Flask, current_app, jsonify, request
from flask.typing import ResponseReturnValue

from flask_idem import Idempotency

TENANT = "bench"
PAYMENT_PATH = "/payments"
FLUSH_PATH = "/_bench/flush"
HEALTH_PATH = "/_bench/health"
#: PostgreSQL flushes a backend's statistics when it goes idle at least one second after its
#: previous flush (otherwise up to ten seconds later); see :func:`_add_bench_routes`.
FLUSH_DELAY = 1.05

metadata = sa.MetaData()

payments = sa.Table(
    "bench_payments",
    metadata,
    sa.Column("id", sa.String(32), primary_key=True),
    sa.Column("tenant", sa.String(64), nullable=False),
    # Kept in both apps so that storms can count the rows created per key.
    sa.Column("idempotency_key", sa.String(255), nullable=True, index=True),
    sa.Column("amount", sa.BigInteger, nullable=False),
    sa.Column("currency", sa.String(3), nullable=False),
    sa.Column("customer", sa.String(64), nullable=False),
    sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.func.now()),
)


def database_url(url: str | None = None) -> str:
    """The bench database, pinned to psycopg2 (SQLAlchemy 2.1 maps ``postgresql://`` to
    psycopg 3, which is not installed)."""
    raw = url or os.environ.get("BENCH_DATABASE_URL")
    if not raw:
        raise RuntimeError("set BENCH_DATABASE_URL to the bench database")
    parsed = sa.make_url(raw)
    if parsed.drivername in ("postgres", "postgresql"):
        parsed = parsed.set(drivername="postgresql+psycopg2")
    return parsed.render_as_string(hide_password=False)


def _new_payment() -> dict[str, t.Any]:
    body = request.get_json()
    return {
        "id": "pay_" + secrets.token_hex(12),
        "tenant": TENANT,
        "idempotency_key": request.headers.get("Idempotency-Key"),
        "amount": int(body["amount"]),
        "currency": str(body["currency"]),
        "customer": str(body["customer"]),
    }


def _created(row: dict[str, t.Any]) -> ResponseReturnValue:
    body = jsonify(
        id=row["id"],
        amount=row["amount"],
        currency=row["currency"],
        customer=row["customer"],
        status="succeeded",
    )
    return body, 201, {"Location": f"{PAYMENT_PATH}/{row['id']}"}


def bare(url: str | None = None) -> Flask:
    """The endpoint without idempotency: the floor the protected app is compared with."""
    app = Flask("bench_bare")
    engine = sa.create_engine(database_url(url), pool_size=10, max_overflow=20, pool_timeout=5)
    insert = payments.insert()

    @app.post(PAYMENT_PATH)
    def create_payment() -> ResponseReturnValue:
        row = _new_payment()
        with engine.begin() as conn:
            conn.execute(insert, row)
        return _created(row)

    app.extensions["bench_engine"] = engine
    _add_bench_routes(app, lambda: engine)
    return app


def protected(url: str | None = None) -> Flask:
    """The same endpoint behind flask_idem with default settings."""
    app = Flask("bench_protected")
    app.config["IDEMPOTENCY_DATABASE_URL"] = database_url(url)
    idem = Idempotency(tenant=lambda: TENANT)
    idem.init_app(app)
    insert = payments.insert()

    @app.post(PAYMENT_PATH)
    @idem.idempotent
    def create_payment() -> ResponseReturnValue:
        row = _new_payment()
        idem.connection().execute(insert, row)
        return _created(row)

    app.extensions["bench_engine"] = app.extensions["idempotency"].store.engine
    _add_bench_routes(app, lambda: current_app.extensions["bench_engine"])
    return app


def _add_bench_routes(app: Flask, engine: t.Callable[[], sa.Engine]) -> None:
    """A readiness probe, and a statistics flush for exact ``xact_commit`` deltas.

    PostgreSQL counts transactions in each backend and publishes them in
    ``pg_stat_database`` lazily: at once when the backend goes idle a second or more after
    its last flush, otherwise up to ten seconds later. The flush route waits past that second
    and then runs one statement on every pooled connection of the worker (in a transaction
    that is rolled back, so it adds no commit), which publishes everything pending. The bench
    calls it on all workers at once (each sync worker serves one request at a time).
    """

    @app.get(HEALTH_PATH)
    def health() -> ResponseReturnValue:
        return {"pid": os.getpid()}

    @app.get(FLUSH_PATH)
    def flush() -> ResponseReturnValue:
        time.sleep(FLUSH_DELAY)
        pool = engine().pool
        idle = pool.checkedin() if isinstance(pool, sa.QueuePool) else 1
        connections = [engine().connect() for _ in range(max(1, idle))]
        try:
            for conn in connections:
                conn.exec_driver_sql("SELECT 1")
        finally:
            for conn in connections:
                conn.close()
        return {"pid": os.getpid(), "connections": len(connections)}


def create_schema(url: str) -> None:
    """Create the payments table (the protected database also needs ``alembic upgrade``)."""
    engine = sa.create_engine(database_url(url))
    try:
        metadata.create_all(engine)
    finally:
        engine.dispose()
