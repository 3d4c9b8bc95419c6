"""The apps the bench compares: one payment endpoint, bare, behind flask_idem (durable and
atomic claim), and behind a hand-written minimal idempotency layer.

Gunicorn loads them by factory (``bench.apps:bare()``, ``bench.apps:protected()``,
``bench.apps:protected_atomic()``, ``bench.apps:handwritten()``) and reads the database from
``BENCH_DATABASE_URL``. All run exactly one payment ``INSERT`` and answer the same 201 JSON,
so the difference between them is what idempotency costs and nothing else. The protected apps
use flask_idem with its defaults; their ``INSERT`` goes through ``idem.connection()`` so the
payment commits with the stored response, as users are told to do. The hand-written layer is
what a team would write instead (:func:`handwritten`): the reference flask_idem must beat.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import secrets
import time
import typing as t

import sqlalchemy as sa
from flask import Flask, Response, current_app, g, jsonify, request
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

#: The hand-written layer's own table (see :func:`handwritten`).
handwritten_keys = sa.Table(
    "bench_handwritten_keys",
    metadata,
    sa.Column("tenant", sa.String(64), primary_key=True),
    sa.Column("key", sa.String(255), primary_key=True),
    sa.Column("fingerprint", sa.LargeBinary, nullable=False),
    sa.Column("state", sa.String(16), nullable=False),
    sa.Column("status", sa.Integer, nullable=True),
    sa.Column("body", sa.LargeBinary, nullable=True),
    sa.Column("headers", sa.Text, nullable=True),
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
    return _protected("bench_protected", url, atomic=False)


def protected_atomic(url: str | None = None) -> Flask:
    """The same endpoint behind flask_idem's atomic claim (its effects are all in the
    database): claim, payment and stored response commit once."""
    return _protected("bench_protected_atomic", url, atomic=True)


def _protected(name: str, url: str | None, *, atomic: bool) -> Flask:
    app = Flask(name)
    app.config["IDEMPOTENCY_DATABASE_URL"] = database_url(url)
    idem = Idempotency(tenant=lambda: TENANT)
    idem.init_app(app)
    insert = payments.insert()

    @app.post(PAYMENT_PATH)
    @idem.idempotent(atomic=atomic)
    def create_payment() -> ResponseReturnValue:
        row = _new_payment()
        idem.connection().execute(insert, row)
        return _created(row)

    app.extensions["bench_engine"] = app.extensions["idempotency"].store.engine
    _add_bench_routes(app, lambda: current_app.extensions["bench_engine"])
    return app


# The hand-written layer: durable claim (it commits before the view, which may call a
# provider), the business rows and the stored answer in one transaction, replay, 409 while in
# flight, 422 for another body, and the claim released when the view fails. What it leaves
# out (what flask_idem adds): leases and recovery of a claim whose worker died (it stays
# "running": 409 until someone deletes it), expiry, canonical fingerprints, header policy.
_HW_CLAIM = sa.text(
    "INSERT INTO bench_handwritten_keys (tenant, key, fingerprint, state)"
    " VALUES (:tenant, :key, :fingerprint, 'running') ON CONFLICT DO NOTHING RETURNING key"
)
_HW_FIND = sa.text(
    "SELECT fingerprint, state, status, body, headers FROM bench_handwritten_keys"
    " WHERE tenant = :tenant AND key = :key"
)
_HW_DONE = sa.text(
    "UPDATE bench_handwritten_keys SET state = 'done', status = :status, body = :body,"
    " headers = :headers WHERE tenant = :tenant AND key = :key"
)
_HW_RELEASE = sa.text("DELETE FROM bench_handwritten_keys WHERE tenant = :tenant AND key = :key")


def _hand_idempotent(engine: sa.Engine, view: t.Callable[[], ResponseReturnValue]) -> t.Any:
    auto = engine.execution_options(isolation_level="AUTOCOMMIT")

    @functools.wraps(view)
    def wrapper() -> ResponseReturnValue:
        key = request.headers.get("Idempotency-Key", "")
        if not 0 < len(key) <= 255:
            return {"error": "Idempotency-Key required"}, 400
        ids = {"tenant": TENANT, "key": key}
        digest = hashlib.sha256(request.get_data()).digest()
        with auto.connect() as conn:
            if conn.execute(_HW_CLAIM, ids | {"fingerprint": digest}).first() is None:
                found = conn.execute(_HW_FIND, ids).first()
                if found is None or found.state != "done":
                    return {"error": "request in progress"}, 409
                if bytes(found.fingerprint) != digest:
                    return {"error": "key reused with another request"}, 422
                headers = json.loads(found.headers) | {"Idempotent-Replayed": "true"}
                return Response(bytes(found.body), found.status, headers)
        try:
            with engine.begin() as g.bench_connection:
                answer = current_app.make_response(view())
                saved = {
                    k: answer.headers[k]
                    for k in ("Content-Type", "Location")
                    if k in answer.headers
                }
                done = {
                    "status": answer.status_code,
                    "body": answer.get_data(),
                    "headers": json.dumps(saved),
                }
                g.bench_connection.execute(_HW_DONE, ids | done)
        except BaseException:
            with auto.connect() as conn:
                conn.execute(_HW_RELEASE, ids)
            raise
        return answer

    return wrapper


def handwritten(url: str | None = None) -> Flask:
    """The same endpoint behind the minimal layer above: the reference flask_idem is compared
    with (same pool, same payment INSERT)."""
    app = Flask("bench_handwritten")
    engine = sa.create_engine(database_url(url), pool_size=10, max_overflow=20, pool_timeout=5)
    insert = payments.insert()

    @app.post(PAYMENT_PATH)
    @functools.partial(_hand_idempotent, engine)
    def create_payment() -> ResponseReturnValue:
        row = _new_payment()
        g.bench_connection.execute(insert, row)
        return _created(row)

    app.extensions["bench_engine"] = engine
    _add_bench_routes(app, lambda: engine)
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
