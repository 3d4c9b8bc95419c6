"""An engine given in ``IDEMPOTENCY_ENGINE`` is used as it is, with its settings (hidden
parameters, timeouts, READ COMMITTED), even when it reaches Flask-SQLAlchemy's database.
"""

from __future__ import annotations

from flask import Flask
from flask_sqlalchemy import SQLAlchemy

from flask_idem import Idempotency
from flask_idem.store import create_engine, normalize_url


def test_the_configured_engines_settings_survive(pg_url: str) -> None:
    configured = create_engine(pg_url)
    app = Flask("engine-settings")
    app.config.update(
        SQLALCHEMY_DATABASE_URI=normalize_url(pg_url).render_as_string(hide_password=False),
        IDEMPOTENCY_ENGINE=configured,
    )
    db = SQLAlchemy()
    db.init_app(app)
    Idempotency(app, tenant=lambda: "alpha")
    store_engine = app.extensions["idempotency"].store.engine
    try:
        assert store_engine.hide_parameters, "statement parameters (keys, bodies) are logged"
        with store_engine.connect() as conn:
            timeout = conn.exec_driver_sql("SHOW statement_timeout").scalar_one()
        assert timeout != "0", "the store's statements have no timeout"
    finally:
        configured.dispose()
        with app.app_context():
            db.engine.dispose()
