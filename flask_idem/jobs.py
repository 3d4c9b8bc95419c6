"""Background jobs with the outcome model of a protected view: ``@idem.job(...)``.

A queue delivers a message at least once: a worker that dies between its write and its ack
gets the message delivered again, to itself or to another worker. A function under
``@idem.job(name, key=..., tenant=...)`` claims the scope ``(tenant, "JOB <name>", key)``
before it runs, stores its return value as JSON together with its business transaction
(``idem.connection()``), and answers a redelivered message with that value instead of a second
run. It needs an app context, not a request: a worker process pushes ``app.app_context()``.

The decisions are the view's (:mod:`flask_idem.attempt`); only the answers differ:

=============================================  =========================  ======================
How the run ended                              The key afterwards         A redelivery gets
=============================================  =========================  ======================
returned a JSON value                          completed (result and      the stored value; the
                                               business rows commit       function does not run
                                               together)
raised (any exception, ``SystemExit``,         released if releasable,    released: a fresh run;
``KeyboardInterrupt``)                         else ``unknown``; the      ``unknown``: see below
                                               business txn rolls back
killed (kill -9, OOM)                          in progress, then stuck    ``JobInProgress``, then
                                               when its lease runs out    as ``unknown``
still running (its lease is renewed)           unchanged                  ``JobInProgress``
returned something not JSON (or that JSON      ``unstored``               ``JobResultNotStored``
gives back altered, or nested too deeply), or
larger than ``IDEMPOTENCY_MAX_BODY``
lost its lease to a re-run                     the taker's                ``JobInProgress`` (the
                                                                          first run raises it)
ended its business transaction itself         released if releasable,    as released or
(``db.session.close()`` or ``remove()``, a     else ``unknown``; never    ``unknown``; the run
rollback, the driver's ``commit()`` or         its result                 raises
``rollback()``)                                                           ``JobOutcomePending``
same key with other arguments                  unchanged                  ``JobKeyReused``
the store fails at the claim                   nothing                    ``StoreUnavailable``
=============================================  =========================  ======================

"Releasable" is the view's rule: the job promises to declare its contact with the outside world
(``release_before_contact=True``) and had not yet called ``idem.downstream_key()`` or
``idem.side_effect()``. An ``unknown`` record
(or one in progress past its lease) is run again by a redelivery only under
``recovery="reexecute"``, as a fenced takeover of the same record, so with the same downstream
keys; under ``recovery="fail"`` a redelivery raises ``JobOutcomePending`` until a reconciler
(``@idem.reconciler(job_function)``) or an operator (``flask idem release``) settles it.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
import logging
import typing as t

from flask import current_app, has_app_context, has_request_context

from .attempt import OUTCOMES, Attempt, Ending, Failure
from .core.errors import ConfigurationError, JobRefused, JobResultNotStored
from .core.fingerprint import fingerprint as canonical_fingerprint
from .core.idempotency_keys import check_key, key_hash
from .core.options import JobArgument, JobOptions
from .core.record import Record, StoredResponse
from .state import AppState

P = t.ParamSpec("P")
R = t.TypeVar("R")

#: Marks a job function (the wrapper) with its :class:`JobOptions`.
JOB_ATTRIBUTE = "__idempotency_job__"
#: A job's result is stored like a JSON response, so that reconcilers settle job records with
#: ``Verdict.happened(value)`` as they settle views' records.
_RESULT_HEADERS = (("Content-Type", "application/json"),)

log = logging.getLogger("flask_idem")


def job(options: JobOptions) -> t.Callable[[t.Callable[P, R]], t.Callable[P, R]]:
    """The decorator behind :meth:`Idempotency.job <flask_idem.Idempotency.job>`."""

    def decorate(function: t.Callable[P, R]) -> t.Callable[P, R]:
        signature = inspect.signature(function)
        for argument in (options.key, options.tenant):
            if isinstance(argument, str) and argument not in signature.parameters:
                raise ConfigurationError(
                    f"job {options.name!r}: {function.__name__}() has no parameter {argument!r}"
                )

        @functools.wraps(function)
        def run(*args: P.args, **kwargs: P.kwargs) -> R:
            if not has_app_context():
                raise RuntimeError(
                    f"job {options.name!r} needs an app context: run it inside "
                    "app.app_context() (see docs/jobs.md for Celery and RQ)"
                )
            arguments = signature.bind(*args, **kwargs)
            arguments.apply_defaults()
            return t.cast(R, _run(options, function, arguments))

        setattr(run, JOB_ATTRIBUTE, options)
        return run

    return decorate


def _run(
    options: JobOptions, function: t.Callable[..., t.Any], call: inspect.BoundArguments
) -> t.Any:
    app_state = AppState.current()
    if not app_state.settings.enabled:
        return _unprotected(app_state, function, call)
    _refuse_a_shared_session(app_state, options)
    scope = app_state.store.keys.scope(
        _tenant(options, call), options.endpoint, _key(options, call)
    )
    with _attached(Attempt(app_state, scope, options)) as attempt:
        attempt.start_trace()
        try:
            stored = _claim(attempt, _fingerprint(options, call))
            if stored is not None:
                return _replayed(stored)
            return _execute(attempt, current_app.ensure_sync(function), call)
        finally:
            # Raised between the claim and the job's end (never by the job itself, whose
            # failures end_run gives up): the attempt decides what becomes of the key.
            attempt.abandon()


def _refuse_a_shared_session(app_state: AppState, options: JobOptions) -> None:
    """With ``Idempotency(db=...)`` a job's business transaction is ``db.session``, the one of
    the protected view (or job) it would run inside: its completion would commit that
    transaction half-way, publishing the outer writes without their record and, for an atomic
    view, releasing its hold on the key, so a retry would run the view again."""
    outer = Attempt.current()
    if app_state.sessions is None or outer is None or not outer.holding:
        return
    raise RuntimeError(
        f"job {options.name!r} cannot run inside a protected request or job with "
        "Idempotency(db=...): it shares db.session, and its commit would commit the outer "
        "transaction half-way; enqueue it, or run it after the response"
    )


@contextlib.contextmanager
def _attached(attempt: Attempt) -> t.Iterator[Attempt]:
    """The job's attempt on ``flask.g`` while it runs; a job run from a view or from another
    job gives the outer attempt back afterwards."""
    outer = Attempt.current()
    attempt.attach()
    try:
        yield attempt
    finally:
        attempt.close()
        if outer is None:
            Attempt.detach()
        else:
            outer.attach()


def _unprotected(
    app_state: AppState, function: t.Callable[..., t.Any], call: inspect.BoundArguments
) -> t.Any:
    """``IDEMPOTENCY_ENABLED`` off: the job runs as a plain function; what it wrote through
    ``idem.connection()`` or ``db.session`` (``Idempotency(db=...)``) commits when it returns
    and rolls back when it raises, as when it is protected."""
    # A worker's job settles db.session; one called inside a request or another job shares
    # the caller's session and leaves it to the caller.
    own_session = Attempt.current() is None and not has_request_context()
    with _attached(Attempt(app_state, None, None)) as attempt:
        if app_state.sessions is not None and own_session:
            attempt.attach_session()
        value = current_app.ensure_sync(function)(*call.args, **call.kwargs)
        attempt.settle_unclaimed()
        return value


def _claim(attempt: Attempt, digest: bytes) -> Record | None:
    """Take the message's key (under the job's ``ttl=`` and ``lease=``), or: the completed
    record to replay (returned), or a refusal (raised: the row's job error). None when the
    job may run."""
    with attempt.reporting_claim_failure():
        acquired = attempt.acquire(digest, until=None)
    if acquired.refusal is not None:
        assert acquired.record is not None
        raise acquired.refusal.job_for(acquired.record)
    return acquired.replay


def _replayed(record: Record) -> t.Any:
    assert record.response is not None
    try:
        return json.loads(record.response.body)
    except (ValueError, RecursionError):
        # Only a reconciler's verdict can store a body that is no JSON.
        raise JobResultNotStored(
            f"{record.scope.endpoint} message {key_hash(record.scope)} completed with a "
            "result that is not JSON"
        ) from None


def _execute(
    attempt: Attempt, function: t.Callable[..., t.Any], call: inspect.BoundArguments
) -> t.Any:
    """Run the job, and answer what the attempt decided at its end
    (:meth:`~flask_idem.attempt.Attempt.end_run`, :meth:`~flask_idem.attempt.Attempt.
    record_result`): its value, its own exception, or the outcome table's job column."""
    assert attempt.scope is not None
    try:
        value = function(*call.args, **call.kwargs)
    except BaseException as exc:
        # Its refusal (idem.refuse(): it did nothing; one of a job it ran inline is a crash),
        # or a crash: any other exception, SystemExit and KeyboardInterrupt too.
        attempt.run_ended(exc, refused=isinstance(exc, JobRefused))
        attempt.end_run("job")
        raise
    attempt.run_ended()
    ending = attempt.end_run("job")
    if ending is Ending.WORK_LOST:
        # Its rows are gone, or did not commit with its result: never stored (a view's answer
        # is refused the same way), the key never given back as if nothing had happened.
        raise OUTCOMES[Failure.WORK_LOST].job(attempt.scope)
    assert ending is Ending.RECORD  # a job that returned has no status, refusal or crash
    snapshot = _snapshot(attempt.app_state, value)
    recording = attempt.record_result(snapshot, ran="job", status=200)
    if recording.error is not None:
        if recording.failure is None:
            return value  # its effects happened outside a business transaction: they stand
        raise recording.error
    if recording.failure is not None:
        raise OUTCOMES[recording.failure].job(attempt.scope)
    if snapshot is None:
        log.warning(
            "job result not stored (not JSON, or larger than IDEMPOTENCY_MAX_BODY); "
            "redeliveries get JobResultNotStored",
            extra={"key_hash": key_hash(attempt.scope)},
        )
    return value


def _snapshot(app_state: AppState, value: t.Any) -> StoredResponse | None:
    """The job's return value as stored JSON (never pickle), or None when it cannot be: not
    JSON, nested deeper than the encoder's stack, larger than ``IDEMPOTENCY_MAX_BODY``, or
    holding a mapping key that is no string (JSON would give ``{1: "a"}`` back as
    ``{"1": "a"}``, and ``{1: "a", "1": "b"}`` as ``{"1": "b"}``: a redelivery must get the
    value the job returned, or be told it was not stored, never another value)."""
    try:
        body = json.dumps(value, separators=(",", ":"), allow_nan=False).encode()
    except (TypeError, ValueError, RecursionError):
        return None
    if len(body) > app_state.settings.max_body or not _string_keys_only(value):
        return None
    return StoredResponse(200, _RESULT_HEADERS, body)


def _string_keys_only(value: t.Any) -> bool:
    """Whether every mapping in ``value`` has string keys only (iterative: ``value`` is as deep
    as ``json.dumps`` allows)."""
    pending = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, dict):
            if not all(isinstance(key, str) for key in item):
                return False
            pending.extend(item.values())
        elif isinstance(item, list | tuple):
            pending.extend(item)
    return True


