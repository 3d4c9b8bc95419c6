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

No function changes. The store of this release digests every key it sends, so the claim
functions see digests only; a worker of an older release still sends raw keys, which no
longer meet the digested rows. Deploy with the old workers stopped (docs/encryption.md, "Upgrading
to digested keys").

Downgrade: digests cannot be turned back into keys. The downgrade refuses while live digested
rows exist (an older release would not find them, and would run their retries again); with
none it changes nothing.

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
DIGEST_KEYS = f"""
UPDATE idempotency_keys
   SET key = '$sha256$' || encode(sha256(
           decode('{CONTEXT.hex()}', 'hex')
           || convert_to(octet_length(tenant)::text || ':' || tenant
                         || octet_length(key)::text || ':' || key, 'UTF8')), 'hex')
 WHERE substr(key, 1, 1) <> '$'
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


def upgrade() -> None:
    bind = op.get_bind()
    if bind.dialect.name == "postgresql":
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
