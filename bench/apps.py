"""The apps the bench compares: one payment endpoint, bare, behind flask_idem (durable and
atomic claim), and behind hand-written minimal idempotency layers.

Gunicorn loads them by factory (``bench.apps:bare()``, ``bench.apps:protected()``,
``bench.apps:protected_atomic()``, ``bench.apps:handwritten()``,
``bench.apps:handwritten_atomic()``, ``bench.apps:handwritten_partitioned()``,
``bench.apps:handwritten_atomic_partitioned()``) and reads the database from
``BENCH_DATABASE_URL``. All run exactly one payment ``INSERT`` and answer the same 201 JSON, so
the difference between them is what idempotency costs and nothing else. The protected apps use
flask_idem with its defaults; their ``INSERT`` goes through ``idem.connection()`` so the
payment commits with the stored response, as users are told to do. The hand-written layers are
what a team would write instead: :func:`handwritten` (durable claim) is the reference
flask_idem must beat, :func:`handwritten_atomic` (one commit) the floor of atomic mode, and the
``*_partitioned`` pair the same two layers on flask_idem's own schema: its SQL without its
Python.
"""

from __future__ import annotations

import contextlib
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
from flask_idem.core.key_digest import unkeyed

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
    """The bench database through ``BENCH_DRIVER`` (``psycopg2``, the default, or ``psycopg``
    for psycopg 3), whatever driver the URL names: every layer measures the same driver."""
    raw = url or os.environ.get("BENCH_DATABASE_URL")
    if not raw:
        raise RuntimeError("set BENCH_DATABASE_URL to the bench database")
    driver = os.environ.get("BENCH_DRIVER") or "psycopg2"
    if driver not in ("psycopg2", "psycopg"):
        raise RuntimeError(f"BENCH_DRIVER is psycopg2 or psycopg, not {driver!r}")
    parsed = sa.make_url(raw)
    if parsed.get_backend_name() == "postgresql" or parsed.drivername == "postgres":
        parsed = parsed.set(drivername=f"postgresql+{driver}")
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


# The hand-written layers: what a team would write instead of flask_idem, in four variants.
# Each replays, answers 409 while in flight and 422 for another body, and runs a key's view
# once; what they leave out (what flask_idem adds): leases and recovery of a claim whose worker
# died (a durable claim stays "running": 409 until someone deletes it), expiry, canonical
# fingerprints, header policy, signals.
#
# ``handwritten`` (the reference the performance targets are stated against): a durable
# claim (committed before the view, which may call a provider), then the business rows and the
# stored answer in one transaction, the claim released when the view fails.
# ``handwritten-atomic`` (the one-commit layer measured as the floor of atomic mode): one
# transaction looks the key up, runs the view and inserts the completed record; a concurrent
# duplicate waits on the record's primary key and fails on it (409). Both keep their records
# in a plain table.
# ``handwritten-partitioned`` and ``handwritten-atomic-partitioned`` are the same two layers on
# flask_idem's own schema (``idempotency_keys`` partitioned by ``created_at``, its claim
# functions, its completion ``UPDATE``): what flask_idem's SQL costs without its Python.
_KEY_REQUIRED = ({"error": "Idempotency-Key required"}, 400)
_IN_PROGRESS = ({"error": "request in progress"}, 409)
#: A claim that is this request's to run (any other claim result is the record found).
_CLAIMED = object()


class _PlainSchema:
    """Records in ``bench_handwritten_keys``, keyed by (tenant, key)."""

    claim_sql = sa.text(
        "INSERT INTO bench_handwritten_keys (tenant, key, fingerprint, state)"
        " VALUES (:tenant, :key, :fingerprint, 'running') ON CONFLICT DO NOTHING RETURNING key"
    )
    find_sql = sa.text(
        "SELECT fingerprint, state, status, body, headers FROM bench_handwritten_keys"
        " WHERE tenant = :tenant AND key = :key"
    )
    done_sql = sa.text(
        "UPDATE bench_handwritten_keys SET state = 'done', status = :status, body = :body,"
        " headers = :headers WHERE tenant = :tenant AND key = :key"
    )
    insert_done_sql = sa.text(
        "INSERT INTO bench_handwritten_keys (tenant, key, fingerprint, state, status, body,"
        " headers) VALUES (:tenant, :key, :fingerprint, 'done', :status, :body, :headers)"
    )
    release_sql = sa.text(
        "DELETE FROM bench_handwritten_keys WHERE tenant = :tenant AND key = :key"
        " AND state = 'running'"
    )

    def ids(self, key: str, digest: bytes) -> dict[str, t.Any]:
        return {"tenant": TENANT, "key": key, "fingerprint": digest}

    def claim(self, conn: sa.Connection, ids: dict[str, t.Any], *, atomic: bool) -> t.Any:
        # One transaction: the record is only inserted at the end, with the answer.
        if not atomic and conn.execute(self.claim_sql, ids).first() is not None:
            return _CLAIMED
        found = conn.execute(self.find_sql, ids).first()
        return _CLAIMED if atomic and found is None else found

    def complete(self, conn: sa.Connection, ids: dict[str, t.Any], *, atomic: bool) -> None:
        conn.execute(self.insert_done_sql if atomic else self.done_sql, ids)

    def release(self, conn: sa.Connection, ids: dict[str, t.Any]) -> None:
        conn.execute(self.release_sql, ids)


