"""Every transaction that writes a record commits flushed on Citus, so a shard move keeps it.

A shard move by logical replication (``citus_move_shard_placement(..., shard_transfer_mode =>
'force_logical')``, or ``'auto'``, the default, for tables with a replica identity as ours)
copies the shards while writes go on. At its end it blocks writes to the moving shard group
(``BlockWritesToShardList``: the shard's metadata lock, taken exclusively on the coordinator
and, by ``lock_shard_metadata``, on every worker; a write holds it shared until its
transaction ends), reads the source worker's ``pg_current_wal_lsn()``, waits until its
subscriptions have applied that much (a look that finds them behind sleeps a second),
switches the placements in the metadata and leaves the old ones to a deferred drop
(``pg_dist_cleanup``): ``CompleteNonBlockingShardTransfer`` and
``WaitForAllSubscriptionsToCatchUp`` in Citus 13.2's ``multi_logical_replication.c``,
``TransferShards`` in ``shard_transfer.c``. ``pg_current_wal_lsn()`` is where the WAL has
been *written*. A transaction committed with ``synchronous_commit = off`` returns, and
releases its locks, with its commit record still in the WAL buffers until the WAL writer
writes it (``wal_writer_delay``, 200 ms by default). A write the block waited for had
committed a moment before the move read that position, so it was not in it; when the
subscriptions had caught up at the first look, the move switched without it, and the write
stayed on the old placement, dropped later. A durable claim that had answered "claimed" lost
its record, and a later claim of the key on the new placement found none and was claimed too
(``test_durable_claims_through_every_node_during_shard_moves_claim_each_key_once`` failed
once in CI with 11 keys claimed twice, one record each); a completion was undone (the record
in progress again, its stored response lost, and after the lease the request ran again).
``test_a_write_committed_as_a_move_blocks_writes_survives_the_move`` holds each kind of write
open until a move blocks writes, then commits it: without this revision each was lost in
most moves. A move that copies with writes blocked (``'block_writes'``) copies what is
committed, written or not, and loses nothing. A write that comes during the block waits for
it and reads the placements once it has the metadata lock (``CitusBeginModifyScan``:
``AcquireMetadataLocks``, then ``FirstReplicaAssignTaskList``): it goes to the new worker.

From this revision, where Citus is loaded, a transaction that inserts or updates a record
commits flushed (``synchronous_commit`` raised from ``off`` to ``local`` for that
transaction) on the node that writes the row: the check constraint
``ck_idempotency_keys_commit_flushed`` calls ``idempotency_commit_flushed()``, which
PostgreSQL runs for each row written, where it is written, in the writing transaction, from
whichever node the statement came: locally for a claim delegated to the tenant's worker, on
the worker for a statement routed there, in the business transaction of an atomic view (whose
own rows on that worker commit flushed with it). Its commit record is then written before
its locks are released, so before the move reads the position. The claim functions and the
store's statements are unchanged: a claim's insert is such a write, and a release of
flask_idem that does not know of this revision is protected by it too. Deletes (a release,
an eviction, the purge of expired rows) check no constraint: a lost release leaves the
record in progress until its lease ends, then as a record whose owner vanished (a retry
takes it over, or a ``recovery="fail"`` view answers 409 ``outcome-pending`` until it is
settled); a lost eviction leaves a record to evict again; a lost purge, expired rows for the
next one.

The function returns true and changes nothing else. It is volatile, as it is: a constraint
is checked on every row written, and a volatile call is never folded away. Where Citus is not
loaded, or the setting is not ``off`` (``local``, ``on`` and those that wait for standbys all
flush), it only reads two settings (about 0.7 microseconds a call, measured). Adding the
constraint checks every existing record under the table's lock, so claims wait for it: about
half a second per million records on the suite's machine. (``NOT VALID`` would skip that,
but SQLAlchemy 2.1 then warns at every reflection of the table, an application's
autogenerate included.) Partitions made later copy it (``LIKE ... INCLUDING CONSTRAINTS``),
and Citus creates it on every shard, of the partitions there are and of new ones.

Downgrade: the constraint is dropped from every table that has it (a partition detached into
the archive schema keeps its own), then the function. SQLite has neither.

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-04
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None

TABLE = "idempotency_keys"
#: The constraint's name, as the naming convention of ``flask_idem.store.table`` spells it.
CHECK = "ck_idempotency_keys_commit_flushed"

#: Called by the constraint for each row written, where it is written.
FLUSHED = """CREATE OR REPLACE FUNCTION idempotency_commit_flushed() RETURNS boolean
LANGUAGE plpgsql AS $$
BEGIN
    -- A shard move by logical replication reads the source's WAL write position once it has
    -- blocked writes, and switches the placements when its subscriptions have applied that
    -- much: a commit not yet written (synchronous_commit = off) is left behind on the old
    -- placement. Local to this transaction: its commit writes and flushes its WAL on
    -- this node before its locks, which the move waits for, are released.
    IF current_setting('synchronous_commit') = 'off'
       AND current_setting('citus.version', true) IS NOT NULL THEN
        PERFORM set_config('synchronous_commit', 'local', true);
    END IF;
    RETURN true;
END
$$
"""


def upgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    op.execute(FLUSHED)
    op.execute(f"ALTER TABLE {TABLE} ADD CONSTRAINT {CHECK} CHECK (idempotency_commit_flushed())")


def downgrade() -> None:
    bind = op.get_bind()
    if bind.dialect.name != "postgresql":
        return
    # The parent's drop takes its partitions' copies with it; a partition detached into the
    # archive schema holds its own.
    op.execute(f"ALTER TABLE {TABLE} DROP CONSTRAINT IF EXISTS {CHECK}")
    holders = bind.scalars(
        sa.text("SELECT conrelid::regclass::text FROM pg_constraint WHERE conname = :name"),
        {"name": CHECK},
    )
    for holder in list(holders):
        op.execute(f"ALTER TABLE {holder} DROP CONSTRAINT IF EXISTS {CHECK}")
    op.execute("DROP FUNCTION idempotency_commit_flushed()")
