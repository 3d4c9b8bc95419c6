"""Stored keys become digests: the raw idempotency key is no longer kept in the table.

Every row's ``key`` becomes ``$sha256$`` followed by the hex SHA-256 of
``b"flask_idem key\\x00"``, then the tenant and the key, each written as ``<bytes>:<text>``
(its length in UTF-8 bytes, a colon, the text): what the store writes for a new key when
``IDEMPOTENCY_KEY_SECRETS`` is not set (``flask_idem.core.key_digest.unkeyed``). The migration
has no secret: with a secret configured afterwards, list ``sha256`` after it
(``IDEMPOTENCY_KEY_SECRETS = "k1:...,sha256"``) until these rows have expired (one TTL), so
that a retry of a request made before the deploy still finds its record (docs/encryption.md).

Fingerprints are untouched: unkeyed, the stored fingerprint is the request's SHA-256 as
before. A row whose key already starts with ``$`` is left as it is (``$`` is not in the key
alphabet, so no key a client sent starts with it): the upgrade can be run again.

Stored responses encrypted before this revision are bound to the raw key; the store still
opens them for a request that carries that key (a retry), but not from the table alone
(``flask idem show`` by key hash, the operator page): they say "does not authenticate" there.

The audit trail is not rewritten: its ``lookup`` of rows written before this revision is the
raw key's, which ``flask idem history`` still computes from the key it is given.

The claim functions (the durable one of 0010, the atomic one of 0009, and 0006's of releases
before 0007) refuse a key that is no digest: the store of this release digests every key it
sends, and a worker of an older release, which sends raw keys that no longer meet the digested
rows, gets an error (503) instead of claiming a key a second time. Their texts below are whole:
the earlier ones with that one test added after ``BEGIN``. Its other statements (completion,
release) find no row either and change nothing: deploy with the old workers stopped
(docs/encryption.md, "Upgrading to digested keys").

Downgrade: digests cannot be turned back into keys. The downgrade refuses while live digested
rows exist (an older release would not find them, and would run their retries again); with
none it puts the earlier functions back (copied below).

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-03
"""

from __future__ import annotations

import hashlib

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None

#: The digest's prefix, hashed before the tenant and the key.
CONTEXT = b"flask_idem key\x00"

#: PostgreSQL: every raw key, digested in place (one statement: a claim waits for its row).
#: The lengths are of the UTF-8 bytes, as Python counts them, whatever the server encoding.
DIGEST_KEYS = f"""
UPDATE idempotency_keys
   SET key = '$sha256$' || encode(sha256(
           decode('{CONTEXT.hex()}', 'hex')
           || convert_to(octet_length(convert_to(tenant, 'UTF8'))::text || ':', 'UTF8')
           || convert_to(tenant, 'UTF8')
           || convert_to(octet_length(convert_to(key, 'UTF8'))::text || ':', 'UTF8')
           || convert_to(key, 'UTF8')), 'hex')
 WHERE substr(key, 1, 1) <> '$'
"""

