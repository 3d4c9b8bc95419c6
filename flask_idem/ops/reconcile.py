"""Reconciliation: settle the records whose request died or whose outcome is unknown.

A request killed between its side effect and its stored response (the first two crash windows:
the business write committed, or the provider charged, then the process died) leaves its record
``in_progress`` past the lease, or ``unknown``. Retries then get 409 ``outcome-pending``: the
extension never guesses. A reconciler, registered per endpoint with
:meth:`Idempotency.reconciler <flask_idem.Idempotency.reconciler>`, looks the business outcome
up by key (the payments table, or the provider with the downstream key) and answers with a
:class:`Verdict`:

``Verdict.happened(rv)``
    the operation took place; ``rv`` is what the view would have returned. The record completes
    with the snapshot a completion in the request would have stored (same header allow-list,
    same size limit), so retries replay it like any other.
``Verdict.not_happened()``
    nothing took place yet; the record is reopened and the next retry runs the operation again
    as the same operation, with the same downstream keys.
``Verdict.unknown(reason)``
    the reconciler cannot tell (the provider is down, ...): the record stays and is reported.

"Not happened" never deletes the record: a reconciler cannot tell a dead owner from a frozen
one (a paused VM, a stopped process) whose lease ran out before its provider call. A new
record would give the retry new downstream keys, and the frozen owner, when it resumes, would
charge under the old ones: two charges. Reopened, the retry and the late owner send the same
downstream key, and a deduplicating provider charges once (the late owner's answer is then
refused by its token).

The store settles a record only while it is still stuck and still carries the claim token the
verdict was computed against, so a request that finishes after all, a retry that took the
operation over, or a second reconciliation run, wins or loses atomically (reported as
``skipped``).
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import typing as t

from flask import Flask, current_app
from flask.typing import ResponseReturnValue

from ..core import signals
from ..core.errors import ConfigurationError
from ..core.idempotency_keys import key_hash
from ..core.record import STORABLE_STATUSES, Record, State, StoredResponse
from ..core.scopes import endpoint_of
from ..core.snapshot import response_snapshot
from ..events import emit
from ..jobs import JOB_ATTRIBUTE
from ..state import AppState
from ..store import operator_store, trail
from ..store.messages import redacted

log = logging.getLogger("flask_idem")


class Answer(str, enum.Enum):
    """What a reconciler found out about a stuck record's operation."""

    HAPPENED = "happened"
    NOT_HAPPENED = "not_happened"
    UNKNOWN = "unknown"


@dataclasses.dataclass(frozen=True)
class Verdict:
    """A reconciler's answer about one record; build it with the three class methods."""

    answer: Answer
    #: What the view would have returned (``happened`` only).
    response: ResponseReturnValue | None = None
    #: A short note for the operator's report (never a key or a body).
    reason: str = ""

    @classmethod
    def happened(cls, response: ResponseReturnValue, *, reason: str = "") -> Verdict:
        """The operation took place.

        :param response: anything a view may return, e.g. ``({"id": "pay_1"}, 201,
            {"Location": "/v1/payments/pay_1"})``; it is stored like the view's own response.
        """
        return cls(Answer.HAPPENED, response, reason)

    @classmethod
    def not_happened(cls, reason: str = "") -> Verdict:
        """The operation did not take place (yet): reopen the record so that a retry runs it
        again with the same downstream keys, the ones an owner that is only frozen still
        holds."""
        return cls(Answer.NOT_HAPPENED, None, reason)

    @classmethod
    def unknown(cls, reason: str) -> Verdict:
        """The outcome cannot be told yet: keep the record and report it."""
        return cls(Answer.UNKNOWN, None, reason)


#: A function that gets a stuck record and tells what became of its operation.
Reconciler = t.Callable[[Record], Verdict]
#: What a reconciler is registered for: a view function, a Flask endpoint name, the endpoint
#: as records spell it (``"POST /v1/payments"``, ``"JOB charge-order"``), or a job function.
ReconcilerTarget = str | t.Callable[..., t.Any]
V = t.TypeVar("V")


class Action(str, enum.Enum):
    """What reconciliation did with one record."""

    #: The reconciler said it happened: the record completed and retries replay it.
    COMPLETED = "completed"
    #: The reconciler said it did not happen: the record was reopened (same downstream keys).
    REOPENED = "reopened"
    #: The record stays stuck: no reconciler, the reconciler could not tell, or it failed.
    UNKNOWN = "unknown"
    #: Nothing to do: the record was no longer stuck when the verdict came (its request
    #: finished after all, a retry took it over), or was already reopened.
    SKIPPED = "skipped"


@dataclasses.dataclass(frozen=True)
class Settlement:
    """One record and what reconciliation did with it."""

    record: Record
    action: Action
    reason: str = ""


def reconcile(records: t.Iterable[Record]) -> t.Iterator[Settlement]:
    """Settle stuck records of ``current_app`` one by one with their endpoints' reconcilers.

    Usually ``reconcile(store.stuck())``; ``flask idem reconcile`` wraps it in a progress bar.

    :raises ConfigurationError: a reconciler is registered for a view the app does not have.
    """
    state = AppState.current()
    reconcilers = resolve_targets(current_app, state.extension.reconcilers, state.settings.methods)
    for record in records:
        # A per-principal or account-wide record is reconciled by its endpoint's reconciler.
        yield _settle(
            state, record, reconcilers.get(endpoint_of(record, reconcilers, state.store.keys))
        )


