"""API keys → tenants, request authentication, and the tenant's prefix-cache salt.

Contract:
- Configuration: `KDAMESH_API_KEYS="key1=tenantA,key2=tenantB"` (comma-separated `key=tenant` entries; a key may
  contain `=`, the tenant is what follows the last one) and/or `--api-keys-file`, a JSON object mapping each key to a
  tenant name or to `{"tenant": ..., "rpm": ..., "tpm": ..., "max_concurrency": ..., "weight": ...}`. In the object
  form a limit that is absent takes the gateway's default, `null` means unlimited; `weight` (a positive finite
  number, default 1) is the tenant's weight in the workers' fair share of their running slots and KV pools
  (engine/fair_share.py), sent with each request (`Principal.weight`). Parsing is strict: empty entries, empty or
  whitespace-bearing keys, tenant names outside `TENANT_NAME`, duplicate keys, unknown fields, non-positive limits
  or weights, or two keys of one tenant with different limits or weights raise `TenantConfigError`, whose message
  names the entry by position, never by its key (keys must not reach logs).
- `TenantDirectory.authenticate(authorization_header)` returns the `Principal` of a `Bearer` key or raises
  `AuthError` with `kind` "missing" (no header, or a scheme without a key), "bad_scheme" (not `Bearer`) or
  "invalid_key" (not configured). The presented key is compared against every configured key with
  `hmac.compare_digest` over fixed-length SHA-256 digests, without stopping at a match, so timing reveals neither
  which key matched nor how long a matching prefix was.
- Open mode: with no keys configured, `is_open` is true and every request (with or without a header) is the
  `ANONYMOUS` principal, under the default limits (gateway/config.py `DEFAULT_TENANT_LIMITS` unless the flags say
  otherwise); the app logs `describe()` ("gateway is open ...") at start-up.
- `CacheSalter.cache_salt(principal, client_salt)` -> 64 hex chars. The tenant salt is HMAC-SHA256 of the principal's
  identity under the server secret (the anonymous principal has an identity of its own, distinct from any tenant
  name). A client-sent salt is only mixed in: SHA-256(tenant salt ‖ client salt), so two tenants sending the same
  client salt still get different salts, and a client can split its own tenant's cache but never join another's.
  An empty client salt counts as none.
- The secret comes from `CacheSalter.from_env(env)`: `KDAMESH_CACHE_SALT_SECRET` when set (at least
  `MIN_SECRET_BYTES` bytes), else a random per-process secret (`ephemeral`: salts, hence cache hits, do not survive a
  restart and are not shared between gateway replicas). No module-level state: the app creates and passes both objects.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import re
import secrets
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path

from gateway.ratelimit import TenantLimits

API_KEYS_ENV = "KDAMESH_API_KEYS"
SALT_SECRET_ENV = "KDAMESH_CACHE_SALT_SECRET"
MIN_SECRET_BYTES = 16
TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}")
LIMIT_FIELDS = ("rpm", "tpm", "max_concurrency")
WEIGHT_FIELD = "weight"
_KEY_FORBIDDEN = re.compile(r"[\s\x00-\x1f\x7f]")
_SALT_DOMAIN = b"kdamesh-tenant-salt-v1\x00"
_MIX_DOMAIN = b"kdamesh-client-salt-v1\x00"


class TenantConfigError(ValueError):
    """The API-key configuration is malformed."""


class AuthError(Exception):
    """Authentication failed (HTTP 401); `kind` is "missing", "bad_scheme" or "invalid_key"."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind
        self.message = message


@dataclass(frozen=True)
class Principal:
    tenant: str
    anonymous: bool = False
    weight: float = 1.0  # the tenant's weight in the workers' fair share


ANONYMOUS = Principal(tenant="anonymous", anonymous=True)


@dataclass(frozen=True)
class KeyEntry:
    """One configured key, kept only as its SHA-256 digest; `limits` holds the fields the entry set explicitly."""

    key_digest: bytes
    tenant: str
    limits: tuple[tuple[str, int | None], ...] = ()
    source: str = ""
    weight: float | None = None  # set explicitly in the entry (None: the default, 1)  # "KDAMESH_API_KEYS entry 2", "keys.json entry 3": for error messages


# ---- parsing -------------------------------------------------------------------------------------------------------


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


def _check_key(key: object, where: str) -> str:
    if not isinstance(key, str) or not key:
        raise TenantConfigError(f"{where}: the API key is empty")
    if _KEY_FORBIDDEN.search(key):
        raise TenantConfigError(f"{where}: the API key contains whitespace or control characters")
    return key


def _check_tenant(tenant: object, where: str) -> str:
    if not isinstance(tenant, str) or not TENANT_NAME.fullmatch(tenant):
        raise TenantConfigError(f"{where}: tenant name {tenant!r} is invalid (1-128 characters of letters, digits and "
                                f"'._:@-', starting with a letter or digit)")
    return tenant


