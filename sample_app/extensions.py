"""The idempotency extension instance, shared by the app factory and the views' decorators."""

from __future__ import annotations

from flask_idem import Idempotency

from .auth import current_tenant, operator_access

#: Keys are scoped by the authenticated tenant: no tenant ever sees another's stored response.
#: The operator page (``/idempotency/operator``) is open to operators' sessions only.
idem = Idempotency(tenant=current_tenant, operator=operator_access)
