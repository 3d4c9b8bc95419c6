"""``IDEMPOTENCY_*`` configuration: one table of keys, each with its default, bounds and parser.

The table is :class:`Settings` itself: each of its fields is one key, ``IDEMPOTENCY_`` plus the
field's name in capitals (``ttl`` is ``IDEMPOTENCY_TTL``), declared with :func:`setting` (its
default as an application would write it, and the parser that validates a raw value).
:data:`DEFAULTS` and :data:`MAXIMA` are read off that table; docs/configuration.md lists the
keys in its order (a test compares them).
"""

from __future__ import annotations

import dataclasses
import math
import re
import typing as t
import urllib.parse

import sqlalchemy as sa

from .errors import ConfigurationError
from .key_digest import KeySecret, parse_secrets
from .record import UNREPLAYABLE_HEADERS, Archive
from .scopes import SCOPES, ScopeName
from .sealing import DEFAULT_COMPRESS_MIN, EncryptionKey, parse_keys
from .wire import KEY_HEADER

#: Seven years of 365 days: audit rows are kept as long as a payment ledger usually is.
AUDIT_RETENTION = 7 * 365 * 86400

PREFIX = "IDEMPOTENCY_"

_TOKEN = re.compile(r"^[!#$%&'*+\-.^_`|~0-9A-Za-z]+$")  # an HTTP field name (RFC 9110 token)
#: A schema name used unquoted in DDL; ``pg_`` names are PostgreSQL's own.
_SCHEMA = re.compile(r"^(?!pg_)[a-z_][a-z0-9_]{0,62}$")
_METHODS = {"POST", "PUT", "PATCH", "DELETE", "GET", "HEAD", "OPTIONS"}

#: Reads one key's raw value: ``(key name, raw value) -> setting``; errors name the key.
Parser = t.Callable[[str, t.Any], t.Any]


@dataclasses.dataclass(frozen=True)
class Number:
    """A finite number within bounds: every value must fit the database's interval arithmetic
    and keep a worker's work per request bounded."""

    minimum: float
    maximum: float
    integer: bool = False

    def __call__(self, name: str, raw: t.Any) -> t.Any:
        if isinstance(raw, bool):
            raise ConfigurationError(f"{name} must be a number, got {raw!r}")
        try:
            parsed = int(raw) if self.integer else float(raw)
            exact = float(raw)
        except (TypeError, ValueError, OverflowError):
            raise ConfigurationError(f"{name} must be a number, got {raw!r}") from None
        # nan passes every comparison below, and inf or 1e300 overflow the database's
        # interval arithmetic: refuse them here, not as a 503 on every request.
        if not math.isfinite(exact):
            raise ConfigurationError(f"{name} must be a finite number, got {raw!r}")
        if self.integer and exact != parsed:
            raise ConfigurationError(f"{name} must be a whole number, got {raw!r}")
        if parsed < self.minimum:
            raise ConfigurationError(f"{name} must be at least {self.minimum}, got {raw!r}")
        if parsed > self.maximum:
            raise ConfigurationError(f"{name} must be at most {self.maximum:.0f}, got {raw!r}")
        return parsed


@dataclasses.dataclass(frozen=True)
class Switchable:
    """A number that ``off`` values (compared by type and value: ``False`` is not ``0``)
    switch off, as None."""

    number: Number
    off: tuple[t.Any, ...] = (None,)

    def __call__(self, name: str, raw: t.Any) -> t.Any:
        if any(type(raw) is type(value) and raw == value for value in self.off):
            return None
        return self.number(name, raw)


def _flag(name: str, raw: t.Any) -> bool:
    if isinstance(raw, str):
        if raw.lower() in ("1", "true", "yes", "on"):
            return True
        if raw.lower() in ("0", "false", "no", "off", ""):
            return False
    if isinstance(raw, bool):
        return raw
    raise ConfigurationError(f"{name} must be true or false, got {raw!r}")


def _header_names(name: str, raw: t.Any) -> tuple[str, ...]:
    items = (raw,) if isinstance(raw, str) else tuple(raw)
    for item in items:
        if not isinstance(item, str) or not _TOKEN.match(item):
            raise ConfigurationError(f"{name}: {item!r} is not an HTTP header name")
    return items


