"""What each transition counts, for every metrics backend (Prometheus and OpenTelemetry).

Both backends receive the signals of :mod:`flask_idem.core.signals` through :func:`subscribe` and
turn them into the same measurements through :class:`Recorder`, so the outcome names, the
labels and what counts once are defined here once; a backend only says how to add to its
instruments.
"""

from __future__ import annotations

import abc
import typing as t

from blinker import NamedSignal
from flask import Flask

from ..core import signals
from ..core.errors import ConfigurationError
from ..events import event_name

#: Seconds; claims take milliseconds, views up to the lease.
CLAIM_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)
VIEW_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
#: What each instrument counts, in both backends.
DESCRIPTIONS = {
    "requests": "Protected requests and job runs that reached the claim, by outcome.",
    "claims": "Keys taken: new claims and takeovers of records nobody owned.",
    "settled": "Stuck records settled by a reconciler or an operator.",
    "claim_duration": (
        "From the start of the claim (body read, fingerprint, store) to its decision."
    ),
    "view_duration": "From the claim to the end of the view or job that held the key.",
}

#: Signal -> the ``outcome`` of ``idempotency_requests_total`` it counts.
OUTCOMES: dict[NamedSignal, str] = {
    signals.completed: "executed",
    signals.replayed: "replayed",
    signals.conflict: "in_progress",
    signals.pending: "outcome_pending",
    signals.not_stored: "not_stored",
    signals.mismatch: "mismatch",
    signals.rate_limited: "rate_limited",
    signals.released: "released",
    signals.unknown: "unknown",
    signals.lease_lost: "lease_lost",
    signals.store_unavailable: "store_unavailable",
}
#: Decisions taken at the claim (their duration is the claim's) ...
AT_CLAIM = frozenset(
    {
        signals.claimed,
        signals.taken_over,
        signals.replayed,
        signals.conflict,
        signals.pending,
        signals.not_stored,
        signals.mismatch,
        signals.rate_limited,
    }
)
#: ... and those that end a view or job that held the key.
AT_END = frozenset({signals.completed, signals.released, signals.unknown, signals.lease_lost})
#: Every signal a backend listens to.
COUNTED = (*OUTCOMES, signals.claimed, signals.taken_over, signals.settled)


def outcome_of(signal: NamedSignal, event: t.Mapping[str, t.Any]) -> str | None:
    """The ``outcome`` a transition counts, or None (a claim, a settlement)."""
    outcome = OUTCOMES.get(signal)
    if outcome == "executed" and event.get("stored") is False:
        return "unstored"
    return outcome


class Recorder(abc.ABC):
    """Turns one transition into the counts and durations every backend keeps.

    A backend implements the five ``add_``/``observe_`` methods; ``tenant`` is None unless
    the backend was asked for a tenant label.

    :param tenant_label: add the tenant to the counters (one series per tenant).
    """

    def __init__(self, *, tenant_label: bool = False) -> None:
        self.tenant_label = tenant_label

    def receive(self, signal: NamedSignal, **event: t.Any) -> None:
        """Count one transition (the receiver of every signal in :data:`COUNTED`)."""
        endpoint = event["endpoint"]
        tenant = event["tenant"] if self.tenant_label else None
        outcome = outcome_of(signal, event)
        if outcome is not None:
            self.add_request(endpoint, outcome, event.get("status"), tenant)
        if signal is signals.claimed or signal is signals.taken_over:
            self.add_claim(endpoint, event_name(signal), tenant)
        elif signal is signals.settled:
            self.add_settled(endpoint, event["actor"], event["action"])
        duration = event.get("duration")
        if duration is None:
            return
        if signal in AT_CLAIM or event.get("stage") == "claim":
            self.observe_claim(endpoint, outcome or event_name(signal), duration)
        elif signal in AT_END or event.get("stage") == "complete":
            self.observe_view(endpoint, outcome or event_name(signal), duration)

    @abc.abstractmethod
    def add_request(
        self, endpoint: str, outcome: str, status: int | None, tenant: str | None
    ) -> None:
        """Add to the backend\'s own instrument."""

    @abc.abstractmethod
    def add_claim(self, endpoint: str, kind: str, tenant: str | None) -> None:
        """Add to the backend\'s own instrument."""

    @abc.abstractmethod
    def add_settled(self, endpoint: str, actor: str, action: str) -> None:
        """Add to the backend\'s own instrument."""

    @abc.abstractmethod
    def observe_claim(self, endpoint: str, outcome: str, seconds: float) -> None:
        """Add to the backend\'s own instrument."""

    @abc.abstractmethod
    def observe_view(self, endpoint: str, outcome: str, seconds: float) -> None:
        """Add to the backend\'s own instrument."""


def subscribe(app: Flask, receive: t.Callable[..., None]) -> None:
    """Connect ``receive(signal, **event)`` to every counted signal ``app`` sends."""
    for signal in COUNTED:

        def receiver(sender: Flask, _signal: NamedSignal = signal, **event: t.Any) -> None:
            receive(_signal, **event)

        signal.connect(receiver, app, weak=False)


_I = t.TypeVar("_I")


class PerProcess(t.Generic[_I]):
    """A backend's default instruments: made once per process, on first use (a second set
    would be duplicate instruments on the default registry or the global providers), so every
    application of the process must agree on ``IDEMPOTENCY_METRICS_TENANT_LABEL``.

    :param make: builds the instruments, given whether they carry a ``tenant`` label.
    :param own: how an application gets instruments of its own instead (for the error).
    """

    def __init__(self, make: t.Callable[[bool], _I], own: str) -> None:
        self._make = make
        self._own = own
        self._made: dict[bool, _I] = {}

    def get(self, tenant_label: bool) -> _I:
        """The instruments, made now if this is the first call of the process.

        :raises ConfigurationError: an earlier application asked for the other labels.
        """
        if tenant_label not in self._made:
            if self._made:
                raise ConfigurationError(
                    "IDEMPOTENCY_METRICS_TENANT_LABEL differs between two applications of "
                    f"this process; give one of them {self._own}"
                )
            self._made[tenant_label] = self._make(tenant_label)
        return self._made[tenant_label]