#: The durable claim from this revision on: revision 0010's, refusing raw keys.
CLAIM = r"""CREATE OR REPLACE FUNCTION idempotency_claim(
    p_tenant text, p_endpoint text, p_key text, p_fingerprint bytea, p_token text,
    p_ttl double precision, p_lease double precision
) RETURNS TABLE (
    claimed boolean, fingerprint bytea, state text, claim_token text,
    lease_expires_at timestamptz, response_status integer, response_headers jsonb,
    response_body bytea, created_at timestamptz, completed_at timestamptz,
    expires_at timestamptz, db_now timestamptz
) LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    v_now timestamptz;
    v_pinned bigint;
BEGIN
    -- From revision 0011 keys are stored as digests ($<id>$<hex>; no key a client sends
    -- starts with $). A worker of an older release sends the raw key, which no longer meets
    -- the digested records: refuse it (503 for that worker), never claim the key again.
    IF left(p_key, 1) <> '$' THEN
        RAISE EXCEPTION 'keys are stored as digests since revision 0011: upgrade this worker';
    END IF;
    -- Bounds and a quiet log for this transaction when the session has none
    -- (behind a transaction pooler): local settings, gone with the transaction (0008).
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
    -- Every claim of one scope queues here, whichever partition holds its record.
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        RAISE EXCEPTION 'an idempotency claim needs READ COMMITTED, not %',
            current_setting('transaction_isolation');
    END IF;
    IF current_setting('citus.version', true) IS NULL THEN
        PERFORM pg_advisory_xact_lock(
            hashtext('flask_idem'),
            hashtext(p_tenant || E'\x1f' || p_endpoint || E'\x1f' || p_key));
    ELSE
        -- On Citus (0010) this function runs on whichever node the claim reached or was
        -- delegated to, and a shard move can switch the tenant to another worker while it
        -- runs. The lock is taken where the tenant's shard is, by a query Citus routes there
        -- whole, in this transaction (the lookup and the insert then go over that same
        -- connection). The query is a write that deletes nothing (no row is dated before
        -- -infinity): Citus takes the shard's metadata lock for it on this node, so a move
        -- that blocks writes has either finished switching the tenant before this query
        -- routes, or waits for this transaction to end; every claim of the scope, from any
        -- node, meets on the one lock on the shard's current worker. No lock is taken on
        -- this node first: held while this query waits for a move, it could close a cycle
        -- of waits with the move and a claim already pinned from another node.
        WITH pinned AS (
            DELETE FROM idempotency_keys_default AS d
             WHERE d.tenant = p_tenant AND d.endpoint = p_endpoint AND d.key = p_key
               AND d.created_at < '-infinity'
            RETURNING *)
        SELECT s.n INTO v_pinned
          FROM (SELECT count(*) AS n FROM pinned) AS s
         WHERE pg_advisory_xact_lock(
                   hashtext('flask_idem'),
                   hashtext(p_tenant || E'\x1f' || p_endpoint || E'\x1f' || p_key))
               IS NOT NULL;
    END IF;
    -- Read the clock after the lock: a waiter never dates its row before the winner's.
    v_now := clock_timestamp();
    -- A record is live until its TTL ends, and, while in progress, as long as its owner holds
    -- the lease: a request still running past the TTL must never let a retry run again.
    RETURN QUERY
        SELECT false, k.fingerprint, k.state::text, k.claim_token::text, k.lease_expires_at,
               k.response_status, k.response_headers, k.response_body, k.created_at,
               k.completed_at, k.expires_at, v_now
          FROM idempotency_keys AS k
         WHERE k.tenant = p_tenant AND k.endpoint = p_endpoint AND k.key = p_key
           AND (k.expires_at > v_now
                OR coalesce(k.completed_at, k.lease_expires_at, k.created_at)
                   + (k.expires_at - k.created_at) > v_now)
           -- No record of this scope was made a day or more after this clock (0006).
           AND k.created_at < v_now + interval '1 day'
         ORDER BY k.created_at DESC
         LIMIT 1;
    IF FOUND THEN
        RETURN;
    END IF;
    RETURN QUERY
        WITH inserted AS (
            INSERT INTO idempotency_keys (
                tenant, endpoint, key, fingerprint, state, claim_token,
                lease_expires_at, created_at, expires_at)
            VALUES (
                p_tenant, p_endpoint, p_key, p_fingerprint, 'in_progress', p_token,
                v_now + make_interval(secs => p_lease), v_now,
                v_now + make_interval(secs => p_ttl))
            RETURNING *)
        SELECT true, i.fingerprint, i.state::text, i.claim_token::text, i.lease_expires_at,
               i.response_status, i.response_headers, i.response_body, i.created_at,
               i.completed_at, i.expires_at, v_now
          FROM inserted AS i;
END
$$

"""


