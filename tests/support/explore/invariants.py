"""What must hold in every state the explorer reaches, and how states are told apart.

Invariants (each a name the reports and the regression tests use):

``one charge``             never two distinct downstream keys charged for one client operation
                           (a record claimed after the one before it expired is a new operation:
                           a key is kept for its TTL, as documented)
``answer without work``    no stored answer for work that did not commit: a stored answer names
                           a charge the provider made, and an answer a client got from its own
                           completion has its payment row committed
``released after effect``  no record deleted (released, forgotten) after anything committed
                           under it or after contact was declared for it (the upkeep's purge of
                           an expired record aside)
``completed overwritten``  a completed record keeps its answer until the upkeep purges it
``live lease taken``       a record in progress under a lease that has not run out keeps its
                           owner: no other attempt takes it over (the concurrent duplicate's
                           409, never a second holder)
``retry answer``           every answer is the operation's first stored answer, a 409, or a
                           documented unknown (500: the view raised; 503: the store failed)
``no answer``              a run that is over left no client without an answer (crashed ones
                           aside)
``other request``          a client that sent another request under the key gets 422 (or a
                           409/500/503), never the stored answer or the run of the first
                           request; a client of the first request never gets 422
"""

from __future__ import annotations

import typing as t

from flask_idem.core.record import State

from .engine import Broken
from .harness import parse, stamp

if t.TYPE_CHECKING:
    from .world import World

Row = tuple[t.Any, ...]
#: Statuses that tell a retry to come back, or that the outcome is not known yet.
DOCUMENTED = frozenset({409, 500, 503})


def _col(world: World, row: Row, name: str) -> t.Any:
    return world.harness.column(row, name)


def alive(world: World, row: Row) -> bool:
    """The store's own rule (``SQLStore._alive``): a TTL from the claim and one from the end."""
    now = world.situation.now
    created, expires = parse(_col(world, row, "created_at")), parse(_col(world, row, "expires_at"))
    if expires > now:
        return True
    ended = (
        _col(world, row, "completed_at")
        or _col(world, row, "lease_expires_at")
        or _col(world, row, "created_at")
    )
    return parse(ended) + (expires - created) > now


def lease_expired(world: World, row: Row) -> bool:
    lease = _col(world, row, "lease_expires_at")
    return (
        _col(world, row, "state") == State.IN_PROGRESS.value
        and lease is not None
        and lease <= stamp(world.situation.now)
    )


def is_stuck(world: World, row: Row) -> bool:
    """Nobody owns the outcome: what reconcilers and ``flask idem release`` act on."""
    state = _col(world, row, "state")
    settled_by_nobody = state in (State.UNKNOWN.value, State.REOPENED.value)
    return alive(world, row) and (settled_by_nobody or lease_expired(world, row))


def _answer_of(world: World, row: Row) -> tuple[int, str] | None:
    if _col(world, row, "state") != State.COMPLETED.value:
        return None
    return int(_col(world, row, "response_status")), world.canonical_body(
        bytes(_col(world, row, "response_body"))
    )


def after_step(world: World, before: tuple[tuple[Row, ...], t.Any], label: str) -> list[Broken]:
    """Remember what the step revealed, then check every invariant on the step and the state."""
    s = world.situation
    records, paid = world.rows
    for row in records:
        created = _col(world, row, "created_at")
        world.name_record(created)
        if created not in s.operations:
            s.operations[created] = _operation_of_new(world)
        token = _col(world, row, "claim_token")
        if token is not None and token not in s.tokens:
            s.tokens = (*s.tokens, token)
        answer = _answer_of(world, row)
        if answer is not None:
            s.first_answers.setdefault(s.operations[created], answer)
    s.last_rows.update((_col(world, row, "created_at"), row) for row in records)
    broken: list[Broken] = []
    # Counted by downstream key, not by record: two attempts of one record that derive
    # different keys (a key that depends on the attempt) charge twice just the same.
    charged: dict[int, set[str]] = {}
    for key in s.charges:
        charged.setdefault(s.operations.get(s.key_record[key], 0), set()).add(key)
    for keys in charged.values():
        if len(keys) > 1:
            names = ", ".join(sorted(world.name_record(s.key_record[key]) for key in keys))
            broken.append(Broken("one charge", f"the provider charged the keys of {names}"))
    broken += _answers_have_work(world, records, paid)
    purge = label.startswith("upkeep")
    after = {_col(world, row, "created_at"): row for row in records}
    committed = {row[2] for row in paid}
    for row in before[0]:
        created = _col(world, row, "created_at")
        name = world.name_record(created)
        now = after.get(created)
        if now is None and not purge and (created in s.contacts or created in committed):
            what = "its payment row committed" if created in committed else "contact declared"
            broken.append(Broken("released after effect", f"{name} deleted after {what}"))
        if (
            now is not None
            and _col(world, row, "state") == State.IN_PROGRESS.value
            and not lease_expired(world, row)
            and _col(world, now, "state") == State.IN_PROGRESS.value
            and _col(world, now, "claim_token") != _col(world, row, "claim_token")
        ):
            broken.append(Broken("live lease taken", f"{name} taken over while its lease ran"))
        answer = _answer_of(world, row)
        if answer is not None and not (now is None and purge):
            if now is None or _answer_of(world, now) != answer:
                broken.append(
                    Broken("completed overwritten", f"{name}'s answer {answer} did not stay")
                )
    for client in s.clients:
        if client.answer is None or client.answer[0] in DOCUMENTED:
            continue
        theirs = s.record_body.get(client.source or "")
        if client.answer[0] == 422 or theirs not in (None, client.body):
            if client.answer[0] != 422 or theirs in (None, client.body):
                broken.append(
                    Broken(
                        "other request",
                        f"{client.name} ({client.body} request) got {client.answer[0]} from "
                        f"{world.name_record(client.source) if client.source else 'nothing'} "
                        f"({theirs} request)",
                    )
                )
            continue
        first = s.first_answers.get(s.operations.get(client.source or "", -1))
        if client.answer != first:
            broken.append(
                Broken("retry answer", f"{client.name} got {client.answer}, the first was {first}")
            )
    return broken