class _PartitionedSchema:
    """Records in flask_idem's ``idempotency_keys``, through its claim functions."""

    claim_sql = (
        "SELECT claimed, fingerprint, state, response_status AS status, response_body AS body,"
        " response_headers AS headers, created_at FROM {function}(%(tenant)s, %(endpoint)s,"
        " %(key)s, %(fingerprint)s, %(token)s, 86400.0, %(lease)s)"
    )
    # The atomic claim found the scope's lock held: a completed record may be replayed anyway.
    find_sql = (
        "SELECT fingerprint, state, response_status AS status, response_body AS body,"
        " response_headers AS headers FROM idempotency_keys WHERE tenant = %(tenant)s"
        " AND endpoint = %(endpoint)s AND key = %(key)s AND state = 'completed'"
        " AND expires_at > now() ORDER BY created_at DESC LIMIT 1"
    )
    owned = (
        " WHERE tenant = %(tenant)s AND endpoint = %(endpoint)s AND key = %(key)s"
        " AND claim_token = %(token)s AND state = 'in_progress' AND created_at = %(created_at)s"
    )
    done_sql = (
        "UPDATE idempotency_keys SET state = 'completed', lease_expires_at = NULL,"
        " response_status = %(status)s, response_headers = %(headers)s::jsonb,"
        " response_body = %(body)s, completed_at = now()" + owned
    )
    release_sql = "DELETE FROM idempotency_keys" + owned
    # The atomic claim only reserves its record (migration 0007): it is written once, completed.
    done_atomic_sql = (
        "INSERT INTO idempotency_keys (tenant, endpoint, key, fingerprint, state, claim_token,"
        " response_status, response_headers, response_body, created_at, completed_at,"
        " expires_at) VALUES (%(tenant)s, %(endpoint)s, %(key)s, %(fingerprint)s, 'completed',"
        " %(token)s, %(status)s, %(headers)s::jsonb, %(body)s, %(created_at)s, now(),"
        " %(created_at)s + interval '86400 seconds')"
    )

    def ids(self, key: str, digest: bytes) -> dict[str, t.Any]:
        return {
            "tenant": TENANT,
            "endpoint": f"POST {PAYMENT_PATH}",
            # As flask_idem stores it (revision 0011): its claim functions refuse raw keys.
            "key": unkeyed(TENANT, key),
            "fingerprint": digest,
            "token": secrets.token_hex(16),
        }

    def claim(self, conn: sa.Connection, ids: dict[str, t.Any], *, atomic: bool) -> t.Any:
        function = "idempotency_claim_reserve" if atomic else "idempotency_claim"
        sql = self.claim_sql.format(function=function)
        found = conn.exec_driver_sql(sql, ids | {"lease": 0.0 if atomic else 30.0}).first()
        if found is None:  # the atomic claim's try-lock: a duplicate holds the scope
            return conn.exec_driver_sql(self.find_sql, ids).first()
        if found.claimed:
            ids["created_at"] = found.created_at
            return _CLAIMED
        return found

    def complete(self, conn: sa.Connection, ids: dict[str, t.Any], *, atomic: bool) -> None:
        conn.exec_driver_sql(self.done_atomic_sql if atomic else self.done_sql, ids)

    def release(self, conn: sa.Connection, ids: dict[str, t.Any]) -> None:
        conn.exec_driver_sql(self.release_sql, ids)


def _hand_key() -> tuple[str, bytes] | None:
    """The request's key (None when missing or too long) and the body's digest."""
    key = request.headers.get("Idempotency-Key", "")
    if not 0 < len(key) <= 255:
        return None
    return key, hashlib.sha256(request.get_data()).digest()