#: The atomic claim from this revision on: revision 0009's, refusing raw keys.
RESERVE = r"""CREATE OR REPLACE FUNCTION idempotency_claim_reserve(
    p_tenant text, p_endpoint text, p_key text, p_fingerprint bytea, p_token text,
    p_ttl double precision, p_lease double precision
) RETURNS TABLE (
    claimed boolean, fingerprint bytea, state text, claim_token text,
    lease_expires_at timestamptz, response_status integer, response_headers jsonb,
    response_body bytea, created_at timestamptz, completed_at timestamptz,
    expires_at timestamptz, db_now timestamptz
) LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    v_now timestamptz;
    v_locked boolean;
BEGIN
    -- From revision 0011 keys are stored as digests ($<id>$<hex>; no key a client sends
    -- starts with $). A worker of an older release sends the raw key, which no longer meets
    -- the digested records: refuse it (503 for that worker), never claim the key again.
    IF left(p_key, 1) <> '$' THEN
        RAISE EXCEPTION 'keys are stored as digests since revision 0011: upgrade this worker';
    END IF;
    -- Bounds and a quiet log for this transaction when the session has none
    -- (behind a transaction pooler): local settings, gone with the transaction (0008).
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
    -- Every claim of one scope queues here, whichever partition holds its record.
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        RAISE EXCEPTION 'an idempotency claim needs READ COMMITTED, not %',
            current_setting('transaction_isolation');
    END IF;
    -- Held until the business transaction ends: a duplicate gets no row, never a wait.
    IF NOT pg_try_advisory_xact_lock(
        hashtext('flask_idem'),
        hashtext(p_tenant || E'\x1f' || p_endpoint || E'\x1f' || p_key)) THEN
        RETURN;
    END IF;
    -- On Citus (0009) the node running this function may be any node that accepts queries:
    -- the same lock, held until the same end, is also taken on the worker holding the
    -- tenant's shard, by a query Citus routes there whole, in this distributed transaction
    -- (the lookup and the record's insert then go over that same connection). The query is a
    -- write that deletes nothing (no row is dated before -infinity), so that Citus holds the
    -- shard's metadata lock until the transaction ends: a shard move cannot switch the
    -- tenant to another worker, where this lock is not, while the claim is held.
    IF current_setting('citus.version', true) IS NOT NULL THEN
        WITH pinned AS (
            DELETE FROM idempotency_keys_default AS d
             WHERE d.tenant = p_tenant AND d.endpoint = p_endpoint AND d.key = p_key
               AND d.created_at < '-infinity'
            RETURNING 1)
        SELECT pg_try_advisory_xact_lock(
                   hashtext('flask_idem'),
                   hashtext(p_tenant || E'\x1f' || p_endpoint || E'\x1f' || p_key))
          INTO v_locked
          FROM (SELECT count(*) FROM pinned) AS s;
        IF NOT v_locked THEN
            RETURN;
        END IF;
    END IF;
    -- Read the clock after the lock: a waiter never dates its row before the winner's.
    v_now := clock_timestamp();
    -- A record is live until its TTL ends, and, while in progress, as long as its owner holds
    -- the lease: a request still running past the TTL must never let a retry run again.
    RETURN QUERY
        SELECT false, k.fingerprint, k.state::text, k.claim_token::text, k.lease_expires_at,
               k.response_status, k.response_headers, k.response_body, k.created_at,
               k.completed_at, k.expires_at, v_now
          FROM idempotency_keys AS k
         WHERE k.tenant = p_tenant AND k.endpoint = p_endpoint AND k.key = p_key
           AND (k.expires_at > v_now
                OR coalesce(k.completed_at, k.lease_expires_at, k.created_at)
                   + (k.expires_at - k.created_at) > v_now)
           -- No record of this scope was made a day or more after this clock (0006).
           AND k.created_at < v_now + interval '1 day'
         ORDER BY k.created_at DESC
         LIMIT 1;
    IF FOUND THEN
        RETURN;
    END IF;
    -- A setting local to this transaction (it ends with it, as the lock does): the
    -- completion inserts the record only while it still reads this claim's token, so never
    -- after the view ended the transaction itself (a rollback releases the lock, and a
    -- duplicate may then have run).
    PERFORM set_config('flask_idem.reserved', p_token, true);
    RETURN QUERY
        -- Reserved, not written: the store inserts it completed before the commit.
        SELECT true, p_fingerprint, 'in_progress'::text, p_token, v_now + make_interval(
                   secs => p_lease), NULL::integer, NULL::jsonb, NULL::bytea, v_now,
               NULL::timestamptz, v_now + make_interval(secs => p_ttl), v_now;
END
$$
"""