def _operation_of_new(world: World) -> int:
    """The operation of a record seen for the first time: its predecessor's, unless that one
    expired (a release or a forgetting leaves a row that was still alive when last seen)."""
    s = world.situation
    if not s.operations:
        return 0
    previous = max(s.operations)
    row = s.last_rows.get(previous)
    expired = row is not None and not alive(world, row)
    return s.operations[previous] + (1 if expired else 0)


def _answers_have_work(world: World, records: tuple[Row, ...], paid: t.Any) -> list[Broken]:
    s = world.situation
    broken = []
    for row in records:
        answer = _answer_of(world, row)
        if answer is not None and "no such charge" in answer[1]:
            name = world.name_record(_col(world, row, "created_at"))
            broken.append(Broken("answer without work", f"{name} stores {answer[1]}"))
    rows = {(charge, created) for _, charge, created in paid}
    for client in s.clients:
        if client.ran and client.attempt is not None:
            mine = (client.charge, stamp(client.attempt.created_at))
            if mine not in rows:
                broken.append(
                    Broken("answer without work", f"{client.name}'s 201 has no payment row")
                )
    return broken


def at_rest(world: World) -> list[Broken]:
    return [
        Broken("no answer", f"{client.name} never got an answer")
        for client in world.situation.clients
        if client.answer is None and client.pc != "crashed"
    ]


def fingerprint(world: World) -> t.Hashable:
    """The state as the future sees it: records and tokens by their order of appearance, times
    as the comparisons the store makes with its clock (lease run out, alive), answers with
    their charges named by record."""
    s = world.situation

    def rid(created: t.Any) -> str:
        return world.name_record(created)

    def tid(token: str | None) -> int | None:
        return None if token is None else s.tokens.index(token)

    charge_record = {c: rid(s.key_record[k]) for k, c in s.charges.items()}
    rows = tuple(
        (
            rid(_col(world, row, "created_at")),
            _col(world, row, "state"),
            tid(_col(world, row, "claim_token")),
            lease_expired(world, row),
            alive(world, row),
            _answer_of(world, row),
        )
        for row in world.rows[0]
    )
    paid = tuple((charge_record.get(charge), rid(created)) for _, charge, created in world.rows[1])
    clients = []
    for c in s.clients:
        a = c.attempt
        held = None
        if a is not None:
            watching = a.watch is not None and a.watch.active
            held = (
                None if a.record is None else rid(a.created_at),
                tid(a.token),
                a.phase.value,
                a.contacted,
                a.committed,
                watching,
            )
        found = None if c.found is None else (rid(c.found.created_at), tid(c.found.claim_token))
        key = None if c.key is None else rid(s.key_record[c.key])
        source = None if c.source is None else rid(c.source)
        clients.append(
            (
                c.pc,
                held,
                found,
                key,
                charge_record.get(c.charge or ""),
                c.answer,
                c.ran,
                source,
                c.body,
            )
        )
    looked = tuple((rid(r.created_at), tid(r.claim_token), r.state.value) for r in s.looked)
    operations = tuple(s.operations[created] for created in sorted(s.operations))
    bodies = tuple(sorted((rid(created), body) for created, body in s.record_body.items()))
    return (
        rows,
        paid,
        # The clients run one program: states that differ only in which is which are one.
        tuple(sorted(clients, key=repr)),
        operations,
        bodies,
        (s.reconciler, looked),
        frozenset(charge_record.values()),
        frozenset(rid(c) for c in s.contacts),
        tuple(sorted(s.used.items())),
        tuple(sorted(s.first_answers.items())),
    )
