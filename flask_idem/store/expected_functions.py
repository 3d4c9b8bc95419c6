"""The PostgreSQL functions this release expects the head migration to have installed.

One place for what the code expects of the database's functions: per function, its signature
(as PostgreSQL spells a ``regprocedure``) and the SHA-256 of its normalized definition. The
texts themselves live only in the migrations, which are frozen history and carry them whole. A
copy of the head texts here would be a second source that could drift from what the migrations
install; reading them back from the head revision files would make the expectation follow
whatever a new revision installs, so a function changed under the store's calls would pass
unnoticed. A digest is one fact per function that no migration can move: a revision that
changes a function fails ``tests/store/test_installed_functions.py`` until its entry here is updated
(the failure prints the new digest), which is when to check that the store's calls still fit.
``flask idem check`` compares a live database with the same entries.

The normalized definition is what decides how a function behaves, spelled so that it does not
depend on the server's version or on the schema the function was installed in: its arguments
(names and defaults), result, language, volatility, strictness, security, ``SET`` options and
body (``prosrc``, exactly as the migration wrote it). In the partition functions' bodies the
granularity revision 0001 fixed (day, week or month) is put back as ``{unit}``, as the
migrations spell it, so one digest holds for every granularity.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re

import sqlalchemy as sa


@dataclasses.dataclass(frozen=True)
class ExpectedFunction:
    """A function the head migration installs, as this release expects it."""

    #: As ``regprocedure`` prints it: the name and the argument types.
    signature: str
    #: The SHA-256 (hex) of its normalized definition.
    digest: str
    #: Whether its body holds the partition granularity (``{unit}`` in the migrations).
    granular: bool = False


_ARGUMENTS = "text,text,text,bytea,text,double precision,double precision"

#: Every function ``alembic upgrade head`` installs, and nothing else.
EXPECTED_FUNCTIONS: tuple[ExpectedFunction, ...] = (
    # The durable claim (revision 0010, refusing raw keys from 0011).
    ExpectedFunction(
        f"idempotency_claim({_ARGUMENTS})",
        "22432f7307838571b7c4f26d50b2f2ec8b2829c5bf78e32ab46c80cd0988f299",
    ),
    # The atomic claim (revision 0009, refusing raw keys from 0011).
    ExpectedFunction(
        f"idempotency_claim_reserve({_ARGUMENTS})",
        "0dcf0620cfe9031afdc7071493dedbf20fd062698e5b6fc6b728263ccd9f6493",
    ),
    # Not called by this release: kept so that a worker of a release before 0007 still claims
    # atomically during a rolling deploy (revision 0006, refusing raw keys from 0011).
    ExpectedFunction(
        f"idempotency_claim_atomic({_ARGUMENTS})",
        "8cd32c562fb7fc620c0763d9e99d582be5b043d55df377ca339e8851b43ff3b1",
    ),
    # The request path's writes and the completed-record lookup on kept plans (revision 0014).
    ExpectedFunction(
        "idempotency_complete(text,text,text,text,timestamp with time zone,text,integer,jsonb,"
        "bytea)",
        "d331aa1306f1aedc67c7aec443f389ce40700bd3de665b385a8716b7ed75c426",
    ),
    ExpectedFunction(
        "idempotency_complete_reserved(text,text,text,bytea,text,timestamp with time zone,"
        "timestamp with time zone,text,integer,jsonb,bytea)",
        "d75fb8ce8ccd1e41fd5c06b41c9f244b8425e809932f3c7d3fa0ea45f9b404cb",
    ),
    ExpectedFunction(
        "idempotency_find_completed(text,text,text)",
        "4d38dd9cbd8b237c6c6441fceae99f299842fc4b40ff0a536808a986f74915f5",
    ),
    # Checked for every record written (the constraint ck_idempotency_keys_commit_flushed,
    # revision 0013): on Citus its transaction commits flushed, so a shard move keeps it.
    ExpectedFunction(
        "idempotency_commit_flushed()",
        "36e4448dd3ed0f7622734c25a50a87b795e636a40f6e26c7eb8f2f52148d6364",
    ),
    # Partition upkeep of the keys (revisions 0003 and 0002) and of the audit trail (0005).
    ExpectedFunction(
        "idempotency_create_partitions(integer,boolean,integer)",
        "e5137fc5f05c00aa2b2b1f42f932b2845e3ef4a72336275ca39ce2fc2df840b1",
        granular=True,
    ),
    ExpectedFunction(
        "idempotency_drop_expired_partitions(boolean)",
        "a1add0376e53cf084f9d38946a71800e9556fad525ef265fcddae7bbac0c5210",
        granular=True,
    ),
    ExpectedFunction(
        "idempotency_audit_partitions(integer,double precision,boolean)",
        "0d75ca0695d6b570ab1be3c45b3c0548c5f42f71ebb5d01ae8d81e6f861a2048",
    ),
)

# Catalog values, each rendered by PostgreSQL on its own (pg_get_functiondef's layout and its
# schema-qualified name are left out). NULL when the function is not installed.
_DEFINITION = sa.text(
    "SELECT concat_ws(E'\\n', "
    "'ARGUMENTS ' || pg_get_function_arguments(p.oid), "
    "'RETURNS ' || pg_get_function_result(p.oid), "
    "'LANGUAGE ' || l.lanname, "
    "'VOLATILITY ' || p.provolatile::text, "
    "'STRICT ' || p.proisstrict::text, "
    "'SECURITY DEFINER ' || p.prosecdef::text, "
    "'SET ' || coalesce(array_to_string(p.proconfig, ', '), ''), "
    "'AS', p.prosrc) "
    "FROM pg_proc AS p JOIN pg_language AS l ON l.oid = p.prolang "
    "WHERE p.oid = to_regprocedure(:signature)"
)
#: The granularity, where revision 0001 wrote ``{unit}``: in the partition step, and in the
#: truncation to its first partition.
_UNIT = re.compile(r"interval '1 (day|week|month)'")


def installed_digests(connection: sa.Connection) -> dict[ExpectedFunction, str | None]:
    """The digest of each expected function as the database has it (None: not installed)."""
    digests: dict[ExpectedFunction, str | None] = {}
    for function in EXPECTED_FUNCTIONS:
        definition = connection.execute(_DEFINITION, {"signature": function.signature})
        text = definition.scalar()
        if text is not None and function.granular:
            text = _unit_placeholder(text)
        digests[function] = None if text is None else hashlib.sha256(text.encode()).hexdigest()
    return digests


def drift(connection: sa.Connection) -> dict[ExpectedFunction, str]:
    """The expected functions the database lacks (``missing``) or has otherwise (``changed``)."""
    found = installed_digests(connection)
    return {
        function: "missing" if digest is None else "changed"
        for function, digest in found.items()
        if digest != function.digest
    }


def _unit_placeholder(definition: str) -> str:
    """The definition with its granularity spelled ``{unit}`` again (left as it is when it has
    none, or spells another one elsewhere: either way its digest then differs)."""
    found = _UNIT.search(definition)
    if found is None:
        return definition
    unit = found.group(1)
    return definition.replace(f"interval '1 {unit}'", "interval '1 {unit}'").replace(
        f"date_trunc('{unit}'", "date_trunc('{unit}'"
    )
