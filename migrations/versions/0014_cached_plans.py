"""The request path's writes and the completed-record lookup run on plans each connection keeps;
the ``expires_at`` index stays on DEFAULT only.

Planning, not executing, was most of what the database spent on a durable completion: the
``UPDATE`` of the partitioned table, sent with its values as literals (psycopg2 binds on the
client), was parsed, analysed and planned for every request (about 70 us of planning against
35 us of executing, measured with ``pg_stat_statements``; docs/performance.md). A statement
inside a PL/pgSQL function is prepared once per server connection and its plan kept there: it
survives PgBouncer in transaction pooling (the plan belongs to the server connection, whichever
client borrows it), where ``PREPARE`` does not. The functions below hold the statements the
store sent as text:

- ``idempotency_complete(...)``: the completion of a durable claim (fenced by the claim's
  token, in progress only), one row returned per record completed. ``force_generic_plan``:
  a custom plan prunes to one partition while planning and so always looks cheaper than the
  generic one, which prunes when it starts (``created_at = p_created_at``), and PostgreSQL's
  plan cache would plan it again on every call;
- ``idempotency_complete_reserved(...)``: the record an atomic claim reserved, inserted
  completed, only by the transaction holding the reservation (revision 0007);
- ``idempotency_find_completed(...)``: the live completed record of a scope, read without the
  scope's lock: an atomic request looks for it before it opens its business transaction, so
  that a replay is one statement with no transaction, and an atomic claim that found the
  scope's lock held replays it (the proof is at ``_FIND_COMPLETED`` in
  ``flask_idem/store/postgresql.py``). Live is the claim functions' own test (revision 0002),
  at this function's clock, and partitions starting a day or more after it are pruned as the
  claims prune them (revision 0006).

The claim functions are unchanged: their lookup already ran on a kept generic plan.

The ``expires_at`` index of every day's partition goes (about 65 of the WAL bytes of a new
key): it served only the purge of DEFAULT's expired rows; a day's partition is dropped whole,
after a check that reads it without that index. DEFAULT keeps an index of its own on
``expires_at`` (``ix_idempotency_keys_default_expires_at``); partitions made later have none.
DEFAULT's index is built first (it blocks writes to DEFAULT, which holds only rows claimed
while upkeep was behind, while it reads them); the table's is dropped last, under an ACCESS
EXCLUSIVE lock on the table that the upgrade's commit releases (no data is read). SQLite keeps
its index: its one table is all DEFAULT.

On PostgreSQL 13, which prunes partitions of an ``UPDATE`` only while planning, the completion's
generic plan probes the primary key of every partition (not measured here: the suite runs on
PostgreSQL 15, where the plan prunes when it starts).

Downgrade: the functions go (the store of an earlier release sends its statements as text),
and the index is built again on the table, which reads every partition once.

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-07
"""

from __future__ import annotations

from alembic import op

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None

TABLE = "idempotency_keys"
INDEX = "ix_idempotency_keys_expires_at"
DEFAULT_INDEX = "ix_idempotency_keys_default_expires_at"

COMPLETE = """CREATE OR REPLACE FUNCTION idempotency_complete(
    p_tenant text, p_endpoint text, p_key text, p_token text, p_created_at timestamptz,
    p_state text, p_status integer, p_headers jsonb, p_body bytea
) RETURNS SETOF integer LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan AS $$
BEGIN
    -- The record's created_at names its partition (pruned as the plan starts); without it
    -- (a caller that does not know it) every partition is searched.
    IF p_created_at IS NULL THEN
        RETURN QUERY
            UPDATE idempotency_keys AS k
               SET state = p_state, response_status = p_status, response_headers = p_headers,
                   response_body = p_body, completed_at = statement_timestamp(),
                   lease_expires_at = NULL
             WHERE k.tenant = p_tenant AND k.endpoint = p_endpoint AND k.key = p_key
               AND k.claim_token = p_token AND k.state = 'in_progress'
            RETURNING 1;
    ELSE
        RETURN QUERY
            UPDATE idempotency_keys AS k
               SET state = p_state, response_status = p_status, response_headers = p_headers,
                   response_body = p_body, completed_at = statement_timestamp(),
                   lease_expires_at = NULL
             WHERE k.tenant = p_tenant AND k.endpoint = p_endpoint AND k.key = p_key
               AND k.claim_token = p_token AND k.state = 'in_progress'
               AND k.created_at = p_created_at
            RETURNING 1;
    END IF;
END
$$
"""