def parse_api_keys(text: str, source: str = API_KEYS_ENV) -> list[KeyEntry]:
    """Parses `key1=tenantA,key2=tenantB`; blank text means no keys."""
    if not text.strip():
        return []
    entries = []
    for i, item in enumerate(text.split(","), 1):
        where = f"{source} entry {i}"
        item = item.strip()
        if not item:
            raise TenantConfigError(f"{where} is empty (stray comma?)")
        key, sep, tenant = item.rpartition("=")
        if not sep:
            raise TenantConfigError(f"{where} has no '=': expected key=tenant")
        entries.append(KeyEntry(_digest(_check_key(key.strip(), where)), _check_tenant(tenant.strip(), where),
                                source=where))
    return _no_duplicate_keys(entries)


def _parse_limits(spec: Mapping[str, object], where: str) -> tuple[tuple[str, int | None], ...]:
    unknown = sorted(set(spec) - {"tenant", WEIGHT_FIELD, *LIMIT_FIELDS})
    if unknown:
        raise TenantConfigError(f"{where}: unknown field(s) {unknown}; allowed: tenant, {', '.join(LIMIT_FIELDS)}, "
                                f"{WEIGHT_FIELD}")
    limits = tuple((name, spec[name]) for name in LIMIT_FIELDS if name in spec)
    try:
        TenantLimits(**dict(limits))
    except ValueError as e:
        raise TenantConfigError(f"{where}: {e}") from None
    return limits


def _parse_weight(spec: Mapping[str, object], where: str) -> float | None:
    if WEIGHT_FIELD not in spec:
        return None
    weight = spec[WEIGHT_FIELD]
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight) or weight <= 0:
        raise TenantConfigError(f"{where}: weight must be a positive number, got {weight!r}")
    return float(weight)


def parse_api_keys_json(data: object, source: str = "api keys file") -> list[KeyEntry]:
    """Parses the decoded JSON of an `--api-keys-file`: an object of key → tenant or key → {tenant, limits}."""
    if not isinstance(data, dict):
        raise TenantConfigError(f"{source}: expected a JSON object of key -> tenant, got {type(data).__name__}")
    if not data:
        raise TenantConfigError(f"{source}: the object has no keys (leave the file out to run an open gateway)")
    entries = []
    for i, (key, value) in enumerate(data.items(), 1):
        where = f"{source} entry {i}"
        key = _check_key(key, where)
        if isinstance(value, str):
            entries.append(KeyEntry(_digest(key), _check_tenant(value, where), source=where))
        elif isinstance(value, dict):
            if "tenant" not in value:
                raise TenantConfigError(f"{where}: the object has no 'tenant'")
            entries.append(KeyEntry(_digest(key), _check_tenant(value["tenant"], where),
                                    _parse_limits(value, where), source=where, weight=_parse_weight(value, where)))
        else:
            raise TenantConfigError(f"{where}: expected a tenant name or an object, got {type(value).__name__}")
    return _no_duplicate_keys(entries)