#: The atomic claim of releases before 0007 (kept for their workers): revision 0006's,
#: refusing raw keys.
ATOMIC = r"""
CREATE OR REPLACE FUNCTION idempotency_claim_atomic(
    p_tenant text, p_endpoint text, p_key text, p_fingerprint bytea, p_token text,
    p_ttl double precision, p_lease double precision
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
    -- From revision 0011 keys are stored as digests ($<id>$<hex>; no key a client sends
    -- starts with $). A worker of an older release sends the raw key, which no longer meets
    -- the digested records: refuse it (503 for that worker), never claim the key again.
    IF left(p_key, 1) <> '$' THEN
        RAISE EXCEPTION 'keys are stored as digests since revision 0011: upgrade this worker';
    END IF;
    -- Every claim of one scope queues here, whichever partition holds its record.
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        RAISE EXCEPTION 'an idempotency claim needs READ COMMITTED, not %',
            current_setting('transaction_isolation');
    END IF;
    -- Held until the business transaction ends: a duplicate gets no row, never a wait.
    IF NOT pg_try_advisory_xact_lock(
        hashtext('flask_idem'),
        hashtext(p_tenant || E'\x1f' || p_endpoint || E'\x1f' || p_key)) THEN
        RETURN;
    END IF;
    -- Read the clock after the lock: a waiter never dates its row before the winner's.
    v_now := clock_timestamp();
    -- A record is live until its TTL ends, and, while in progress, as long as its owner holds
    -- the lease: a request still running past the TTL must never let a retry run again.
    RETURN QUERY
        SELECT false, k.fingerprint, k.state::text, k.claim_token::text, k.lease_expires_at,
               k.response_status, k.response_headers, k.response_body, k.created_at,
               k.completed_at, k.expires_at, v_now
          FROM idempotency_keys AS k
         WHERE k.tenant = p_tenant AND k.endpoint = p_endpoint AND k.key = p_key
           AND (k.expires_at > v_now
                OR coalesce(k.completed_at, k.lease_expires_at, k.created_at)
                   + (k.expires_at - k.created_at) > v_now)
           -- No record of this scope was made a day or more after this clock (0006).
           AND k.created_at < v_now + interval '1 day'
         ORDER BY k.created_at DESC
         LIMIT 1;
    IF FOUND THEN
        RETURN;
    END IF;
    RETURN QUERY
        WITH inserted AS (
            INSERT INTO idempotency_keys (
                tenant, endpoint, key, fingerprint, state, claim_token,
                lease_expires_at, created_at, expires_at)
            VALUES (
                p_tenant, p_endpoint, p_key, p_fingerprint, 'in_progress', p_token,
                v_now + make_interval(secs => p_lease), v_now,
                v_now + make_interval(secs => p_ttl))
            RETURNING *)
        SELECT true, i.fingerprint, i.state::text, i.claim_token::text, i.lease_expires_at,
               i.response_status, i.response_headers, i.response_body, i.created_at,
               i.completed_at, i.expires_at, v_now
          FROM inserted AS i;
END
$$;
"""


