"""The explored world: one client operation (a payment), the actors that can act on its key,
the faults, and what the explorer remembers of the run to check the invariants.

Actors (each action is one atomic step; every order of them is explored):

client A, B, ...  the owner and the retrying clients, all sending the same request: claim
                  (``Attempt.claim``, then ``classify`` and the outcome table), take a found
                  record over (``Attempt.take_over``), declare contact and get the downstream
                  key (``idem.downstream_key``), call the provider, commit the payment row with
                  the stored answer (``Attempt.end_run``, ``record_result``), or fail
                  (``end_run``); a view that commits its own rows before failing
                  (``commits_own``)
keeper of X       renews X's lease (``LeaseKeeper.renew``) while X holds the key
reconciler        reads the stuck records (``store.stuck()``), then settles them with
                  ``flask_idem.ops.reconcile.reconcile``: its verdict is the truth at that
                  moment (happened: the provider has the charge; else not happened)
operator          ``flask idem release`` (``--not-happened`` when the provider has no charge)
upkeep            ``store.maintain``: the purge of expired records (partitions on PostgreSQL)
clock             the leases run out (+lease), the TTL passes (+TTL)

Faults: a client crashes while it holds the key (its keeper dies with it); the store fails
one call (``[store fails]``); the clock jumps. A freeze needs no action of its own: a frozen
actor is one the schedule leaves out while the others and the clock go on, and every such
schedule is explored (its resume is its next step).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import datetime as dt
import json
import typing as t

from flask_idem.attempt import OUTCOMES, Attempt, Ending, Failure, Found, classify
from flask_idem.core.errors import StoreUnavailable
from flask_idem.core.idempotency_keys import derive_key
from flask_idem.core.options import ViewOptions
from flask_idem.core.record import Record, StoredResponse
from flask_idem.ops.reconcile import Verdict, reconcile

from . import invariants
from .engine import Broken
from .harness import (
    ENDPOINT,
    FINGERPRINT,
    KEY,
    LEASE,
    OTHER_FINGERPRINT,
    TENANT,
    TTL,
    Harness,
    Rows,
    payments,
    stamp,
)

#: A client's program counter: where it is in its request.
NEW, TAKE_OVER, HOLDING, KEYED, CHARGED, DONE, CRASHED = (
    "new",
    "take_over",
    "holding",
    "keyed",
    "charged",
    "done",
    "crashed",
)
_HOLDS = (HOLDING, KEYED, CHARGED)
STORE_FAILS = " [store fails]"


@dataclasses.dataclass(frozen=True)
class Profile:
    """One bounded scenario: the view's options, the actors and the fault budget."""

    name: str
    options: ViewOptions = ViewOptions()
    clients: int = 2
    lease_jumps: int = 1
    ttl_jumps: int = 0
    crashes: int = 1
    store_faults: int = 1
    #: The view may raise at any step while it holds the key.
    failures: bool = True
    #: The view may commit its own rows, then raise (commit as you go).
    commits_own: bool = False
    reconciler: bool = True
    operator: bool = False
    upkeep: bool = False
    #: The last client sends another request under the same key (another body).
    other_body: bool = False
    max_depth: int = 12


@dataclasses.dataclass
class Client:
    """One client's request: its program counter, its attempt, what it got."""

    name: str
    pc: str = NEW
    attempt: Attempt | None = None
    #: The record it found and may take over.
    found: Record | None = None
    key: str | None = None
    charge: str | None = None
    #: (status, canonical body) once answered.
    answer: tuple[int, str] | None = None
    #: Its answer is its own completion's.
    ran: bool = False
    #: The record (created_at) its answer came from (a replay, its completion, a 422).
    source: str | None = None
    #: Which request it sends: ``first``, or ``other`` (another body under the same key).
    body: str = "first"

    @property
    def fingerprint(self) -> bytes:
        return OTHER_FINGERPRINT if self.body == "other" else FINGERPRINT

    def clone(self) -> Client:
        twin = copy.copy(self)
        if self.attempt is not None:
            twin.attempt = copy.copy(self.attempt)
            if self.attempt.watch is not None:
                twin.attempt.watch = copy.copy(self.attempt.watch)
            if self.attempt.tally is not None:
                twin.attempt.tally = copy.copy(self.attempt.tally)
        return twin

    @property
    def holds(self) -> bool:
        return self.pc in _HOLDS