def load_api_keys_file(path: str | Path) -> list[KeyEntry]:
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise TenantConfigError(f"cannot read the API keys file {path}: {e.strerror or e}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise TenantConfigError(f"the API keys file {path} is not valid JSON: {e}") from None
    return parse_api_keys_json(data, source=path.name)


def _no_duplicate_keys(entries: list[KeyEntry]) -> list[KeyEntry]:
    seen: dict[bytes, str] = {}
    for entry in entries:
        if entry.key_digest in seen:
            raise TenantConfigError(f"{entry.source} repeats the key of {seen[entry.key_digest]}")
        seen[entry.key_digest] = entry.source
    return entries


def _tenant_limits(entries: Iterable[KeyEntry], default: TenantLimits) -> dict[str, TenantLimits]:
    """Each tenant's limits: the default overridden by the fields its entries set (which must agree)."""
    explicit: dict[str, KeyEntry] = {}
    tenants: dict[str, TenantLimits] = {}
    for entry in entries:
        tenants.setdefault(entry.tenant, default)
        if not entry.limits:
            continue
        first = explicit.setdefault(entry.tenant, entry)
        if first.limits != entry.limits:
            raise TenantConfigError(f"{entry.source} gives tenant {entry.tenant!r} limits that differ from "
                                    f"{first.source}")
        tenants[entry.tenant] = replace(default, **dict(entry.limits))
    return tenants


def _tenant_weights(entries: Iterable[KeyEntry]) -> dict[str, float]:
    """Each tenant's fair-share weight: 1 unless its entries set one (which must agree)."""
    explicit: dict[str, KeyEntry] = {}
    weights: dict[str, float] = {}
    for entry in entries:
        weights.setdefault(entry.tenant, 1.0)
        if entry.weight is None:
            continue
        first = explicit.setdefault(entry.tenant, entry)
        if first.weight != entry.weight:
            raise TenantConfigError(f"{entry.source} gives tenant {entry.tenant!r} a weight that differs from "
                                    f"{first.source}")
        weights[entry.tenant] = entry.weight
    return weights


# ---- the directory -------------------------------------------------------------------------------------------------


def _bearer_token(header: str | None) -> str:
    """The key of an `Authorization: Bearer <key>` header, or raises `AuthError`."""
    if header is None or not header.strip():
        raise AuthError("missing", "missing API key: send 'Authorization: Bearer <key>'")
    scheme, _, token = header.strip().partition(" ")
    if scheme.lower() != "bearer":
        raise AuthError("bad_scheme", "unsupported authorization scheme: expected 'Bearer <key>'")
    token = token.strip()
    if not token:
        raise AuthError("missing", "missing API key after 'Bearer'")
    return token


class TenantDirectory:
    """The configured keys and tenants; see the module contract."""

    def __init__(self, entries: Iterable[KeyEntry] = (), default_limits: TenantLimits = TenantLimits()):
        self._entries = tuple(_no_duplicate_keys(list(entries)))
        self._limits = _tenant_limits(self._entries, default_limits)
        self._weights = _tenant_weights(self._entries)
        if self.is_open:
            self._limits = {ANONYMOUS.tenant: default_limits}

    @classmethod
    def from_config(cls, api_keys: str | None = None, api_keys_file: str | Path | None = None,
                    default_limits: TenantLimits = TenantLimits()) -> TenantDirectory:
        """From the `KDAMESH_API_KEYS` value and/or an `--api-keys-file` path (both may be given; keys must differ)."""
        entries = parse_api_keys(api_keys or "")
        if api_keys_file is not None:
            entries += load_api_keys_file(api_keys_file)
        return cls(entries, default_limits)

    @property
    def is_open(self) -> bool:
        return not self._entries

    @property
    def tenants(self) -> tuple[str, ...]:
        """Tenant ids in configuration order (`ANONYMOUS.tenant` alone when open)."""
        return tuple(self._limits)

    def limits(self) -> dict[str, TenantLimits]:
        """Every tenant's limits, the input of `RateLimiter`."""
        return dict(self._limits)

    def weight(self, tenant: str) -> float:
        """A tenant's fair-share weight (1 unless its key entry sets one)."""
        return self._weights.get(tenant, 1.0)

    def describe(self) -> str:
        """A start-up log line."""
        if self.is_open:
            return (f"gateway is open: no API keys configured ({API_KEYS_ENV} / --api-keys-file); every request runs "
                    f"as tenant {ANONYMOUS.tenant!r}")
        return f"gateway requires API keys: {len(self._entries)} key(s) for {len(self._limits)} tenant(s)"

    def authenticate(self, authorization_header: str | None) -> Principal:
        if self.is_open:
            return ANONYMOUS
        presented = _digest(_bearer_token(authorization_header))
        tenant = None
        for entry in self._entries:  # every key is compared: no early exit on a match
            if hmac.compare_digest(presented, entry.key_digest):
                tenant = entry.tenant
        if tenant is None:
            raise AuthError("invalid_key", "invalid API key")
        return Principal(tenant, weight=self.weight(tenant))


# ---- cache salts ---------------------------------------------------------------------------------------------------


class CacheSalter:
    """Derives prefix-cache salts from the authenticated principal; see the module contract."""

    def __init__(self, secret: bytes, ephemeral: bool = False):
        if len(secret) < MIN_SECRET_BYTES:
            raise TenantConfigError(f"the cache-salt secret must have at least {MIN_SECRET_BYTES} bytes")
        self._secret = secret
        self.ephemeral = ephemeral

    @classmethod
    def from_env(cls, env: Mapping[str, str],
                 random_bytes: Callable[[int], bytes] = secrets.token_bytes) -> CacheSalter:
        value = env.get(SALT_SECRET_ENV, "")
        if value:
            return cls(value.encode("utf-8"))
        return cls(random_bytes(32), ephemeral=True)

    def __repr__(self) -> str:
        return f"CacheSalter(ephemeral={self.ephemeral})"

    def tenant_salt(self, principal: Principal) -> bytes:
        identity = b"anonymous" if principal.anonymous else b"tenant:" + principal.tenant.encode("utf-8")
        return hmac.new(self._secret, _SALT_DOMAIN + identity, hashlib.sha256).digest()

    def cache_salt(self, principal: Principal, client_salt: str | None = None) -> str:
        salt = self.tenant_salt(principal)
        if client_salt:
            mixed = hashlib.sha256(_MIX_DOMAIN)
            mixed.update(salt)
            mixed.update(client_salt.encode("utf-8"))
            salt = mixed.digest()
        return salt.hex()