#: Revision 0010's durable claim, copied, for the downgrade.
CLAIM_0010 = r"""CREATE OR REPLACE FUNCTION idempotency_claim(
    p_tenant text, p_endpoint text, p_key text, p_fingerprint bytea, p_token text,
    p_ttl double precision, p_lease double precision
) RETURNS TABLE (
    claimed boolean, fingerprint bytea, state text, claim_token text,
    lease_expires_at timestamptz, response_status integer, response_headers jsonb,
    response_body bytea, created_at timestamptz, completed_at timestamptz,
    expires_at timestamptz, db_now timestamptz
) LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    v_now timestamptz;
    v_pinned bigint;
BEGIN
    -- Bounds and a quiet log for this transaction when the session has none
    -- (behind a transaction pooler): local settings, gone with the transaction (0008).
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
    -- Every claim of one scope queues here, whichever partition holds its record.
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        RAISE EXCEPTION 'an idempotency claim needs READ COMMITTED, not %',
            current_setting('transaction_isolation');
    END IF;
    IF current_setting('citus.version', true) IS NULL THEN
        PERFORM pg_advisory_xact_lock(
            hashtext('flask_idem'),
            hashtext(p_tenant || E'\x1f' || p_endpoint || E'\x1f' || p_key));
    ELSE
        -- On Citus (0010) this function runs on whichever node the claim reached or was
        -- delegated to, and a shard move can switch the tenant to another worker while it
        -- runs. The lock is taken where the tenant's shard is, by a query Citus routes there
        -- whole, in this transaction (the lookup and the insert then go over that same
        -- connection). The query is a write that deletes nothing (no row is dated before
        -- -infinity): Citus takes the shard's metadata lock for it on this node, so a move
        -- that blocks writes has either finished switching the tenant before this query
        -- routes, or waits for this transaction to end; every claim of the scope, from any
        -- node, meets on the one lock on the shard's current worker. No lock is taken on
        -- this node first: held while this query waits for a move, it could close a cycle
        -- of waits with the move and a claim already pinned from another node.
        WITH pinned AS (
            DELETE FROM idempotency_keys_default AS d
             WHERE d.tenant = p_tenant AND d.endpoint = p_endpoint AND d.key = p_key
               AND d.created_at < '-infinity'
            RETURNING *)
        SELECT s.n INTO v_pinned
          FROM (SELECT count(*) AS n FROM pinned) AS s
         WHERE pg_advisory_xact_lock(
                   hashtext('flask_idem'),
                   hashtext(p_tenant || E'\x1f' || p_endpoint || E'\x1f' || p_key))
               IS NOT NULL;
    END IF;
    -- Read the clock after the lock: a waiter never dates its row before the winner's.
    v_now := clock_timestamp();
    -- A record is live until its TTL ends, and, while in progress, as long as its owner holds
    -- the lease: a request still running past the TTL must never let a retry run again.
    RETURN QUERY
        SELECT false, k.fingerprint, k.state::text, k.claim_token::text, k.lease_expires_at,
               k.response_status, k.response_headers, k.response_body, k.created_at,
               k.completed_at, k.expires_at, v_now
          FROM idempotency_keys AS k
         WHERE k.tenant = p_tenant AND k.endpoint = p_endpoint AND k.key = p_key
           AND (k.expires_at > v_now
                OR coalesce(k.completed_at, k.lease_expires_at, k.created_at)
                   + (k.expires_at - k.created_at) > v_now)
           -- No record of this scope was made a day or more after this clock (0006).
           AND k.created_at < v_now + interval '1 day'
         ORDER BY k.created_at DESC
         LIMIT 1;
    IF FOUND THEN
        RETURN;
    END IF;
    RETURN QUERY
        WITH inserted AS (
            INSERT INTO idempotency_keys (
                tenant, endpoint, key, fingerprint, state, claim_token,
                lease_expires_at, created_at, expires_at)
            VALUES (
                p_tenant, p_endpoint, p_key, p_fingerprint, 'in_progress', p_token,
                v_now + make_interval(secs => p_lease), v_now,
                v_now + make_interval(secs => p_ttl))
            RETURNING *)
        SELECT true, i.fingerprint, i.state::text, i.claim_token::text, i.lease_expires_at,
               i.response_status, i.response_headers, i.response_body, i.created_at,
               i.completed_at, i.expires_at, v_now
          FROM inserted AS i;
END
$$

"""