def resolve_targets(
    app: Flask,
    registered: t.Mapping[ReconcilerTarget, V],
    methods: t.Collection[str],
    what: str = "reconciler",
) -> dict[str, V]:
    """Map registered reconcilers (or downstream lookups: ``what``) to the endpoints records
    carry (``"POST /v1/payments"``, ``"JOB charge-order"``).

    A view function or Flask endpoint name covers each of ``methods`` (the protected ones) on
    each URL rule of that endpoint.
    """
    resolved: dict[str, V] = {}
    for target, function in registered.items():
        for endpoint in _record_endpoints(app, target, methods, what):
            if endpoint in resolved:
                raise ConfigurationError(f"two {what}s are registered for {endpoint!r}")
            resolved[endpoint] = function
    return resolved


def _record_endpoints(
    app: Flask, target: ReconcilerTarget, methods: t.Collection[str], what: str
) -> list[str]:
    job = getattr(target, JOB_ATTRIBUTE, None)
    if job is not None:
        return [job.endpoint]
    if isinstance(target, str) and (" /" in target or target.startswith("JOB ")):
        return [target]
    if isinstance(target, str):
        names = [target] if target in app.view_functions else []
    else:
        names = [name for name, view in app.view_functions.items() if _wraps(view, target)]
    endpoints = [
        f"{method} {rule.rule}"
        for name in names
        for rule in app.url_map.iter_rules(name)
        for method in sorted((rule.methods or set()) & set(methods))
    ]
    if not endpoints:
        raise ConfigurationError(
            f"{what} target {getattr(target, '__name__', target)!r} is no view of this app with "
            "a protected method; register it for the view function, its endpoint name, a job "
            'function, or the endpoint as records spell it ("POST /v1/payments")'
        )
    return endpoints


def _wraps(view: t.Any, target: t.Any) -> bool:
    """Whether ``view`` is ``target`` or wraps it (the extension's outer guard does)."""
    while view is not None:
        if view is target:
            return True
        view = getattr(view, "__wrapped__", None)
    return False


class _Unsettled(Exception):
    """The record stays stuck; the message says why (for the operator's report)."""


def _settle(state: AppState, record: Record, reconciler: Reconciler | None) -> Settlement:
    digest = key_hash(record.scope)
    try:
        if record.damaged is not None:
            raise _Unsettled(f"damaged: {record.damaged}; repair or delete the row")
        if reconciler is None:
            raise _Unsettled("no reconciler for this endpoint")
        verdict = reconciler(record)
        response = _response_of(state, verdict)
    except _Unsettled as exc:
        return Settlement(record, Action.UNKNOWN, str(exc))
    except Exception as exc:
        # One failing lookup must not stop the run: the record stays and is reported.
        log.error("reconciler failed", exc_info=redacted(exc), extra={"key_hash": digest})
        return Settlement(record, Action.UNKNOWN, f"reconciler failed: {type(exc).__name__}")
    if response is None and record.state is State.REOPENED:
        return Settlement(record, Action.SKIPPED, "already reopened: the next retry runs it")
    # Both writes are fenced by the token this verdict was computed against.
    store = operator_store(state.store, "reconciling")
    with trail.acting("reconciler", verdict.reason):
        if response is None:
            settled = store.reopen(record.scope, token=record.claim_token)
        else:
            settled = store.resolve(
                record.scope, response, token=record.claim_token, created_at=record.created_at
            )
    if not settled:
        return Settlement(record, Action.SKIPPED, "no longer stuck: settled meanwhile")
    action = Action.REOPENED if response is None else Action.COMPLETED
    emit(
        signals.settled,
        record.scope,
        fingerprint=record.fingerprint,
        actor="reconciler",
        action=action.value,
        state=State.REOPENED.value if response is None else State.COMPLETED.value,
        status=None if response is None else response.status,
        reason=verdict.reason,
    )
    return Settlement(record, action, verdict.reason)


def _response_of(state: AppState, verdict: object) -> StoredResponse | None:
    """The snapshot to complete the record with, or None to reopen it.

    :raises _Unsettled: the verdict keeps the record stuck.
    """
    if not isinstance(verdict, Verdict):
        raise _Unsettled(f"the reconciler returned {type(verdict).__name__}, not a Verdict")
    if verdict.answer is Answer.UNKNOWN:
        raise _Unsettled(verdict.reason or "the reconciler could not tell")
    if verdict.answer is Answer.NOT_HAPPENED:
        return None
    assert verdict.response is not None
    response = current_app.make_response(verdict.response)
    if response.status_code not in STORABLE_STATUSES:
        raise _Unsettled(f"status {response.status_code} is not a final answer")
    if response.status_code in state.settings.never_store:
        # A request answering this status would have released its key; storing it would
        # replay a transient failure forever.
        raise _Unsettled(f"status {response.status_code} is never stored (IDEMPOTENCY_NEVER_STORE)")
    stored = response_snapshot(state.settings, response)
    if stored is None:
        raise _Unsettled("the response is streamed or larger than IDEMPOTENCY_MAX_BODY")
    return stored