def _hand_snapshot(answer: Response) -> dict[str, t.Any]:
    saved = {k: answer.headers[k] for k in ("Content-Type", "Location") if k in answer.headers}
    return {"status": answer.status_code, "body": answer.get_data(), "headers": json.dumps(saved)}


def _hand_answer(found: t.Any, digest: bytes) -> ResponseReturnValue:
    """What a record found answers: 409 unless completed; its stored answer, or 422."""
    if found is None or found.state not in ("done", "completed"):
        return _IN_PROGRESS
    if bytes(found.fingerprint) != digest:
        return {"error": "key reused with another request"}, 422
    saved = found.headers if isinstance(found.headers, dict) else json.loads(found.headers)
    return Response(bytes(found.body), found.status, saved | {"Idempotent-Replayed": "true"})


@contextlib.contextmanager
def _autocommit(engine: sa.Engine) -> t.Iterator[sa.Connection]:
    """A pooled connection in autocommit, the driver's flag flipped directly as flask_idem
    does: SQLAlchemy's ``AUTOCOMMIT`` isolation level would cost one more statement
    (``SET default_transaction_isolation``) each time the connection goes back to the pool."""
    with engine.connect() as conn:
        dbapi_connection = conn.connection.dbapi_connection
        assert dbapi_connection is not None
        dbapi_connection.autocommit = True
        try:
            yield conn
        finally:
            if not dbapi_connection.closed:
                dbapi_connection.autocommit = False


def _hand_layer(
    engine: sa.Engine, schema: _PlainSchema | _PartitionedSchema, *, atomic: bool
) -> t.Callable[[t.Callable[[], ResponseReturnValue]], t.Any]:
    def decorate(view: t.Callable[[], ResponseReturnValue]) -> t.Any:
        @functools.wraps(view)
        def wrapper() -> ResponseReturnValue:
            keyed = _hand_key()
            if keyed is None:
                return _KEY_REQUIRED
            ids = schema.ids(*keyed)
            if atomic:
                with engine.connect() as conn, conn.begin() as transaction:
                    found = schema.claim(conn, ids, atomic=True)
                    if found is not _CLAIMED:
                        transaction.rollback()
                        return _hand_answer(found, keyed[1])
                    g.bench_connection = conn
                    answer = current_app.make_response(view())
                    try:
                        schema.complete(conn, ids | _hand_snapshot(answer), atomic=True)
                    except sa.exc.IntegrityError:  # a duplicate committed first
                        transaction.rollback()
                        return _IN_PROGRESS
                    return answer
            with _autocommit(engine) as conn:
                found = schema.claim(conn, ids, atomic=False)
            if found is not _CLAIMED:
                return _hand_answer(found, keyed[1])
            try:
                with engine.begin() as g.bench_connection:
                    answer = current_app.make_response(view())
                    schema.complete(g.bench_connection, ids | _hand_snapshot(answer), atomic=False)
            except BaseException:
                with _autocommit(engine) as conn:
                    schema.release(conn, ids)
                raise
            return answer

        return wrapper

    return decorate


def handwritten(url: str | None = None) -> Flask:
    """The endpoint behind the durable hand-written layer: the reference flask_idem is
    compared with (same pool, same payment INSERT)."""
    return _handwritten("bench_handwritten", url, _PlainSchema(), atomic=False)


def handwritten_atomic(url: str | None = None) -> Flask:
    """The endpoint behind the one-commit hand-written layer, on a plain table."""
    return _handwritten("bench_handwritten_atomic", url, _PlainSchema(), atomic=True)


def handwritten_partitioned(url: str | None = None) -> Flask:
    """The durable hand-written layer on flask_idem's schema (needs ``alembic upgrade``)."""
    return _handwritten("bench_handwritten_partitioned", url, _PartitionedSchema(), atomic=False)


def handwritten_atomic_partitioned(url: str | None = None) -> Flask:
    """The one-commit hand-written layer on flask_idem's schema (needs ``alembic upgrade``)."""
    return _handwritten(
        "bench_handwritten_atomic_partitioned", url, _PartitionedSchema(), atomic=True
    )


def _handwritten(
    name: str, url: str | None, schema: _PlainSchema | _PartitionedSchema, *, atomic: bool
) -> Flask:
    app = Flask(name)
    engine = sa.create_engine(database_url(url), pool_size=10, max_overflow=20, pool_timeout=5)
    insert = payments.insert()

    @app.post(PAYMENT_PATH)
    @_hand_layer(engine, schema, atomic=atomic)
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