def _header_name(name: str, raw: t.Any) -> str:
    names = _header_names(name, raw)
    if len(names) != 1:
        raise ConfigurationError(f"{name} must be one header name")
    return names[0]


def _http_methods(name: str, raw: t.Any) -> frozenset[str]:
    given = (raw,) if isinstance(raw, str) else tuple(raw)
    upper = tuple(str(m).upper() for m in given)
    if not upper or not set(upper) <= _METHODS:
        raise ConfigurationError(
            f"{name} must be HTTP methods from {sorted(_METHODS)}, got {upper!r}"
        )
    return frozenset(upper)


def _stored_header_names(name: str, raw: t.Any) -> frozenset[str]:
    lowered = frozenset(h.lower() for h in _header_names(name, raw))
    if lowered & UNREPLAYABLE_HEADERS:
        raise ConfigurationError(
            f"{name}: {', '.join(sorted(lowered & UNREPLAYABLE_HEADERS))} describe one "
            "connection or message, and the server sets them for a replay: remove them"
        )
    return lowered


def _status_codes(name: str, raw: t.Any) -> frozenset[int]:
    try:
        codes = frozenset(int(code) for code in raw)
    except (TypeError, ValueError):
        raise ConfigurationError(f"{name} must be HTTP status codes") from None
    if not all(100 <= code <= 599 for code in codes):
        raise ConfigurationError(f"{name} must be HTTP status codes")
    return codes


def _absolute_uri(name: str, raw: t.Any) -> str:
    """An absolute URI a name is appended to (so it ends with ``/`` or ``:``)."""
    base = str(raw)
    parsed = urllib.parse.urlsplit(base)
    if not parsed.scheme or not (parsed.netloc or parsed.path):
        raise ConfigurationError(f"{name} must be an absolute URI, got {base!r}")
    return base if base.endswith(("/", ":")) else base + "/"


def _an_engine(name: str, raw: t.Any) -> sa.Engine | None:
    if raw is not None and not isinstance(raw, sa.Engine):
        raise ConfigurationError(f"{name} must be a SQLAlchemy Engine")
    return raw


def _a_database_url(name: str, raw: t.Any) -> str | None:
    if raw is not None and not isinstance(raw, str):
        raise ConfigurationError(f"{name} must be a database URL string")
    return raw


def _url_prefix(name: str, raw: t.Any) -> str | None:
    """A path starting with ``/``; None, "" or False switch the mounted thing off."""
    prefix = raw or None
    if prefix is not None and not (isinstance(prefix, str) and prefix.startswith("/")):
        raise ConfigurationError(
            f"{name} must be a path starting with '/' (e.g. '/idempotency'), or None to "
            f"switch the inspection endpoint off; got {prefix!r}"
        )
    return prefix


def _scope_name(name: str, raw: t.Any) -> ScopeName:
    if raw not in SCOPES:
        raise ConfigurationError(f"{name} must be one of {', '.join(SCOPES)}, got {raw!r}")
    return t.cast(ScopeName, raw)


def _a_principal_callable(name: str, raw: t.Any) -> t.Callable[[], t.Any] | None:
    if raw is not None and not callable(raw):
        raise ConfigurationError(
            f"{name} must be a callable returning the current request's principal (a user "
            "id, an API key's id), or None"
        )
    return t.cast("t.Callable[[], t.Any] | None", raw)


def _encryption_keys(name: str, raw: t.Any) -> tuple[EncryptionKey, ...]:
    return parse_keys(raw, name)  # never echoes key material in its errors


def rate_limit(name: str, raw: t.Any) -> str | None:
    """A rate limit in the ``limits`` notation (``"100/minute"``, ``"10/second;500/hour"``);
    None, "" or False switch it off. Counting needs the ``limits`` package (Flask-Limiter
    brings it), so its absence fails here, when the limit is configured."""
    if raw is None or raw is False or raw == "":
        return None
    if not isinstance(raw, str):
        raise ConfigurationError(f"{name} must be a rate limit such as '100/minute', got {raw!r}")
    try:
        import limits
    except ImportError:
        raise ConfigurationError(
            f"{name} needs the limits package: pip install 'flask-idem[ratelimit]' (or "
            "Flask-Limiter, which brings it)"
        ) from None
    try:
        limits.parse_many(raw)
    except ValueError:
        raise ConfigurationError(
            f"{name} must be a rate limit such as '100/minute' or '10/second;500/hour', got {raw!r}"
        ) from None
    return raw


