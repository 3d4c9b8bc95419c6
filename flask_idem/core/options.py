"""How one view (or blueprint, or the whole application), or one background job, is protected.

Each option is declared once, as a key of a ``TypedDict`` (:class:`ViewOptionArgs`,
:class:`BlueprintOptionArgs`, :class:`JobOptionArgs`, sharing :class:`OutcomeArgs`): the
decorators take ``**options: Unpack[...]`` of it, so a type checker checks their callers (and
they refuse other keywords at run time), and its comment is the option's documentation. The
frozen dataclasses (:class:`ViewOptions`, :class:`JobOptions`, sharing :class:`OutcomeOptions`)
hold the validated values with their defaults; they restate the names only because a type
checker reads attributes from a class, not from a ``TypedDict`` (tests/unit/test_options.py keeps
the two equal).

Why not one declaration: mypy types ``**options`` only from a ``TypedDict`` (PEP 692) and
attributes only from a class, and derives neither from the other without a plugin. A dataclass
built at run time from the ``TypedDict`` (or the other way round) is ``Any`` to mypy, so under
``strict`` a wrong option type would pass the decorators or every read of ``options.atomic``;
the ``TypedDict`` itself as the run-time value (a dict read as ``options["atomic"]``) would be
mutable data where the style is frozen dataclasses; a decorator typed from the dataclass's
``__init__`` (``ParamSpec``) cannot keep ``idempotent``'s two overloads (bare, and with
options). So each name is written twice, its documentation once (here, on the ``TypedDict``),
its default and validation once (on the dataclass), and a test fails when the names part.
"""

from __future__ import annotations

import dataclasses
import re
import typing as t
import warnings

from flask.typing import ResponseReturnValue

from .config import check_override, rate_limit
from .errors import ConfigurationError
from .record import StoredResponse
from .scopes import SCOPES, ScopeName

Recovery = t.Literal["fail", "reexecute"]
FingerprintFunction = t.Callable[[t.Any], "bytes | str"]
#: Reads the key of a request that carries its own (a webhook's event id): ``(request) -> str``.
KeyFunction = t.Callable[[t.Any], "str | int | None"]
#: A job's key or tenant: the name of one of its parameters, or a callable taking its arguments.
JobArgument = str | t.Callable[..., t.Any]
#: Returns the current request's principal: ``() -> str | int`` (see ``principal=``).
PrincipalFunction = t.Callable[[], t.Any]
#: Builds the answer to a retry from the stored snapshot (see ``replay=``).
ReplayFunction = t.Callable[[StoredResponse], ResponseReturnValue]

#: Attribute of a protected (or exempt) view function that carries its options.
OPTIONS_ATTRIBUTE = "__idempotency__"


class OutcomeArgs(t.TypedDict, total=False):
    """The options a view and a job share: how long the key lives and what a failure does."""

    #: Seconds the key stays live (default ``IDEMPOTENCY_TTL``), counted from the claim and
    #: again from the end of the attempt; for a job, longer than the queue's longest
    #: redelivery delay.
    ttl: float | None
    #: What a retry does when the outcome of the first attempt is unknown (it failed after
    #: contact with the outside world, or its lease ran out): ``"fail"`` (409
    #: ``outcome-pending``, or ``JobOutcomePending``, until reconciled) or ``"reexecute"``
    #: (run it again as the same operation, with the same downstream keys; for external calls
    #: that deduplicate on them).
    recovery: Recovery
    #: A failure before the first ``idem.downstream_key()`` or ``idem.side_effect()`` gives the
    #: key back for a fresh execution (the code promises to call one of them before any
    #: contact with the outside world). Without it every failure leaves the key ``unknown``,
    #: unless the view answers through ``idem.refuse()``.
    release_before_contact: bool
    #: The former name of ``release_before_contact`` (deprecated).
    declares_effects: bool | None


