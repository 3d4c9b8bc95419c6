"""flask_idem's Alembic environment (installed as ``flask_idem.migrations``)."""