#: Revision 0009's atomic claim, copied, for the downgrade.
RESERVE_0009 = r"""CREATE OR REPLACE FUNCTION idempotency_claim_reserve(
    p_tenant text, p_endpoint text, p_key text, p_fingerprint bytea, p_token text,
    p_ttl double precision, p_lease double precision
) RETURNS TABLE (
    claimed boolean, fingerprint bytea, state text, claim_token text,
    lease_expires_at timestamptz, response_status integer, response_headers jsonb,
    response_body bytea, created_at timestamptz, completed_at timestamptz,
    expires_at timestamptz, db_now timestamptz
) LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    v_now timestamptz;
    v_locked boolean;
BEGIN
    -- Bounds and a quiet log for this transaction when the session has none
    -- (behind a transaction pooler): local settings, gone with the transaction (0008).
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
    -- Every claim of one scope queues here, whichever partition holds its record.
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        RAISE EXCEPTION 'an idempotency claim needs READ COMMITTED, not %',
            current_setting('transaction_isolation');
    END IF;
    -- Held until the business transaction ends: a duplicate gets no row, never a wait.
    IF NOT pg_try_advisory_xact_lock(
        hashtext('flask_idem'),
        hashtext(p_tenant || E'\x1f' || p_endpoint || E'\x1f' || p_key)) THEN
        RETURN;
    END IF;
    -- On Citus (0009) the node running this function may be any node that accepts queries:
    -- the same lock, held until the same end, is also taken on the worker holding the
    -- tenant's shard, by a query Citus routes there whole, in this distributed transaction
    -- (the lookup and the record's insert then go over that same connection). The query is a
    -- write that deletes nothing (no row is dated before -infinity), so that Citus holds the
    -- shard's metadata lock until the transaction ends: a shard move cannot switch the
    -- tenant to another worker, where this lock is not, while the claim is held.
    IF current_setting('citus.version', true) IS NOT NULL THEN
        WITH pinned AS (
            DELETE FROM idempotency_keys_default AS d
             WHERE d.tenant = p_tenant AND d.endpoint = p_endpoint AND d.key = p_key
               AND d.created_at < '-infinity'
            RETURNING 1)
        SELECT pg_try_advisory_xact_lock(
                   hashtext('flask_idem'),
                   hashtext(p_tenant || E'\x1f' || p_endpoint || E'\x1f' || p_key))
          INTO v_locked
          FROM (SELECT count(*) FROM pinned) AS s;
        IF NOT v_locked THEN
            RETURN;
        END IF;
    END IF;
    -- Read the clock after the lock: a waiter never dates its row before the winner's.
    v_now := clock_timestamp();
    -- A record is live until its TTL ends, and, while in progress, as long as its owner holds
    -- the lease: a request still running past the TTL must never let a retry run again.
    RETURN QUERY
        SELECT false, k.fingerprint, k.state::text, k.claim_token::text, k.lease_expires_at,
               k.response_status, k.response_headers, k.response_body, k.created_at,
               k.completed_at, k.expires_at, v_now
          FROM idempotency_keys AS k
         WHERE k.tenant = p_tenant AND k.endpoint = p_endpoint AND k.key = p_key
           AND (k.expires_at > v_now
                OR coalesce(k.completed_at, k.lease_expires_at, k.created_at)
                   + (k.expires_at - k.created_at) > v_now)
           -- No record of this scope was made a day or more after this clock (0006).
           AND k.created_at < v_now + interval '1 day'
         ORDER BY k.created_at DESC
         LIMIT 1;
    IF FOUND THEN
        RETURN;
    END IF;
    -- A setting local to this transaction (it ends with it, as the lock does): the
    -- completion inserts the record only while it still reads this claim's token, so never
    -- after the view ended the transaction itself (a rollback releases the lock, and a
    -- duplicate may then have run).
    PERFORM set_config('flask_idem.reserved', p_token, true);
    RETURN QUERY
        -- Reserved, not written: the store inserts it completed before the commit.
        SELECT true, p_fingerprint, 'in_progress'::text, p_token, v_now + make_interval(
                   secs => p_lease), NULL::integer, NULL::jsonb, NULL::bytea, v_now,
               NULL::timestamptz, v_now + make_interval(secs => p_ttl), v_now;
END
$$
"""


#: Revision 0006's atomic claim of releases before 0007, copied, for the downgrade.
ATOMIC_0006 = r"""
CREATE OR REPLACE FUNCTION idempotency_claim_atomic(
    p_tenant text, p_endpoint text, p_key text, p_fingerprint bytea, p_token text,
    p_ttl double precision, p_lease double precision
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
    -- Every claim of one scope queues here, whichever partition holds its record.
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        RAISE EXCEPTION 'an idempotency claim needs READ COMMITTED, not %',
            current_setting('transaction_isolation');
    END IF;
    -- Held until the business transaction ends: a duplicate gets no row, never a wait.
    IF NOT pg_try_advisory_xact_lock(
        hashtext('flask_idem'),
        hashtext(p_tenant || E'\x1f' || p_endpoint || E'\x1f' || p_key)) THEN
        RETURN;
    END IF;
    -- Read the clock after the lock: a waiter never dates its row before the winner's.
    v_now := clock_timestamp();
    -- A record is live until its TTL ends, and, while in progress, as long as its owner holds
    -- the lease: a request still running past the TTL must never let a retry run again.
    RETURN QUERY
        SELECT false, k.fingerprint, k.state::text, k.claim_token::text, k.lease_expires_at,
               k.response_status, k.response_headers, k.response_body, k.created_at,
               k.completed_at, k.expires_at, v_now
          FROM idempotency_keys AS k
         WHERE k.tenant = p_tenant AND k.endpoint = p_endpoint AND k.key = p_key
           AND (k.expires_at > v_now
                OR coalesce(k.completed_at, k.lease_expires_at, k.created_at)
                   + (k.expires_at - k.created_at) > v_now)
           -- No record of this scope was made a day or more after this clock (0006).
           AND k.created_at < v_now + interval '1 day'
         ORDER BY k.created_at DESC
         LIMIT 1;
    IF FOUND THEN
        RETURN;
    END IF;
    RETURN QUERY
        WITH inserted AS (
            INSERT INTO idempotency_keys (
                tenant, endpoint, key, fingerprint, state, claim_token,
                lease_expires_at, created_at, expires_at)
            VALUES (
                p_tenant, p_endpoint, p_key, p_fingerprint, 'in_progress', p_token,
                v_now + make_interval(secs => p_lease), v_now,
                v_now + make_interval(secs => p_ttl))
            RETURNING *)
        SELECT true, i.fingerprint, i.state::text, i.claim_token::text, i.lease_expires_at,
               i.response_status, i.response_headers, i.response_body, i.created_at,
               i.completed_at, i.expires_at, v_now
          FROM inserted AS i;
END
$$;
"""