class BlueprintOptionArgs(OutcomeArgs, total=False):
    """The options of :meth:`Idempotency.protect_blueprint
    <flask_idem.Idempotency.protect_blueprint>` (a view's but ``key``): those of
    :class:`OutcomeArgs` and these."""

    #: Whether a request without a key is refused with 400 (default
    #: ``IDEMPOTENCY_KEY_REQUIRED``); an optional key that is absent means no protection.
    required: bool | None
    #: Top-level body fields left out of the fingerprint (volatile ones).
    exclude: t.Iterable[str]
    #: If given, the only top-level body fields in the fingerprint.
    include: t.Iterable[str] | None
    #: ``(request) -> bytes | str`` replacing the canonical body and query comparison.
    fingerprint: FingerprintFunction | None
    #: Claim inside the view's business transaction (``idem.connection()``): the claim, the
    #: business rows and the stored response commit once, a failure rolls all of it back (the
    #: key is free again), and no lease is kept; a concurrent duplicate still gets 409 at
    #: once. Only for views whose effects are all in the database: ``downstream_key()`` and
    #: ``side_effect()`` are refused.
    atomic: bool
    #: ``(stored response) -> response`` building the answer to a retry, for responses that
    #: must not be replayed verbatim (short-lived signed URLs, one-time tokens).
    replay: ReplayFunction | None
    #: New keys each tenant may make on this view (``"10/minute"``), counted for the view
    #: alone, instead of ``IDEMPOTENCY_KEY_RATE_LIMIT``; False: no limit here. Over it, a new
    #: key is refused with 429 ``idempotency-key-rate-limited`` before any claim.
    key_rate_limit: str | t.Literal[False] | None
    #: The key's namespace (default ``IDEMPOTENCY_SCOPE``): ``"endpoint"``, one key per
    #: endpoint, or ``"account"``, one key per tenant (and principal) across every
    #: account-wide endpoint; a reuse on another of them is refused with 422
    #: ``idempotency-key-used-elsewhere``.
    scope: ScopeName | None
    #: ``() -> str | int`` returning the current request's principal (a user id, an API key's
    #: id; never a credential), default ``IDEMPOTENCY_PRINCIPAL``: keys are then per principal
    #: inside the tenant. A callable that raises or returns no usable principal is answered
    #: with 500 ``principal-unresolved``.
    principal: PrincipalFunction | None


class ViewOptionArgs(BlueprintOptionArgs, total=False):
    """The options of :meth:`Idempotency.idempotent <flask_idem.Idempotency.idempotent>`, each
    optional: those of :class:`BlueprintOptionArgs` and :class:`OutcomeArgs`, and ``key``.
    :class:`ViewOptions` holds them validated, with their defaults."""

    #: ``(request) -> str`` taking the key from the request itself, for senders that assign
    #: one per operation (a webhook's event id: ``key=lambda request:
    #: request.get_json()["id"]``); the header is then ignored. A request it finds no key in
    #: (it returns None or raises) is refused with 400 ``idempotency-key-missing``, an invalid
    #: key with 400 ``idempotency-key-invalid``, both before any claim. Verify signatures
    #: before the claim (a ``before_request`` hook or a decorator above the guard).
    key: KeyFunction | None


class JobOptionArgs(OutcomeArgs, total=False):
    """The options of :meth:`Idempotency.job <flask_idem.Idempotency.job>` after its name, key
    and tenant, each optional: those of :class:`OutcomeArgs` and these. :class:`JobOptions`
    holds them validated, with their defaults."""

    #: Seconds before a worker that stopped renewing counts as gone (default
    #: ``IDEMPOTENCY_LEASE``); renewed every third of it while the job runs.
    lease: float | None
    #: ``(*args, **kwargs) -> bytes | str`` replacing the JSON of the job's arguments, which a
    #: redelivery must repeat (else ``JobKeyReused``).
    fingerprint: t.Callable[..., bytes | str] | None


@dataclasses.dataclass(frozen=True, kw_only=True)
class OutcomeOptions:
    """The validated options of :class:`OutcomeArgs`, with their defaults."""

    ttl: float | None = None
    recovery: Recovery = "fail"
    release_before_contact: bool = False

    def __post_init__(self) -> None:
        if self.recovery not in ("fail", "reexecute"):
            raise ConfigurationError("recovery must be 'fail' or 'reexecute'")
        if self.ttl is not None:
            check_override("ttl", "IDEMPOTENCY_TTL", self.ttl)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ViewOptions(OutcomeOptions):
    """How one view (or blueprint, or the whole application) is protected: the options of
    :class:`ViewOptionArgs` (where each is documented), validated, with their defaults."""

    required: bool | None = None
    exclude: tuple[str, ...] = ()
    include: tuple[str, ...] | None = None
    fingerprint: FingerprintFunction | None = None
    atomic: bool = False
    replay: ReplayFunction | None = None
    key_rate_limit: str | t.Literal[False] | None = None
    scope: ScopeName | None = None
    principal: PrincipalFunction | None = None
    key: KeyFunction | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.atomic and (self.recovery != "fail" or self.release_before_contact):
            raise ConfigurationError(
                "an atomic view never leaves an unknown outcome (a failure rolls everything "
                "back): recovery= and release_before_contact= do not apply to it"
            )
        if self.fingerprint is not None and (self.exclude or self.include is not None):
            raise ConfigurationError("give either fingerprint= or exclude=/include=, not both")
        if self.replay is not None and not callable(self.replay):
            raise ConfigurationError("replay must be a callable taking the stored response")
        if self.key_rate_limit is not False:
            rate_limit("key_rate_limit", self.key_rate_limit)  # refused here, not per request
        if self.scope is not None and self.scope not in SCOPES:
            raise ConfigurationError(f"scope must be one of {', '.join(SCOPES)}")
        if self.principal is not None and not callable(self.principal):
            raise ConfigurationError("principal must be a callable returning the principal")
        if self.key is not None and (not callable(self.key) or self.required is False):
            raise ConfigurationError(
                "key must be a callable taking the request, and a key taken from the request "
                "is always required"
            )

    @classmethod
    def build(
        cls, caller: str, declaration: type[t.Any], args: t.Mapping[str, t.Any]
    ) -> ViewOptions:
        """The options a decorator was given as its ``**options`` (of ``declaration``, a
        ``TypedDict`` above): iterables as tuples, the deprecated name read."""
        given = _given(caller, declaration, args)
        given["exclude"] = tuple(given.get("exclude", ()))
        if given.get("include") is not None:
            given["include"] = tuple(given["include"])
        return cls(**given)


