"""Sample payments API showing flask_idem under a real server.

``gunicorn 'sample_app:create_app()'`` with ``DATABASE_URL`` set (PostgreSQL or SQLite, after
``make migrate``); ``make run`` serves it on an embedded SQLite database under ``instance/``.
"""

from __future__ import annotations

import os

import sqlalchemy as sa
from flask import Flask
from werkzeug.exceptions import HTTPException

from flask_idem.store import engine_options, normalize_url

from . import jobs, problems, provider, ratelimit, reconcilers  # noqa: F401 (registers)
from .auth import api_key_id, authenticate
from .extensions import db, idem
from .models import init_db_command
from .views import bp
from .webhooks import bp as webhooks_bp

#: ``SAMPLE_*`` settings, read from the environment of the same name.
SAMPLE_DEFAULTS = {
    "SAMPLE_RATE_LIMIT": "1000/second",
    "SAMPLE_PROVIDER_LATENCY_MS": "0",
    "SAMPLE_PROVIDER_TRANSIT_MS": "0",
    "SAMPLE_PROVIDER_LOG": None,
    "SAMPLE_WEBHOOK_LATENCY_MS": "0",
    # "true": idempotency keys per API key inside the tenant (IDEMPOTENCY_PRINCIPAL).
    "SAMPLE_KEYS_PER_API_KEY": "false",
    "SAMPLE_METRICS_TOKEN": None,
}


def create_app() -> Flask:
    """Build the app. Hook order is the point: authentication, then the rate limit, then the
    idempotency claim (Flask runs ``before_request`` hooks in registration order)."""
    app = Flask(__name__)
    app.config["IDEMPOTENCY_DATABASE_URL"] = os.environ.get(
        "DATABASE_URL", f"sqlite:///{os.path.join(app.instance_path, 'flask_idem.sqlite3')}"
    )
    app.config.update(
        {name: os.environ.get(name, value) for name, value in SAMPLE_DEFAULTS.items()}
    )
    # The API's own problem types (card-declined, ...) and the extension's, under the API's
    # documentation URL. A real API uses a URL it owns; ".example" is reserved (RFC 2606).
    app.config["IDEMPOTENCY_PROBLEM_BASE"] = "https://payments.example/problems/"
    # Prometheus counters fed by the extension's signals, served on /metrics (under gunicorn
    # with several workers: ``-c python:sample_app.gunicorn_conf``, multiprocess mode).
    app.config["IDEMPOTENCY_METRICS"] = True
    # FLASK_IDEMPOTENCY_TTL=2 -> IDEMPOTENCY_TTL, FLASK_IDEMPOTENCY_AUDIT=true, and so on.
    app.config.from_prefixed_env()
    # Each API key has keys of its own (its id is the principal, never the key); with
    # FLASK_IDEMPOTENCY_SCOPE=account a key is one operation of the account across the API's
    # POST endpoints (a payment's key reused for a refund is 422).
    if str(app.config["SAMPLE_KEYS_PER_API_KEY"]).lower() == "true":
        app.config["IDEMPOTENCY_PRINCIPAL"] = api_key_id
    url = app.config["IDEMPOTENCY_DATABASE_URL"]
    # Members in the documented order (id first), not sorted.
    app.json.sort_keys = False  # type: ignore[attr-defined]

    # Problem documents for every HTTP error, registered before the extension so that its own
    # 500 handler defers to this one.
    app.register_error_handler(HTTPException, problems.from_http_error)
    app.register_error_handler(500, problems.from_http_error)
    app.register_error_handler(sa.exc.OperationalError, problems.database_unavailable)
    app.before_request(authenticate)
    ratelimit.init_app(app, url)
    # flask_idem's engine settings (timeouts, the client-side deadline, READ COMMITTED) for the
    # engine Flask-SQLAlchemy builds, which the extension then uses.
    app.config["SQLALCHEMY_DATABASE_URI"] = normalize_url(url).render_as_string(hide_password=False)
    app.config["SQLALCHEMY_ENGINE_OPTIONS"] = engine_options(url)
    db.init_app(app)
    idem.init_app(app)
    provider.init_app(app, url)
    app.register_blueprint(bp)
    app.register_blueprint(webhooks_bp)
    # Imported here, not with this package: ``-c python:sample_app.gunicorn_conf`` imports the
    # package before the config sets PROMETHEUS_MULTIPROC_DIR, and prometheus_client picks
    # per-process or multiprocess counters once, when it is first imported.
    from flask_idem.ops import metrics

    app.add_url_rule("/metrics", "metrics", metrics.view)
    app.cli.add_command(init_db_command)
    return app
