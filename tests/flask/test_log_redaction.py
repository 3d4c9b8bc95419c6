"""What flask_idem logs about a failed statement never carries its parameters: with an
application's own Flask-SQLAlchemy engine (SQLAlchemy's ``hide_parameters`` is off), a store
statement failing while a view runs must log neither the raw idempotency key nor the claim
token, in any message or traceback. On both PostgreSQL drivers."""

from __future__ import annotations

import logging
import threading
import time
import typing as t

import flask
import pytest
import sqlalchemy as sa
from flask_sqlalchemy import SQLAlchemy

from flask_idem import Idempotency
from flask_idem.store import normalize_url
from flask_idem.store.messages import database_message, redacted
from tests.support.drivers import PG_DRIVERS, spelled_for

SECRET = "SECRET-raw-key-4f9a2c"


def _terminate_backends(server_url: str, database: str, stop: threading.Event) -> None:
    admin = sa.create_engine(server_url, isolation_level="AUTOCOMMIT")
    try:
        while not stop.wait(0.3):
            with admin.connect() as conn:
                conn.execute(
                    sa.text(
                        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                        "WHERE datname = :name AND pid <> pg_backend_pid()"
                    ),
                    {"name": database},
                )
    finally:
        admin.dispose()


@pytest.mark.parametrize("driver", PG_DRIVERS, ids=["psycopg2", "psycopg"])
def test_a_view_outliving_its_lease_on_a_dying_store_logs_no_key_and_no_token(
    fresh_pg_database: t.Callable[[], str],
    pg_server_url: str,
    caplog: pytest.LogCaptureFixture,
    driver: str,
) -> None:
    url = spelled_for(fresh_pg_database(), driver)
    db = SQLAlchemy()
    app = flask.Flask("redaction")
    app.config.update(
        SQLALCHEMY_DATABASE_URI=normalize_url(url).render_as_string(hide_password=False),
        IDEMPOTENCY_LEASE=1,
    )
    db.init_app(app)  # no engine_options: hide_parameters is False, as in the README
    idem = Idempotency(app, db=db, tenant=lambda: "alpha")

    @app.post("/slow")
    @idem.idempotent()
    def slow() -> t.Any:
        time.sleep(2.5)  # renewals fall due while the backends are being terminated
        return {"ok": True}, 201

    assert app.test_cli_runner().invoke(args=["idem", "db", "upgrade"]).exit_code == 0
    stop = threading.Event()
    killer = threading.Thread(
        target=_terminate_backends, args=(pg_server_url, sa.make_url(url).database, stop)
    )
    with caplog.at_level(logging.DEBUG):
        killer.start()
        try:
            app.test_client().post("/slow", headers={"Idempotency-Key": SECRET})
        finally:
            stop.set()
            killer.join()
    with app.app_context():
        tokens = db.session.execute(sa.text("SELECT claim_token FROM idempotency_keys"))
        secrets = [SECRET, *(token for token in tokens.scalars() if token)]
        db.session.remove()
        db.engine.dispose()
    assert any("lease renewal failed" in r.getMessage() for r in caplog.records)
    logged = caplog.text + "".join(
        f"{r.getMessage()}{r.exc_text or ''}{r.stack_info or ''}" for r in caplog.records
    )
    for secret in secrets:
        assert secret not in logged


@pytest.mark.parametrize("driver", PG_DRIVERS, ids=["psycopg2", "psycopg"])
def test_a_failed_statement_is_described_without_its_statement_parameters_or_row_values(
    fresh_pg_database: t.Callable[[], str], driver: str
) -> None:
    """A unique violation: SQLAlchemy prints the parameters and PostgreSQL's detail quotes the
    row (``Key (k)=(...) already exists``); neither reaches the rendering (psycopg 3 names the
    SQLSTATE ``sqlstate``, not ``pgcode``)."""
    engine = sa.create_engine(spelled_for(fresh_pg_database(), driver))
    try:
        with engine.begin() as conn:
            conn.execute(sa.text("CREATE TABLE t (k text PRIMARY KEY)"))
            conn.execute(sa.text("INSERT INTO t VALUES (:k)"), {"k": SECRET})
        with pytest.raises(sa.exc.IntegrityError) as raised, engine.begin() as conn:
            conn.execute(sa.text("INSERT INTO t VALUES (:k)"), {"k": SECRET})
    finally:
        engine.dispose()
    assert SECRET in str(raised.value)  # what a plain log.exception would show
    exc_info = redacted(raised.value)
    record = logging.LogRecord("t", logging.ERROR, __file__, 1, "failed", (), exc_info)
    logged = logging.Formatter().format(record)
    assert "in test_a_failed_statement" in logged, "the traceback's frames are kept"
    assert "IntegrityError" in logged and "SQLSTATE 23505" in logged
    for rendered in (logged, database_message(raised.value) or ""):
        assert SECRET not in rendered