def _value(argument: JobArgument, call: inspect.BoundArguments) -> t.Any:
    if isinstance(argument, str):
        return call.arguments[argument]
    return argument(*call.args, **call.kwargs)


def _key(options: JobOptions, call: inspect.BoundArguments) -> str:
    key = _value(options.key, call)
    if key is None or key == "":
        # Never the literal key "None": two different messages would share it.
        raise ConfigurationError(f"job {options.name!r} resolved no key for this message")
    return check_key(str(key))


def _tenant(options: JobOptions, call: inspect.BoundArguments) -> str:
    tenant = _value(options.tenant, call)
    if not tenant:
        raise ConfigurationError(
            f"job {options.name!r} resolved no tenant: a job's key is scoped by its tenant, "
            "never by a global namespace"
        )
    return str(tenant)


def _fingerprint(options: JobOptions, call: inspect.BoundArguments) -> bytes:
    """The job's arguments compared like a JSON body (``4200`` equals ``4200.0``)."""
    if options.fingerprint is not None:
        value = options.fingerprint(*call.args, **call.kwargs)
        body = value.encode() if isinstance(value, str) else bytes(value)
        media_type = "application/octet-stream"
    else:
        try:
            body = json.dumps(call.arguments, allow_nan=False).encode()
        except (TypeError, ValueError):
            raise ConfigurationError(
                f"job {options.name!r}: its arguments are not JSON, so they cannot be "
                "compared between deliveries; pass fingerprint="
            ) from None
        media_type = "application/json"
    return canonical_fingerprint("JOB", options.name, {}, (), body, media_type)