def _key_secrets(name: str, raw: t.Any) -> tuple[KeySecret, ...]:
    return parse_secrets(raw, name)  # never echoes a secret in its errors


def _unchecked(name: str, raw: t.Any) -> t.Any:
    """Taken as it is, checked with the keys it depends on (:meth:`Settings.__post_init__`)."""
    return raw


@dataclasses.dataclass(frozen=True)
class ConfigKey:
    """One ``IDEMPOTENCY_*`` key: its default (as an application writes it) and its parser."""

    default: t.Any
    parse: Parser

    @property
    def maximum(self) -> float | None:
        """The upper bound of a numeric key."""
        number = self.parse.number if isinstance(self.parse, Switchable) else self.parse
        return number.maximum if isinstance(number, Number) else None


_METADATA = "flask_idem.config_key"


def setting(default: t.Any, parse: Parser) -> t.Any:
    """Declare a field of :class:`Settings` as the key ``IDEMPOTENCY_<FIELD>``."""
    return dataclasses.field(metadata={_METADATA: ConfigKey(default, parse)})


@dataclasses.dataclass(frozen=True)
class Settings:
    """The validated ``IDEMPOTENCY_*`` values of one application; each field is one key."""

    #: False: no view or job is protected (unit tests); no database is needed.
    enabled: bool = setting(True, _flag)
    database_url: str | None = setting(None, _a_database_url)
    engine: sa.Engine | None = setting(None, _an_engine)
    #: False: only SQLAlchemy's public API (flask_idem.store.fast_path says what that costs).
    sqlalchemy_fast_path: bool = setting(True, _flag)
    ttl: float = setting(86400, Number(1, 10 * 366 * 86400))  # ten years at most
    lease: float = setting(30, Number(1, 86400))
    header: str = setting(KEY_HEADER, _header_name)
    header_aliases: tuple[str, ...] = setting(("X-Idempotency-Key",), _header_names)
    methods: frozenset[str] = setting(("POST", "PATCH"), _http_methods)
    key_required: bool = setting(True, _flag)
    protect_all: bool = setting(False, _flag)
    #: The namespace of a key: ``"endpoint"`` (one per endpoint) or ``"account"`` (one per
    #: tenant across the account-wide endpoints; see :mod:`flask_idem.core.scopes`).
    scope: ScopeName = setting("endpoint", _scope_name)
    #: ``() -> str | int`` returning the current request's principal (user id, API key id):
    #: keys are then per principal inside the tenant. None: per tenant.
    principal: t.Callable[[], t.Any] | None = setting(None, _a_principal_callable)
    max_body: int = setting(256 * 1024, Number(0, 64 * 1024 * 1024, integer=True))
    #: Largest request body of a protected request, in bytes (413 beyond).
    max_request_body: int = setting(1024 * 1024, Number(0, 1024 * 1024 * 1024, integer=True))
    stored_headers: frozenset[str] = setting(
        ("Content-Type", "Location", "Content-Language", "ETag", "Link"), _stored_header_names
    )
    never_store: frozenset[int] = setting((401, 403, 408, 425, 429, 502, 503, 504), _status_codes)
    problem_base: str = setting("tag:flask-idem.readthedocs.io,2026:problems/", _absolute_uri)
    #: New keys (claims that create a record) each tenant may make, e.g. ``"100/minute"``;
    #: None: no limit. Replays, 409s and 422s are never counted.
    key_rate_limit: str | None = setting(None, rate_limit)
    #: A waiting duplicate holds a worker: stay below server timeouts.
    wait: float = setting(0, Number(0, 60))
    partitions_ahead: int = setting(7, Number(0, 366, integer=True))
    ensure_partitions: bool = setting(False, _flag)
    #: URL prefix of the inspection blueprint, or None when it is switched off.
    blueprint_prefix: str | None = setting("/idempotency", _url_prefix)
    inspect_bodies: bool = setting(False, _flag)
    #: The first key encrypts stored responses, all of them decrypt (``repr`` shows ids only).
    encryption_keys: tuple[EncryptionKey, ...] = setting((), _encryption_keys)
    #: Bodies of at least this many bytes are stored compressed; None: never. No snapshot is
    #: larger than MAX_BODY's maximum.
    compress_min: int | None = setting(
        DEFAULT_COMPRESS_MIN,
        Switchable(Number(0, 64 * 1024 * 1024, integer=True), off=(None, False, "")),
    )
    require_encrypted: bool = setting(False, _flag)
    #: The first secret digests stored keys and keys fingerprints (HMAC-SHA256), all of them
    #: are looked up; none: unkeyed SHA-256 (``repr`` shows ids only).
    key_secrets: tuple[KeySecret, ...] = setting((), _key_secrets)
    #: Every state transition appends a row to ``idempotency_audit``.
    audit: bool = setting(False, _flag)
    #: Seconds audit rows are kept; None: for ever.
    audit_retention: float | None = setting(
        AUDIT_RETENTION, Switchable(Number(86400, 100 * 366 * 86400))
    )
    #: Seconds an expired partition stays archived; None: expired partitions are dropped.
    archive_retention: float | None = setting(None, Switchable(Number(3600, 100 * 366 * 86400)))
    #: Checked only when archiving is on (:attr:`archive_retention`).
    archive_schema: str = setting("idempotency_archive", _unchecked)
    #: Prometheus counters and histograms, fed by the transition signals.
    metrics: bool = setting(False, _flag)
    #: Counters carry a ``tenant`` label (one series per tenant: mind the cardinality).
    metrics_tenant_label: bool = setting(False, _flag)
    #: A span per attempt and the same counters through OpenTelemetry's global providers.
    opentelemetry: bool = setting(False, _flag)

    def __post_init__(self) -> None:
        """The rules between keys."""
        if self.require_encrypted and not self.encryption_keys:
            raise ConfigurationError(
                "IDEMPOTENCY_REQUIRE_ENCRYPTED needs IDEMPOTENCY_ENCRYPTION_KEYS: configure the "
                "keys first, and turn it on one TTL after encryption was switched on"
            )
        if self.archive_retention is not None and not (
            isinstance(self.archive_schema, str) and _SCHEMA.fullmatch(self.archive_schema)
        ):
            raise ConfigurationError(
                "IDEMPOTENCY_ARCHIVE_SCHEMA must be a lowercase SQL name (letters, digits, "
                "underscores; not pg_...)"
            )

    @property
    def headers(self) -> tuple[str, ...]:
        """The canonical header first, then its aliases."""
        return (self.header, *self.header_aliases)

    @property
    def archive(self) -> Archive | None:
        """Where expired partitions are detached to before they are dropped; None: dropped."""
        if self.archive_retention is None:
            return None
        return Archive(self.archive_schema, self.archive_retention)

    @classmethod
    def from_mapping(cls, config: t.Mapping[str, t.Any]) -> Settings:
        """Read and validate the settings; errors say which key and what to do."""
        values = {
            name: key.parse(config_name, config.get(config_name, key.default))
            for name, config_name, key in keys()
        }
        return cls(**values)


