"""The store interface behind the cache service, and the value types it speaks (the shared-memory data plane's
too: `reserve` / `commit` / `locate` of an arena store, see `memory_store`).

Contract every backend keeps (docs/architecture.md, "Cache service contract"):
- Keys are opaque bytes (`objects.encode_key`); values are immutable payloads with a `Checksum`.
- `put_many` verifies each payload against its checksum before storing it (mismatch: CORRUPT, nothing stored); an
  object becomes visible to readers whole or not at all. Re-putting a key replaces the object.
- `get_many` verifies every payload it returns; a mismatch is answered CORRUPT, counted in `corrupt_reads` (and in
  `misses`) and the object is removed. Found objects count as `hits`, everything else as `misses`.
- `lookup` reports presence without reading payloads and without touching recency.
- A lease pins present objects: not evicted, not expired, not removed unless `force`, until `release` or its TTL.
- A backend failure is a per-key ERROR (counted in `errors`), never an exception out of a batch method
  (`put_many`, `get_many`, `lease`, `remove`) (a caller may ask a `RedisStore` to raise instead: the direct data
  plane client, which then retries over gRPC). The methods without per-key results (`lookup`, `release`, `stats`)
  raise `StoreUnavailableError` instead.
- Every method is safe to call from several threads at once (the servicer runs them in a thread pool).
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass, field

from cache_service.objects import Checksum, Status


class StoreUnavailableError(RuntimeError):
    """The backend cannot be reached (e.g. Redis down)."""


@dataclass(frozen=True)
class PutItem:
    key: bytes
    data: bytes
    checksum: Checksum
    # Time to live (seconds) from when the object is stored; None: no expiry.
    ttl_s: float | None = None


@dataclass(frozen=True)
class KeyOutcome:
    status: Status
    message: str = ""


@dataclass(frozen=True)
class GetOutcome:
    status: Status
    data: bytes | None = None  # the payload, when FOUND
    checksum: Checksum | None = None  # its verified checksum, when FOUND
    message: str = ""


@dataclass(frozen=True)
class LookupOutcome:
    prefix_hit_length: int  # number of leading keys present
    present: list[bool] = field(default_factory=list)  # per key, when asked for


@dataclass(frozen=True)
class LeaseGrant:
    lease_id: str  # "" when no key was found
    outcomes: list[KeyOutcome]  # per key: FOUND (pinned), MISSING or ERROR
    ttl_s: float


@dataclass
class StoreCounters:
    """Counts since the store was created. Mutated only under the owning store's lock."""

    hits: int = 0
    misses: int = 0
    corrupt_reads: int = 0
    evictions: int = 0
    expirations: int = 0
    puts: int = 0
    removes: int = 0
    errors: int = 0


@dataclass(frozen=True)
class StoreStats:
    backend: str
    objects: int
    stored_bytes: int
    capacity_bytes: int  # 0: the backend sets its own limit
    leased_objects: int
    active_leases: int
    counters: StoreCounters
    high_watermark: float = 0.0
    low_watermark: float = 0.0


# -- the shared-memory data plane (memory stores with an arena) -------------------------------------------------


@dataclass(frozen=True)
class ReserveItem:
    key: bytes
    size: int  # payload bytes
    ttl_s: float | None = None  # from commit; None: no expiry


@dataclass(frozen=True)
class ReserveOutcome:
    status: Status  # RESERVED, TOO_LARGE
    offset: int = 0  # when RESERVED: file offset of the payload's first byte
    message: str = ""


@dataclass(frozen=True)
class ReservationGrant:
    reservation_id: str  # "" when nothing was reserved
    outcomes: list[ReserveOutcome]
    ttl_s: float


@dataclass(frozen=True)
class Location:
    status: Status  # FOUND or MISSING
    offset: int = 0  # when FOUND: file offset of the payload's first byte
    size: int = 0  # payload bytes
    checksum: Checksum | None = None


@dataclass(frozen=True)
class LocateGrant:
    pin_id: str  # "" when nothing was found
    locations: list[Location]
    ttl_s: float


def prefix_length(present: Sequence[bool]) -> int:
    """Number of leading True entries."""
    for i, hit in enumerate(present):
        if not hit:
            return i
    return len(present)


class Store(abc.ABC):
    """A content-addressed object store. See the module docstring for the contract."""

    backend: str = ""

    @abc.abstractmethod
    def put_many(self, items: Sequence[PutItem]) -> list[KeyOutcome]:
        """Per item: STORED, CORRUPT (checksum mismatch), TOO_LARGE or ERROR."""

    @abc.abstractmethod
    def get_many(self, keys: Sequence[bytes]) -> list[GetOutcome]:
        """Per key: FOUND (with data and checksum), MISSING, CORRUPT or ERROR."""

    @abc.abstractmethod
    def lookup(self, keys: Sequence[bytes], include_presence: bool = False) -> LookupOutcome:
        """Prefix-hit length of `keys` (chain order); with `include_presence`, presence of every key.

        Raises StoreUnavailableError when the backend cannot answer."""

    @abc.abstractmethod
    def lease(self, keys: Sequence[bytes], ttl_s: float) -> LeaseGrant:
        """Pins the present keys for `ttl_s` seconds under one new lease id."""

    @abc.abstractmethod
    def release(self, lease_id: str) -> tuple[bool, int]:
        """Ends a lease -> (whether it was active, number of keys it pinned). Raises StoreUnavailableError."""

    @abc.abstractmethod
    def remove(self, keys: Sequence[bytes], force: bool = False) -> list[KeyOutcome]:
        """Per key: REMOVED, MISSING, LEASED (kept; not forced) or ERROR."""

    @abc.abstractmethod
    def stats(self) -> StoreStats:
        """Occupancy and counters. Raises StoreUnavailableError when the backend cannot answer."""

    @abc.abstractmethod
    def expire(self) -> int:
        """Drops unleased objects whose TTL ran out -> how many were dropped."""

    def close(self) -> None:
        """Releases connections; the store is unusable afterwards."""
