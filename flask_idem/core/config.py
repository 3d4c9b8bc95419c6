"""``IDEMPOTENCY_*`` configuration: every name and default spelled once, validated once."""

from __future__ import annotations

import dataclasses
import math
import re
import typing as t
import urllib.parse

import sqlalchemy as sa

from .errors import ConfigurationError
from .record import UNREPLAYABLE_HEADERS, Archive
from .sealing import DEFAULT_COMPRESS_MIN, EncryptionKey, parse_keys

#: Seven years of 365 days: audit rows are kept as long as a payment ledger usually is.
AUDIT_RETENTION = 7 * 365 * 86400

#: Config key -> default. docs/configuration.md documents each of them (a test checks it).
DEFAULTS: dict[str, t.Any] = {
    "IDEMPOTENCY_ENABLED": True,
    "IDEMPOTENCY_DATABASE_URL": None,
    "IDEMPOTENCY_ENGINE": None,
    "IDEMPOTENCY_TTL": 86400,
    "IDEMPOTENCY_LEASE": 30,
    "IDEMPOTENCY_HEADER": "Idempotency-Key",
    "IDEMPOTENCY_HEADER_ALIASES": ("X-Idempotency-Key",),
    "IDEMPOTENCY_METHODS": ("POST", "PATCH"),
    "IDEMPOTENCY_KEY_REQUIRED": True,
    "IDEMPOTENCY_PROTECT_ALL": False,
    "IDEMPOTENCY_MAX_BODY": 256 * 1024,
    "IDEMPOTENCY_MAX_REQUEST_BODY": 1024 * 1024,
    "IDEMPOTENCY_STORED_HEADERS": ("Content-Type", "Location", "Content-Language", "ETag", "Link"),
    "IDEMPOTENCY_NEVER_STORE": (401, 403, 408, 425, 429, 502, 503, 504),
    "IDEMPOTENCY_PROBLEM_BASE": "tag:flask-idem.readthedocs.io,2026:problems/",
    "IDEMPOTENCY_WAIT": 0,
    "IDEMPOTENCY_PARTITIONS_AHEAD": 7,
    "IDEMPOTENCY_ENSURE_PARTITIONS": False,
    "IDEMPOTENCY_BLUEPRINT_PREFIX": "/idempotency",
    "IDEMPOTENCY_INSPECT_BODIES": False,
    "IDEMPOTENCY_ENCRYPTION_KEYS": (),
    "IDEMPOTENCY_COMPRESS_MIN": DEFAULT_COMPRESS_MIN,
    "IDEMPOTENCY_REQUIRE_ENCRYPTED": False,
    "IDEMPOTENCY_AUDIT": False,
    "IDEMPOTENCY_AUDIT_RETENTION": AUDIT_RETENTION,
    "IDEMPOTENCY_ARCHIVE_RETENTION": None,
    "IDEMPOTENCY_ARCHIVE_SCHEMA": "idempotency_archive",
    "IDEMPOTENCY_METRICS": False,
    "IDEMPOTENCY_METRICS_TENANT_LABEL": False,
    "IDEMPOTENCY_OPENTELEMETRY": False,
}

_TOKEN = re.compile(r"^[!#$%&'*+\-.^_`|~0-9A-Za-z]+$")  # an HTTP field name (RFC 9110 token)
#: A schema name used unquoted in DDL; ``pg_`` names are PostgreSQL's own.
_SCHEMA = re.compile(r"^(?!pg_)[a-z_][a-z0-9_]{0,62}$")
_METHODS = {"POST", "PUT", "PATCH", "DELETE", "GET", "HEAD", "OPTIONS"}

#: Upper bounds of the numeric settings: every value must be finite, fit the database's
#: interval arithmetic, and keep a worker's work per request bounded.
MAXIMA: dict[str, float] = {
    "IDEMPOTENCY_TTL": 10 * 366 * 86400,  # ten years
    "IDEMPOTENCY_LEASE": 86400,
    "IDEMPOTENCY_WAIT": 60,  # a waiting duplicate holds a worker: stay below server timeouts
    "IDEMPOTENCY_MAX_BODY": 64 * 1024 * 1024,
    "IDEMPOTENCY_MAX_REQUEST_BODY": 1024 * 1024 * 1024,
    "IDEMPOTENCY_PARTITIONS_AHEAD": 366,
    "IDEMPOTENCY_COMPRESS_MIN": 64 * 1024 * 1024,  # no snapshot is larger (MAX_BODY's maximum)
    "IDEMPOTENCY_AUDIT_RETENTION": 100 * 366 * 86400,
    "IDEMPOTENCY_ARCHIVE_RETENTION": 100 * 366 * 86400,
}


