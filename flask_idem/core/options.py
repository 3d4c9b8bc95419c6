"""How one view (or blueprint, or the whole application), or one background job, is protected."""

from __future__ import annotations

import dataclasses
import re
import typing as t
import warnings

from flask.typing import ResponseReturnValue

from .config import MAXIMA
from .errors import ConfigurationError
from .record import StoredResponse

Recovery = t.Literal["fail", "reexecute"]
FingerprintFunction = t.Callable[[t.Any], "bytes | str"]
#: Reads the key of a request that carries its own (a webhook's event id): ``(request) -> str``.
KeyFunction = t.Callable[[t.Any], "str | int | None"]
#: A job's key or tenant: the name of one of its parameters, or a callable taking its arguments.
JobArgument = str | t.Callable[..., t.Any]
#: Builds the answer to a retry from the stored snapshot (see ``replay=``).
ReplayFunction = t.Callable[[StoredResponse], ResponseReturnValue]

#: Attribute of a protected (or exempt) view function that carries its options.
OPTIONS_ATTRIBUTE = "__idempotency__"


def _check_outcome_options(recovery: str, ttl: float | None) -> None:
    if recovery not in ("fail", "reexecute"):
        raise ConfigurationError("recovery must be 'fail' or 'reexecute'")
    if ttl is not None and not 0 < ttl <= MAXIMA["IDEMPOTENCY_TTL"]:
        raise ConfigurationError(
            f"ttl must be a positive number of seconds, at most {MAXIMA['IDEMPOTENCY_TTL']:.0f}"
        )


@dataclasses.dataclass(frozen=True)
class ViewOptions:
    """The per-view options of :meth:`Idempotency.idempotent <flask_idem.Idempotency.idempotent>`.

    ``release_before_contact`` is the view's promise that it calls ``idem.downstream_key()``
    or ``idem.side_effect()`` before any contact with the outside world, so that a failure
    before that call provably committed nothing and gives the key back. Without the promise
    every failure leaves the key ``unknown`` (the safe default), unless the view answers
    through ``idem.refuse()``.

    ``atomic`` puts the claim inside the view's business transaction (``idem.connection()``):
    the claim, the business rows and the stored response commit once, and any failure rolls
    all of it back, so the key is free again. Only for views whose effects are all in that
    transaction: external calls are refused.
    """

    ttl: float | None = None
    required: bool | None = None
    exclude: tuple[str, ...] = ()
    include: tuple[str, ...] | None = None
    fingerprint: FingerprintFunction | None = None
    recovery: Recovery = "fail"
    release_before_contact: bool = False
    atomic: bool = False
    replay: ReplayFunction | None = None
    #: Takes the key from the request instead of the header (see ``key=``).
    key: KeyFunction | None = None

    def __post_init__(self) -> None:
        _check_outcome_options(self.recovery, self.ttl)
        if self.atomic and (self.recovery != "fail" or self.release_before_contact):
            raise ConfigurationError(
                "an atomic view never leaves an unknown outcome (a failure rolls everything "
                "back): recovery= and release_before_contact= do not apply to it"
            )
        if self.fingerprint is not None and (self.exclude or self.include is not None):
            raise ConfigurationError("give either fingerprint= or exclude=/include=, not both")
        if self.replay is not None and not callable(self.replay):
            raise ConfigurationError("replay must be a callable taking the stored response")
        if self.key is not None and (not callable(self.key) or self.required is False):
            raise ConfigurationError(
                "key must be a callable taking the request, and a key taken from the request "
                "is always required"
            )

    @classmethod
    def build(
        cls,
        *,
        exclude: t.Iterable[str] = (),
        include: t.Iterable[str] | None = None,
        **options: t.Any,
    ) -> ViewOptions:
        return cls(
            exclude=tuple(exclude),
            include=None if include is None else tuple(include),
            **options,
        )


def release_option(release_before_contact: bool, declares_effects: bool | None) -> bool:
    """``release_before_contact``, or its former name ``declares_effects`` (deprecated: it
    did not say that it gives the key back)."""
    if declares_effects is None:
        return release_before_contact
    warnings.warn(
        "declares_effects= is deprecated: use release_before_contact=",
        DeprecationWarning,
        stacklevel=3,  # the caller of the public method
    )
    return release_before_contact or declares_effects


#: The marker of :meth:`Idempotency.exempt <flask_idem.Idempotency.exempt>`.
EXEMPT = ViewOptions()


#: A job's name: what its records' endpoint says after ``JOB `` (Celery task names fit).
JOB_NAME = re.compile(r"[A-Za-z0-9._:/-]{1,200}")


@dataclasses.dataclass(frozen=True)
class JobOptions:
    """The options of :meth:`Idempotency.job <flask_idem.Idempotency.job>`.

    ``recovery`` and ``release_before_contact`` mean what they mean for a view; ``lease`` overrides
    ``IDEMPOTENCY_LEASE`` for long jobs (renewed every third of it while the job runs).
    """

    name: str
    key: JobArgument
    tenant: JobArgument
    ttl: float | None = None
    lease: float | None = None
    recovery: Recovery = "fail"
    release_before_contact: bool = False
    #: ``(*args, **kwargs) -> bytes | str`` replacing the JSON of the job's arguments.
    fingerprint: t.Callable[..., bytes | str] | None = None

    def __post_init__(self) -> None:
        _check_outcome_options(self.recovery, self.ttl)
        if not JOB_NAME.fullmatch(self.name):
            raise ConfigurationError("a job name is 1 to 200 characters from A-Z a-z 0-9 . _ : / -")
        if self.lease is not None and not 0 < self.lease < float("inf"):
            raise ConfigurationError("lease must be a positive number of seconds")

    @property
    def endpoint(self) -> str:
        """How the job's records spell their endpoint: ``JOB <name>``."""
        return f"JOB {self.name}"