def _given(caller: str, declaration: type[t.Any], args: t.Mapping[str, t.Any]) -> dict[str, t.Any]:
    """The keywords given to ``caller``, refused as Python refuses an unexpected keyword (the
    type checker refuses them earlier), with ``declares_effects`` (deprecated: it did not say
    that it gives the key back) read as ``release_before_contact``."""
    accepted = declaration.__required_keys__ | declaration.__optional_keys__
    for name in args:
        if name not in accepted:
            raise TypeError(f"{caller}() got an unexpected keyword argument {name!r}")
    given = dict(args)
    declares_effects = given.pop("declares_effects", None)
    if declares_effects is not None:
        warnings.warn(
            "declares_effects= is deprecated: use release_before_contact=",
            DeprecationWarning,
            stacklevel=4,  # the caller of the public method (through build and _given)
        )
        given["release_before_contact"] = given.get("release_before_contact", False) or bool(
            declares_effects
        )
    return given


#: The marker of :meth:`Idempotency.exempt <flask_idem.Idempotency.exempt>`. It holds the
#: defaults, so it equals ``ViewOptions()`` (what ``IDEMPOTENCY_PROTECT_ALL`` claims with): an
#: exempt view is told by :func:`is_exempt` (identity), never by comparing options.
EXEMPT = ViewOptions()

_View = t.TypeVar("_View", bound=t.Callable[..., t.Any])


def mark_exempt(view: _View) -> _View:
    """Mark ``view`` unprotected, whatever protects its blueprint or the application."""
    setattr(view, OPTIONS_ATTRIBUTE, EXEMPT)
    return view


def is_exempt(options: ViewOptions | None) -> bool:
    """Whether ``options`` (a view's :data:`OPTIONS_ATTRIBUTE`) mark it exempt."""
    return options is EXEMPT


#: A job's name: what its records' endpoint says after ``JOB `` (Celery task names fit).
JOB_NAME = re.compile(r"[A-Za-z0-9._:/-]{1,200}")


@dataclasses.dataclass(frozen=True)
class JobOptions(OutcomeOptions):
    """The options of :meth:`Idempotency.job <flask_idem.Idempotency.job>`: its name, key and
    tenant, and those of :class:`JobOptionArgs` (where each is documented), validated, with
    their defaults."""

    name: str
    key: JobArgument
    tenant: JobArgument
    lease: float | None = dataclasses.field(default=None, kw_only=True)
    fingerprint: t.Callable[..., bytes | str] | None = dataclasses.field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not JOB_NAME.fullmatch(self.name):
            raise ConfigurationError("a job name is 1 to 200 characters from A-Z a-z 0-9 . _ : / -")
        if self.lease is not None:
            check_override("lease", "IDEMPOTENCY_LEASE", self.lease)

    @classmethod
    def build(
        cls, name: str, key: JobArgument, tenant: JobArgument, args: t.Mapping[str, t.Any]
    ) -> JobOptions:
        """The options a job decorator was given as its ``**options`` (of
        :class:`JobOptionArgs`), the deprecated name read."""
        return cls(name, key, tenant, **_given("Idempotency.job", JobOptionArgs, args))

    @property
    def endpoint(self) -> str:
        """How the job's records spell their endpoint: ``JOB <name>``."""
        return f"JOB {self.name}"