COMPLETE_RESERVED = """CREATE OR REPLACE FUNCTION idempotency_complete_reserved(
    p_tenant text, p_endpoint text, p_key text, p_fingerprint bytea, p_token text,
    p_created_at timestamptz, p_expires_at timestamptz,
    p_state text, p_status integer, p_headers jsonb, p_body bytea
) RETURNS SETOF integer LANGUAGE plpgsql AS $$
BEGIN
    -- Only the transaction that reserved the record (idempotency_claim_reserve set this
    -- setting, local to it, with its token): never after the view ended that transaction
    -- itself, whose rollback released the scope's lock.
    IF current_setting('flask_idem.reserved', true) IS DISTINCT FROM p_token THEN
        RETURN;
    END IF;
    RETURN QUERY
        INSERT INTO idempotency_keys (
            tenant, endpoint, key, fingerprint, state, claim_token, response_status,
            response_headers, response_body, created_at, completed_at, expires_at)
        VALUES (
            p_tenant, p_endpoint, p_key, p_fingerprint, p_state, p_token, p_status,
            p_headers, p_body, p_created_at, statement_timestamp(), p_expires_at)
        RETURNING 1;
END
$$
"""

FIND_COMPLETED = """CREATE OR REPLACE FUNCTION idempotency_find_completed(
    p_tenant text, p_endpoint text, p_key text
) RETURNS TABLE (
    claimed boolean, fingerprint bytea, state text, claim_token text,
    lease_expires_at timestamptz, response_status integer, response_headers jsonb,
    response_body bytea, created_at timestamptz, completed_at timestamptz,
    expires_at timestamptz, db_now timestamptz
) LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    v_now timestamptz;
BEGIN
    -- The claims' bounds and quiet log when the session has none (behind a transaction
    -- pooler, an application's engine): an atomic request sends this before its claim, so a
    -- table locked by DDL answers 503 after 4 s here too, never a wait without end (0008).
    IF current_setting('lock_timeout') = '0' THEN
        PERFORM set_config('lock_timeout', '4s', true);
    END IF;
    IF current_setting('statement_timeout') = '0' THEN
        PERFORM set_config('statement_timeout', '4s', true);
    END IF;
    IF current_setting('log_min_error_statement') <> 'panic' THEN
        BEGIN
            PERFORM set_config('log_min_error_statement', 'panic', true);
        EXCEPTION WHEN insufficient_privilege THEN
            NULL;  -- no GRANT SET: the store warned at its first connection
        END;
    END IF;
    v_now := clock_timestamp();
    -- The claim functions' liveness (0002) and horizon (0006), at this clock.
    RETURN QUERY
        SELECT false, k.fingerprint, k.state::text, k.claim_token::text, k.lease_expires_at,
               k.response_status, k.response_headers, k.response_body, k.created_at,
               k.completed_at, k.expires_at, v_now
          FROM idempotency_keys AS k
         WHERE k.tenant = p_tenant AND k.endpoint = p_endpoint AND k.key = p_key
           AND k.state = 'completed'
           AND (k.expires_at > v_now
                OR coalesce(k.completed_at, k.lease_expires_at, k.created_at)
                   + (k.expires_at - k.created_at) > v_now)
           AND k.created_at < v_now + interval '1 day'
         ORDER BY k.created_at DESC
         LIMIT 1;
END
$$
"""

FUNCTIONS = (
    "idempotency_complete(text, text, text, text, timestamptz, text, integer, jsonb, bytea)",
    "idempotency_complete_reserved(text, text, text, bytea, text, timestamptz, timestamptz, "
    "text, integer, jsonb, bytea)",
    "idempotency_find_completed(text, text, text)",
)


def upgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    op.execute(COMPLETE)
    op.execute(COMPLETE_RESERVED)
    op.execute(FIND_COMPLETED)
    # DEFAULT's own index first (it blocks writes to DEFAULT alone while it reads it), then the
    # table's: its ACCESS EXCLUSIVE lock, held until the commit, comes last.
    op.create_index(DEFAULT_INDEX, f"{TABLE}_default", ["expires_at"])
    op.drop_index(INDEX, table_name=TABLE)


def downgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    op.drop_index(DEFAULT_INDEX, table_name=f"{TABLE}_default")
    op.create_index(INDEX, TABLE, ["expires_at"])
    for function in FUNCTIONS:
        op.execute(f"DROP FUNCTION {function}")
