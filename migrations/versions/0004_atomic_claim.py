"""The atomic claim: a claim inside the caller's business transaction.

``idempotency_claim_atomic(...)`` is ``idempotency_claim(...)`` for views whose effects are all
in the database (``@idem.idempotent(atomic=True)``): it runs in the view's own transaction, so
the claim, the business rows and the stored response commit together (one commit), and a
crash rolls all of it back. Two differences:

- it *tries* the scope's advisory lock (``pg_try_advisory_xact_lock``): the lock is held until
  the business transaction ends, so a concurrent duplicate must not wait for the whole view;
  it gets no row back and answers 409 at once;
- it insists on READ COMMITTED: under REPEATABLE READ the lookup would use a snapshot taken
  before the lock and could miss the record the previous lock holder just committed.

Both claims take the same lock, so they exclude each other as well. The function is derived
from ``idempotency_claim`` (revisions 0001 and 0002), so the lookup and the insert are the
same SQL.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01
"""

from __future__ import annotations

import importlib.util
import pathlib
import types

from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

SIGNATURE = (
    "idempotency_claim_atomic(text, text, text, bytea, text, double precision, double precision)"
)

# The blocking lock of ``idempotency_claim`` and what takes its place.
BLOCKING_LOCK = """    PERFORM pg_advisory_xact_lock(
        hashtext('flask_idem'),
        hashtext(p_tenant || E'\\x1f' || p_endpoint || E'\\x1f' || p_key));"""
TRY_LOCK = """    IF current_setting('transaction_isolation') <> 'read committed' THEN
        RAISE EXCEPTION 'an atomic idempotency claim needs READ COMMITTED, not %',
            current_setting('transaction_isolation');
    END IF;
    -- Held until the business transaction ends: a duplicate gets no row (busy), never a wait.
    IF NOT pg_try_advisory_xact_lock(
        hashtext('flask_idem'),
        hashtext(p_tenant || E'\\x1f' || p_endpoint || E'\\x1f' || p_key)) THEN
        RETURN;
    END IF;"""


def _revision(name: str) -> types.ModuleType:
    path = pathlib.Path(__file__).with_name(f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"flask_idem_revision_{name[:4]}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def atomic_claim_function() -> str:
    """``idempotency_claim`` as of revision 0002, with the try-lock and its own name.

    It keeps the ``p_lease`` argument: the caller passes 0, so the lease of a row that is never
    seen in progress by anyone else "ends" at the claim (should it ever commit in progress, it
    shows as stuck at once).
    """
    first, second = _revision("0001_idempotency_keys"), _revision("0002_outcome_model")
    source = first.CLAIM_FUNCTION.replace(second.OLD_CLAIM_LIVE, second.NEW_CLAIM_LIVE)
    if BLOCKING_LOCK not in source or second.NEW_CLAIM_LIVE not in source:
        raise RuntimeError("revision 0001's claim function is not the one this revision expects")
    return source.replace(BLOCKING_LOCK, TRY_LOCK).replace(
        "CREATE FUNCTION idempotency_claim(", "CREATE FUNCTION idempotency_claim_atomic(", 1
    )


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(atomic_claim_function())


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(f"DROP FUNCTION IF EXISTS {SIGNATURE}")
