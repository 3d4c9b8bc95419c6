"""Two attempts that meet the same unknown record under ``recovery="reexecute"``: one takes it
over and runs it; the other is told it lost (``Found.OVERTAKEN``), holds nothing, and its view
sends no answer of its own for it (it claims again and finds what the winner left)."""

from __future__ import annotations

import hashlib
import time
import typing as t

import flask

from flask_idem import Idempotency
from flask_idem.attempt import OUTCOMES, Attempt, Found
from flask_idem.core import signals
from flask_idem.core.errors import JobInProgress
from flask_idem.core.options import ViewOptions
from flask_idem.state import AppState
from flask_idem.store import SQLStore

FP = hashlib.sha256(b"the same request").digest()


def test_the_loser_of_a_takeover_holds_nothing_and_answers_nothing_itself(store: SQLStore) -> None:
    app = flask.Flask("takeover-loser")
    Idempotency(app, store=store, tenant=lambda: "alpha")
    options = ViewOptions(recovery="reexecute")
    scope = store.keys.scope("alpha", "POST /pay", "k-loser")
    first = store.claim(scope, FP, ttl=600, lease=30)
    assert first.claimed and first.token is not None
    record = first.record
    assert store.mark_unknown(record.scope, first.token, created_at=record.created_at)
    unknown = store.get(scope)
    assert unknown is not None
    conflicts: list[t.Any] = []

    def listen(sender: t.Any, **extra: t.Any) -> None:
        conflicts.append(extra)

    with app.test_request_context("/pay", method="POST"), signals.conflict.connected_to(listen):
        state = AppState.current()
        winner, loser, view = (Attempt(state, scope, options) for _ in range(3))
        for attempt in (winner, loser, view):
            attempt.fingerprint = FP
        try:
            assert winner.meet(unknown) is Found.RERUN and winner.holding
            assert loser.meet(unknown) is Found.OVERTAKEN and not loser.holding
            # The view adapter claims again at once, without an event: no answer of its own.
            assert view.answer_found(unknown, until=time.monotonic()) is None
            assert not view.holding and conflicts == []
            # A job answers the row: in progress, as the winner's running record says.
            error = OUTCOMES[Found.OVERTAKEN].job(record.scope, retry_after=1.0)
            assert isinstance(error, JobInProgress) and "another worker" in str(error)
        finally:
            winner.give_up("the test is over")
