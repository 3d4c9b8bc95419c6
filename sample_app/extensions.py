"""The idempotency extension instance, shared by the app factory and the views' decorators."""

from __future__ import annotations

from flask_sqlalchemy import SQLAlchemy

from flask_idem import Idempotency

from .auth import current_tenant, operator_access

#: The app's Flask-SQLAlchemy. flask_idem runs on its engine and makes ``db.session`` the
#: business transaction of protected requests: the refunds view writes ORM models, the payments
#: view Core statements through ``idem.connection()`` (the session's connection); both commit
#: with the stored response.
db = SQLAlchemy()

#: Keys are scoped by the authenticated tenant: no tenant ever sees another's stored response.
#: The operator page (``/idempotency/operator``) is open to operators' sessions only.
idem = Idempotency(tenant=current_tenant, operator=operator_access, db=db)
