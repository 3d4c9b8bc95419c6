"""How one view (or blueprint, or the whole application) is protected."""

from __future__ import annotations

import dataclasses
import typing as t

from flask.typing import ResponseReturnValue

from .config import MAXIMA
from .errors import ConfigurationError
from .record import StoredResponse

Recovery = t.Literal["fail", "reexecute"]
FingerprintFunction = t.Callable[[t.Any], "bytes | str"]
#: Builds the answer to a retry from the stored snapshot (see ``replay=``).
ReplayFunction = t.Callable[[StoredResponse], ResponseReturnValue]

#: Attribute of a protected (or exempt) view function that carries its options.
OPTIONS_ATTRIBUTE = "__idempotency__"


@dataclasses.dataclass(frozen=True)
class ViewOptions:
    """The per-view options of :meth:`Idempotency.idempotent <flask_idem.Idempotency.idempotent>`.

    ``declares_effects`` is the view's promise that it calls ``idem.downstream_key()`` or
    ``idem.side_effect()`` before any contact with the outside world, so that a failure before
    that call provably committed nothing and may give the key back. Without the promise every
    failure leaves the key ``unknown``: the safe default.
    """

    ttl: float | None = None
    required: bool | None = None
    exclude: tuple[str, ...] = ()
    include: tuple[str, ...] | None = None
    fingerprint: FingerprintFunction | None = None
    recovery: Recovery = "fail"
    declares_effects: bool = False
    replay: ReplayFunction | None = None

    def __post_init__(self) -> None:
        if self.recovery not in ("fail", "reexecute"):
            raise ConfigurationError("recovery must be 'fail' or 'reexecute'")
        if self.ttl is not None and not 0 < self.ttl <= MAXIMA["IDEMPOTENCY_TTL"]:
            raise ConfigurationError(
                f"ttl must be a positive number of seconds, at most {MAXIMA['IDEMPOTENCY_TTL']:.0f}"
            )
        if self.fingerprint is not None and (self.exclude or self.include is not None):
            raise ConfigurationError("give either fingerprint= or exclude=/include=, not both")
        if self.replay is not None and not callable(self.replay):
            raise ConfigurationError("replay must be a callable taking the stored response")

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


#: The marker of :meth:`Idempotency.exempt <flask_idem.Idempotency.exempt>`.
EXEMPT = ViewOptions()