#: Live rows, as the claim counts them (revision 0002).
LIVE_DIGESTED = """
SELECT count(*) FROM idempotency_keys
 WHERE substr(key, 1, 1) = '$'
   AND (expires_at > {now} OR {after_end})
"""


def _unkeyed(tenant: str, key: str) -> str:
    framed = b"".join(b"%d:%s" % (len(p.encode()), p.encode()) for p in (tenant, key))
    return "$sha256$" + hashlib.sha256(CONTEXT + framed).hexdigest()


#: Live records that may run again with a raw key: their downstream keys were derived from it,
#: and a re-run after the upgrade would derive others from the digest (a second charge at a
#: provider that deduplicates by them).
UNSETTLED = """
SELECT count(*) FROM idempotency_keys
 WHERE substr(key, 1, 1) <> '$'
   AND state IN ('in_progress', 'unknown', 'reopened')
   AND expires_at > {now}
"""


def upgrade() -> None:
    bind = op.get_bind()
    now = "now()" if bind.dialect.name == "postgresql" else "strftime('%Y-%m-%d %H:%M:%f', 'now')"
    unsettled = bind.execute(sa.text(UNSETTLED.format(now=now))).scalar_one()
    if unsettled:
        raise RuntimeError(
            f"{unsettled} live records are in progress, unknown or reopened: a re-run after this "
            "upgrade would derive other downstream keys than their first run did. Stop the old "
            "workers, settle them (flask idem stuck; flask idem reconcile or flask idem "
            "release), then upgrade"
        )
    if bind.dialect.name == "postgresql":
        # The guards first: a worker of an older release claiming during the update waits
        # for its lock, then refuses, instead of inserting a raw key beside a digested one.
        for function in (CLAIM, RESERVE, ATOMIC):
            op.execute(function)
        op.execute(DIGEST_KEYS)
        return
    # SQLite has no SHA-256 in SQL: digest row by row, in the migration's transaction.
    rows = bind.execute(
        sa.text("SELECT rowid, tenant, key FROM idempotency_keys WHERE substr(key, 1, 1) <> '$'")
    ).all()
    for rowid, tenant, key in rows:
        bind.execute(
            sa.text("UPDATE idempotency_keys SET key = :key WHERE rowid = :rowid"),
            {"key": _unkeyed(tenant, key), "rowid": rowid},
        )


def downgrade() -> None:
    bind = op.get_bind()
    if bind.dialect.name == "postgresql":
        live = LIVE_DIGESTED.format(
            now="now()",
            after_end="coalesce(completed_at, lease_expires_at, created_at)"
            " + (expires_at - created_at) > now()",
        )
    else:
        live = LIVE_DIGESTED.format(
            now="strftime('%Y-%m-%d %H:%M:%f', 'now')",
            after_end="julianday(coalesce(completed_at, lease_expires_at, created_at))"
            " + julianday(expires_at) - julianday(created_at) > julianday('now')",
        )
    count = bind.execute(sa.text(live)).scalar_one()
    if count:
        raise RuntimeError(
            f"{count} live records have digested keys, which revision 0010's code cannot "
            "find (it would run their retries again); downgrade once they have expired"
        )
    if bind.dialect.name == "postgresql":
        for function in (CLAIM_0010, RESERVE_0009, ATOMIC_0006):
            op.execute(function)