@dataclasses.dataclass
class Situation:
    """Everything of a state outside the database."""

    now: dt.datetime
    clients: list[Client]
    reconciler: str = "idle"
    looked: tuple[Record, ...] = ()
    used: dict[str, int] = dataclasses.field(default_factory=dict)
    #: The provider's ledger: downstream key -> charge id (it deduplicates by key).
    charges: dict[str, str] = dataclasses.field(default_factory=dict)
    #: Each downstream key's record (its created_at).
    key_record: dict[str, str] = dataclasses.field(default_factory=dict)
    #: Records (created_at) some attempt declared contact for.
    contacts: frozenset[str] = frozenset()
    #: Every record and claim token ever seen, in order: their names in traces and fingerprints.
    records: tuple[str, ...] = ()
    tokens: tuple[str, ...] = ()
    #: Each record's operation: a record claimed once the one before it expired (its TTL
    #: passed) is a new operation of the same key, with new downstream keys by design.
    operations: dict[str, int] = dataclasses.field(default_factory=dict)
    #: Each record's row as last seen (to tell a release from an expiry).
    last_rows: dict[str, tuple[t.Any, ...]] = dataclasses.field(default_factory=dict)
    #: The first answer the store held for each operation (status, canonical body).
    first_answers: dict[int, tuple[int, str]] = dataclasses.field(default_factory=dict)
    #: Each record's request (created_at -> the claiming client's body), as the world knows it,
    #: never read back from the store's fingerprint.
    record_body: dict[str, str] = dataclasses.field(default_factory=dict)

    def clone(self) -> Situation:
        twin = copy.copy(self)
        twin.clients = [client.clone() for client in self.clients]
        twin.used = dict(self.used)
        twin.charges = dict(self.charges)
        twin.key_record = dict(self.key_record)
        twin.operations = dict(self.operations)
        twin.last_rows = dict(self.last_rows)
        twin.first_answers = dict(self.first_answers)
        twin.record_body = dict(self.record_body)
        return twin