@dataclasses.dataclass(frozen=True)
class Settings:
    """The validated ``IDEMPOTENCY_*`` values of one application."""

    database_url: str | None
    engine: sa.Engine | None
    ttl: float
    lease: float
    header: str
    header_aliases: tuple[str, ...]
    methods: frozenset[str]
    key_required: bool
    protect_all: bool
    max_body: int
    #: Largest request body of a protected request, in bytes (413 beyond).
    max_request_body: int
    stored_headers: frozenset[str]
    never_store: frozenset[int]
    problem_base: str
    wait: float
    partitions_ahead: int
    ensure_partitions: bool
    #: URL prefix of the inspection blueprint, or None when it is switched off.
    blueprint_prefix: str | None
    inspect_bodies: bool
    #: The first key encrypts stored responses, all of them decrypt (``repr`` shows ids only).
    encryption_keys: tuple[EncryptionKey, ...] = ()
    #: Bodies of at least this many bytes are stored compressed; None: never.
    compress_min: int | None = DEFAULT_COMPRESS_MIN
    require_encrypted: bool = False
    #: False: no view or job is protected (unit tests); no database is needed.
    enabled: bool = True
    #: Every state transition appends a row to ``idempotency_audit``.
    audit: bool = False
    #: Seconds audit rows are kept; None: for ever.
    audit_retention: float | None = AUDIT_RETENTION
    #: Expired partitions detached into a schema before they are dropped; None: dropped.
    archive: Archive | None = None
    #: Prometheus counters and histograms, fed by the transition signals.
    metrics: bool = False
    #: Counters carry a ``tenant`` label (one series per tenant: mind the cardinality).
    metrics_tenant_label: bool = False
    #: A span per attempt and the same counters through OpenTelemetry's global providers.
    opentelemetry: bool = False

    @property
    def headers(self) -> tuple[str, ...]:
        """The canonical header first, then its aliases."""
        return (self.header, *self.header_aliases)

    @classmethod
    def from_mapping(cls, config: t.Mapping[str, t.Any]) -> Settings:
        """Read and validate the settings; errors say which key and what to do."""
        value = {name: config.get(name, default) for name, default in DEFAULTS.items()}

        def number(name: str, *, minimum: float, integer: bool = False) -> t.Any:
            raw = value[name]
            maximum = MAXIMA[name]
            if isinstance(raw, bool):
                raise ConfigurationError(f"{name} must be a number, got {raw!r}")
            try:
                parsed = int(raw) if integer else float(raw)
                exact = float(raw)
            except (TypeError, ValueError, OverflowError):
                raise ConfigurationError(f"{name} must be a number, got {raw!r}") from None
            # nan passes every comparison below, and inf or 1e300 overflow the database's
            # interval arithmetic: refuse them here, not as a 503 on every request.
            if not math.isfinite(exact):
                raise ConfigurationError(f"{name} must be a finite number, got {raw!r}")
            if integer and exact != parsed:
                raise ConfigurationError(f"{name} must be a whole number, got {raw!r}")
            if parsed < minimum:
                raise ConfigurationError(f"{name} must be at least {minimum}, got {raw!r}")
            if parsed > maximum:
                raise ConfigurationError(f"{name} must be at most {maximum:.0f}, got {raw!r}")
            return parsed

        def names(name: str) -> tuple[str, ...]:
            raw = value[name]
            items = (raw,) if isinstance(raw, str) else tuple(raw)
            for item in items:
                if not isinstance(item, str) or not _TOKEN.match(item):
                    raise ConfigurationError(f"{name}: {item!r} is not an HTTP header name")
            return items

        def flag(name: str) -> bool:
            raw = value[name]
            if isinstance(raw, str):
                if raw.lower() in ("1", "true", "yes", "on"):
                    return True
                if raw.lower() in ("0", "false", "no", "off", ""):
                    return False
            if isinstance(raw, bool):
                return raw
            raise ConfigurationError(f"{name} must be true or false, got {raw!r}")

        ttl = number("IDEMPOTENCY_TTL", minimum=1)
        lease = number("IDEMPOTENCY_LEASE", minimum=1)
        methods_raw = value["IDEMPOTENCY_METHODS"]
        methods = (methods_raw,) if isinstance(methods_raw, str) else tuple(methods_raw)
        methods = tuple(str(m).upper() for m in methods)
        if not methods or not set(methods) <= _METHODS:
            raise ConfigurationError(
                f"IDEMPOTENCY_METHODS must be HTTP methods from {sorted(_METHODS)}, got {methods!r}"
            )
        try:
            never_store = frozenset(int(code) for code in value["IDEMPOTENCY_NEVER_STORE"])
        except (TypeError, ValueError):
            raise ConfigurationError("IDEMPOTENCY_NEVER_STORE must be HTTP status codes") from None
        if not all(100 <= code <= 599 for code in never_store):
            raise ConfigurationError("IDEMPOTENCY_NEVER_STORE must be HTTP status codes")
        stored_headers = frozenset(h.lower() for h in names("IDEMPOTENCY_STORED_HEADERS"))
        if stored_headers & UNREPLAYABLE_HEADERS:
            raise ConfigurationError(
                "IDEMPOTENCY_STORED_HEADERS: "
                f"{', '.join(sorted(stored_headers & UNREPLAYABLE_HEADERS))} describe one "
                "connection or message, and the server sets them for a replay: remove them"
            )
        base = str(value["IDEMPOTENCY_PROBLEM_BASE"])
        parsed_base = urllib.parse.urlsplit(base)
        if not parsed_base.scheme or not (parsed_base.netloc or parsed_base.path):
            raise ConfigurationError(
                f"IDEMPOTENCY_PROBLEM_BASE must be an absolute URI, got {base!r}"
            )
        engine = value["IDEMPOTENCY_ENGINE"]
        if engine is not None and not isinstance(engine, sa.Engine):
            raise ConfigurationError("IDEMPOTENCY_ENGINE must be a SQLAlchemy Engine")
        url = value["IDEMPOTENCY_DATABASE_URL"]
        if url is not None and not isinstance(url, str):
            raise ConfigurationError("IDEMPOTENCY_DATABASE_URL must be a database URL string")
        # None, "" or False switch the inspection blueprint off.
        prefix = value["IDEMPOTENCY_BLUEPRINT_PREFIX"] or None
        if prefix is not None and not (isinstance(prefix, str) and prefix.startswith("/")):
            raise ConfigurationError(
                "IDEMPOTENCY_BLUEPRINT_PREFIX must be a path starting with '/' (e.g. "
                f"'/idempotency'), or None to switch the inspection endpoint off; got {prefix!r}"
            )
        compress_raw = value["IDEMPOTENCY_COMPRESS_MIN"]
        compress_min = (
            None
            if compress_raw is None or compress_raw is False or compress_raw == ""
            else number("IDEMPOTENCY_COMPRESS_MIN", minimum=0, integer=True)
        )
        # parse_keys never echoes key material in its errors.
        encryption_keys = parse_keys(value["IDEMPOTENCY_ENCRYPTION_KEYS"])
        require_encrypted = flag("IDEMPOTENCY_REQUIRE_ENCRYPTED")
        if require_encrypted and not encryption_keys:
            raise ConfigurationError(
                "IDEMPOTENCY_REQUIRE_ENCRYPTED needs IDEMPOTENCY_ENCRYPTION_KEYS: configure the "
                "keys first, and turn it on one TTL after encryption was switched on"
            )
        retention = (
            None
            if value["IDEMPOTENCY_AUDIT_RETENTION"] is None
            else number("IDEMPOTENCY_AUDIT_RETENTION", minimum=86400)
        )
        archive = None
        if value["IDEMPOTENCY_ARCHIVE_RETENTION"] is not None:
            schema = value["IDEMPOTENCY_ARCHIVE_SCHEMA"]
            if not isinstance(schema, str) or not _SCHEMA.fullmatch(schema):
                raise ConfigurationError(
                    "IDEMPOTENCY_ARCHIVE_SCHEMA must be a lowercase SQL name (letters, digits, "
                    "underscores; not pg_...)"
                )
            archive = Archive(schema, number("IDEMPOTENCY_ARCHIVE_RETENTION", minimum=3600))
        header = names("IDEMPOTENCY_HEADER")
        if len(header) != 1:
            raise ConfigurationError("IDEMPOTENCY_HEADER must be one header name")
        return cls(
            database_url=url,
            engine=engine,
            ttl=ttl,
            lease=lease,
            header=header[0],
            header_aliases=names("IDEMPOTENCY_HEADER_ALIASES"),
            methods=frozenset(methods),
            key_required=flag("IDEMPOTENCY_KEY_REQUIRED"),
            protect_all=flag("IDEMPOTENCY_PROTECT_ALL"),
            max_body=number("IDEMPOTENCY_MAX_BODY", minimum=0, integer=True),
            max_request_body=number("IDEMPOTENCY_MAX_REQUEST_BODY", minimum=0, integer=True),
            stored_headers=stored_headers,
            never_store=never_store,
            problem_base=base if base.endswith(("/", ":")) else base + "/",
            wait=number("IDEMPOTENCY_WAIT", minimum=0),
            partitions_ahead=number("IDEMPOTENCY_PARTITIONS_AHEAD", minimum=0, integer=True),
            ensure_partitions=flag("IDEMPOTENCY_ENSURE_PARTITIONS"),
            blueprint_prefix=prefix,
            inspect_bodies=flag("IDEMPOTENCY_INSPECT_BODIES"),
            encryption_keys=encryption_keys,
            compress_min=compress_min,
            require_encrypted=require_encrypted,
            enabled=flag("IDEMPOTENCY_ENABLED"),
            audit=flag("IDEMPOTENCY_AUDIT"),
            audit_retention=retention,
            archive=archive,
            metrics=flag("IDEMPOTENCY_METRICS"),
            metrics_tenant_label=flag("IDEMPOTENCY_METRICS_TENANT_LABEL"),
            opentelemetry=flag("IDEMPOTENCY_OPENTELEMETRY"),
        )