def keys() -> t.Iterator[tuple[str, str, ConfigKey]]:
    """``(field, IDEMPOTENCY_* name, key)`` for each key, in the table's order."""
    for field in dataclasses.fields(Settings):
        yield field.name, PREFIX + field.name.upper(), field.metadata[_METADATA]


#: The extension's key in ``app.extensions`` (its :class:`~flask_idem.state.AppState`).
EXTENSION_NAME = "idempotency"

#: Config key -> default. docs/configuration.md documents each of them (a test checks it).
DEFAULTS: dict[str, t.Any] = {name: key.default for _, name, key in keys()}

#: Upper bounds of the numeric settings.
MAXIMA: dict[str, float] = {name: key.maximum for _, name, key in keys() if key.maximum is not None}


def check_override(option: str, key: str, value: t.Any) -> t.Any:
    """``value`` of a view's or job's ``option`` that overrides config ``key``, parsed as the
    key is: an override keeps to the key's bounds (a lease of a millisecond would renew in a
    busy loop, a TTL of 1e300 overflow the database's intervals).

    :raises ConfigurationError: it is out of them (the message names the option).
    """
    parse = next(found for _, name, found in keys() if name == key).parse
    try:
        return parse(key, value)
    except ConfigurationError as exc:
        raise ConfigurationError(f"{option}= (overrides {key}): {exc}") from None