class World:
    """The explorer's model (:class:`.engine.Model`) of one :class:`Profile`."""

    def __init__(self, harness: Harness, profile: Profile) -> None:
        self.harness = harness
        self.profile = profile
        self.scope = harness.store.keys.scope(TENANT, ENDPOINT, KEY)
        names = "ABCDEFGH"[: profile.clients]
        clients = [Client(name) for name in names]
        if profile.other_body:
            clients[-1].body = "other"
        self.situation = Situation(harness.now, clients)
        harness.write(((), ()))
        self.rows: Rows = ((), ())
        harness.idem.reconciler(ENDPOINT)(self._verdict)

    # -- the engine's interface ---------------------------------------------------------

    def save(self) -> tuple[Situation, Rows]:
        return self.situation.clone(), self.rows

    def load(self, saved: tuple[Situation, Rows]) -> None:
        situation, rows = saved
        self.situation = situation.clone()
        if rows != self.rows:
            self.harness.write(rows)
            self.rows = rows
        self.harness.now = self.situation.now

    def fingerprint(self) -> t.Hashable:
        return invariants.fingerprint(self)

    def at_rest(self) -> list[Broken]:
        return invariants.at_rest(self)

    def enabled(self) -> list[str]:
        s, p = self.situation, self.profile
        actions: list[str] = []
        faults_left = s.used.get("store_faults", 0) < p.store_faults

        def add(label: str, touches_store: bool = True) -> None:
            actions.append(label)
            if touches_store and faults_left:
                actions.append(label + STORE_FAILS)

        for client in s.clients:
            n = client.name
            if client.pc == NEW:
                add(f"{n} claims")
            elif client.pc == TAKE_OVER:
                add(f"{n} takes the record over")
            elif client.holds:
                if client.pc == HOLDING:
                    actions.append(f"{n} gets the downstream key")
                elif client.pc == KEYED:
                    actions.append(f"{n} calls the provider")
                elif client.pc == CHARGED:
                    add(f"{n} commits and completes")
                if p.failures:
                    add(f"{n}'s view raises")
                if p.commits_own:
                    add(f"{n}'s view commits its own row, then raises")
                if s.used.get("crashes", 0) < p.crashes:
                    actions.append(f"{n} crashes")
                watch = client.attempt.watch if client.attempt is not None else None
                if watch is not None and watch.active and self._lease_expired(client):
                    # Before expiry a renewal changes nothing the future depends on.
                    add(f"keeper of {n} renews")
        stuck = self._stuck_rows()
        if p.reconciler and s.reconciler == "idle" and stuck:
            add("reconciler reads the stuck records")
        if s.reconciler == "looked":
            add("reconciler settles")
        if p.operator and not s.used.get("operator") and stuck:
            add("operator runs flask idem release")
        if p.upkeep and not s.used.get("upkeep") and s.used.get("ttl_jumps"):
            add("upkeep purges")
        if s.used.get("lease_jumps", 0) < p.lease_jumps and self._holders():
            actions.append(f"clock +{LEASE + 1:g} s (leases run out)")
        if s.used.get("ttl_jumps", 0) < p.ttl_jumps and self.rows[0]:
            actions.append(f"clock +{TTL + 1:g} s (the TTL passes)")
        return actions

    def apply(self, action: str) -> tuple[str, list[Broken]]:
        s = self.situation
        before = self.rows
        # Every step takes time: two records never share a created_at (nor downstream keys).
        s.now += dt.timedelta(milliseconds=1)
        label = action
        if action.endswith(STORE_FAILS):
            label = action[: -len(STORE_FAILS)]
            s.used["store_faults"] = s.used.get("store_faults", 0) + 1
            self.harness.fail_next = True
        self.harness.now = s.now
        try:
            happened = self._do(label)
        finally:
            self.harness.fail_next = False
        self.rows = self.harness.read()
        return happened, invariants.after_step(self, before, label)

    # -- the actors ---------------------------------------------------------------------

    def _do(self, label: str) -> str:
        s = self.situation
        if label.startswith("clock"):
            jump = "ttl_jumps" if "TTL" in label else "lease_jumps"
            s.used[jump] = s.used.get(jump, 0) + 1
            s.now += dt.timedelta(seconds=(TTL if jump == "ttl_jumps" else LEASE) + 1)
            return "time passes"
        if label.startswith("reconciler"):
            return self._reconcile(label)
        if label.startswith("operator"):
            s.used["operator"] = 1
            return self._release()
        if label.startswith("upkeep"):
            s.used["upkeep"] = 1
            try:
                report = self.harness.store.maintain(ahead=0)
            except StoreUnavailable:
                return "the store failed"
            return f"{report.purged} purged"
        if label.startswith("keeper of "):
            return self._renew(self._client(label[len("keeper of ")]))
        client = self._client(label[0])
        step = label[1:].lstrip()
        if step == "claims":
            return self._claim(client)
        if step == "takes the record over":
            return self._take_over(client)
        if step == "gets the downstream key":
            return self._downstream_key(client)
        if step == "calls the provider":
            return self._charge(client)
        if step == "commits and completes":
            return self._complete(client)
        if step == "crashes":
            return self._crash(client)
        return self._raise(client, commit=step.startswith("'s view commits"))

    def _client(self, name: str) -> Client:
        return next(c for c in self.situation.clients if c.name == name)

    @contextlib.contextmanager
    def _context(self, client: Client) -> t.Iterator[Attempt]:
        """The client's request context: an app context with its attempt on ``g``."""
        assert client.attempt is not None
        with self.harness.app.app_context():
            client.attempt.attach()
            yield client.attempt

    def _answer(self, client: Client, status: int, body: str, says: str) -> str:
        client.answer = (status, body)
        client.pc = DONE
        return f"answered {status} {says}".rstrip()

    def _claim(self, client: Client) -> str:
        options = self.profile.options
        client.attempt = Attempt(self.harness.state, self.scope, options, endpoint=ENDPOINT)
        with self._context(client) as attempt:
            try:
                record = attempt.claim(client.fingerprint)
            except StoreUnavailable:
                return self._answer(client, 503, "", "(store unavailable)")
        if record is None:
            client.pc = HOLDING
            self.situation.record_body[stamp(attempt.created_at)] = client.body
            return f"claimed {self.name_record(attempt.created_at)}"
        found = classify(record, client.fingerprint, options.recovery, self.harness.store.keys)
        seen = f"found {self.name_record(record.created_at)} {record.state.value}"
        client.source = stamp(record.created_at)
        if found is Found.COMPLETED:
            assert record.response is not None
            body = self.canonical_body(record.response.body)
            return self._answer(client, record.response.status, body, f"({seen}: replayed)")
        if found is Found.RERUN:
            client.pc, client.found = TAKE_OVER, record
            return f"{seen}: may run it again"
        problem = OUTCOMES[found].http()
        return self._answer(client, problem.code or 500, "", f"({seen}: {found.value})")

    def _take_over(self, client: Client) -> str:
        assert client.found is not None
        with self._context(client) as attempt:
            try:
                taken = attempt.take_over(client.found)
            except StoreUnavailable:
                return self._answer(client, 503, "", "(store unavailable)")
        if not taken:
            return self._answer(client, 409, "", "(another attempt took it over)")
        client.pc = HOLDING
        return f"took {self.name_record(attempt.created_at)} over"

    def _downstream_key(self, client: Client) -> str:
        with self._context(client) as attempt:
            client.key = self.harness.idem.downstream_key("charge")
            created = stamp(attempt.created_at)
        s = self.situation
        s.key_record[client.key] = created
        s.contacts = s.contacts | {created}
        client.pc = KEYED
        return f"key of {self.name_record(attempt.created_at)} (contact declared)"

    def _charge(self, client: Client) -> str:
        assert client.key is not None
        charges = self.situation.charges
        new = client.key not in charges
        client.charge = charges.setdefault(client.key, f"ch_{len(charges) + 1}")
        client.pc = CHARGED
        record = self.name_record(self.situation.key_record[client.key])
        return f"provider {'charges' if new else 'deduplicates'} the key of {record}"

    def _complete(self, client: Client) -> str:
        assert client.charge is not None
        body = json.dumps({"payment": client.charge}).encode()
        snapshot = StoredResponse(201, (("Content-Type", "application/json"),), body)
        with self._context(client) as attempt:
            try:
                connection = attempt.begin()
                connection.execute(
                    payments.insert().values(
                        charge=client.charge, record_created_at=stamp(attempt.created_at)
                    )
                )
                attempt.run_ended()
                # What the view adapter does with a 201: the attempt decides, then records.
                ending = attempt.end_run("view", status=201)
                assert ending is Ending.RECORD, ending
                recording = attempt.record_result(snapshot, ran="view", status=201)
            finally:
                attempt.close()
        if recording.failure is Failure.LEASE_LOST:
            code = OUTCOMES[Failure.LEASE_LOST].http().code or 409
            return self._answer(client, code, "", "(lease lost: its writes rolled back)")
        if recording.failure is not None:
            code = OUTCOMES[recording.failure].http().code or 503
            return self._answer(client, code, "", f"({recording.failure.value})")
        client.ran = True
        client.source = stamp(attempt.created_at)
        return self._answer(client, 201, self.canonical_body(body), "(completed)")

    def _raise(self, client: Client, *, commit: bool) -> str:
        with self._context(client) as attempt:
            if commit:
                connection = attempt.begin()
                connection.execute(
                    payments.insert().values(
                        charge=client.charge, record_created_at=stamp(attempt.created_at)
                    )
                )
                connection.commit()
            attempt.run_ended(RuntimeError("the view raised"))
            ending = attempt.end_run("view", status=500)
            assert ending is not Ending.RECORD, ending
            attempt.close()
        return self._answer(client, 500, "", "(the view raised; key given up)")

    def _crash(self, client: Client) -> str:
        self.situation.used["crashes"] = self.situation.used.get("crashes", 0) + 1
        assert client.attempt is not None
        if client.attempt.watch is not None:
            self.harness.state.keeper.unwatch(client.attempt.watch)
        client.pc = CRASHED
        return "the process dies (its keeper with it)"

    def _renew(self, client: Client) -> str:
        assert client.attempt is not None and client.attempt.watch is not None
        if self.harness.state.keeper.renew(client.attempt.watch):
            return "renewed"
        client.attempt.watch.active = False
        return "lost: stops renewing"

    def _reconcile(self, label: str) -> str:
        s = self.situation
        store = self.harness.store
        if label.endswith("reads the stuck records"):
            try:
                s.looked = tuple(r for r in store.stuck() if r.scope.tenant == TENANT)
            except StoreUnavailable:
                s.reconciler = "done"
                return "the store failed"
            s.reconciler = "looked"
            return "stuck: " + ", ".join(
                f"{self.name_record(r.created_at)} {r.state.value}" for r in s.looked
            )
        s.reconciler = "done"
        with self.harness.app.app_context():
            try:
                settled = list(reconcile(s.looked))
            except StoreUnavailable:
                return "the store failed"
        return ", ".join(
            f"{self.name_record(x.record.created_at)} {x.action.value}" for x in settled
        )

    def _verdict(self, record: Record) -> Verdict:
        """The truth at the moment of asking: did the provider charge this record's key?"""
        charge = self.situation.charges.get(derive_key(record, "charge"))
        if charge is None:
            return Verdict.not_happened("the provider has no charge")
        return Verdict.happened(({"payment": charge}, 201))

    def _release(self) -> str:
        # The operator checked the provider (from the explorer's ledger, not through the store,
        # whose next call may be the one that fails).
        s = self.situation
        stuck = {
            self.harness.column(row, "created_at")
            for row in self.rows[0]
            if invariants.is_stuck(self, row)
        }
        charged = any(s.key_record[key] in stuck for key in s.charges)
        args = ["idem", "release", "--tenant", TENANT, "--endpoint", ENDPOINT, "--yes"]
        if not charged:
            args.append("--not-happened")
        result = self.harness.app.test_cli_runner().invoke(args=args, input=KEY + "\n")
        flag = "" if charged else " --not-happened"
        if result.exit_code != 0:
            return f"release{flag} refused"
        return f"release{flag}: reopened"

    # -- reading the state --------------------------------------------------------------

    def _holders(self) -> list[Client]:
        return [c for c in self.situation.clients if c.holds]

    def _lease_expired(self, client: Client) -> bool:
        assert client.attempt is not None
        row = self.row_of(stamp(client.attempt.created_at))
        return row is not None and invariants.lease_expired(self, row)

    def _stuck_rows(self) -> bool:
        return any(invariants.is_stuck(self, row) for row in self.rows[0])

    def row_of(self, created_at: str) -> tuple[t.Any, ...] | None:
        for row in self.rows[0]:
            if self.harness.column(row, "created_at") == created_at:
                return row
        return None

    def name_record(self, created_at: t.Any) -> str:
        """``record #n``: records are named in the order the run first saw them."""
        text = created_at if isinstance(created_at, str) else stamp(created_at)
        s = self.situation
        if text not in s.records:
            s.records = (*s.records, text)
        return f"record #{s.records.index(text) + 1}"

    def canonical_body(self, body: bytes) -> str:
        """A stored answer, its charge named by its record (not by the provider's numbering)."""
        charge = json.loads(body).get("payment")
        key = next((k for k, c in self.situation.charges.items() if c == charge), None)
        if key is None:
            return f"payment {charge} (no such charge)"
        return f"payment of {self.name_record(self.situation.key_record[key])}"
