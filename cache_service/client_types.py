"""The value types of the cache client's API, shared by `client` and its direct data planes (`data_plane`).

`client` re-exports them: import them from `cache_service.client`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cache_service.objects import Status
from protos import common_pb2

MAX_TTL_MS = 2**32 - 1  # ttl fields are uint32 milliseconds (~49 days)


@dataclass(frozen=True)
class PutObject:
    key: common_pb2.ObjectKey
    data: bytes
    # Time to live (seconds). None: the service default for the kind (HANDOFF: 30 s; others: none). 0: no expiry.
    ttl_s: float | None = None


@dataclass(frozen=True)
class KeyResult:
    key: common_pb2.ObjectKey
    status: Status
    message: str = ""


@dataclass(frozen=True)
class GetResult:
    key: common_pb2.ObjectKey
    status: Status
    data: bytes | None = None  # the payload, when FOUND
    message: str = ""


@dataclass(frozen=True)
class LookupResult:
    prefix_hit_length: int
    present: list[bool] = field(default_factory=list)
    error: str = ""  # set when the service could not answer (the prefix is then 0)


@dataclass(frozen=True)
class LeaseResult:
    lease_id: str  # "" when nothing was pinned
    results: list[KeyResult]
    ttl_s: float


def ttl_ms(ttl_s: float) -> int:
    """A TTL in seconds as the uint32 milliseconds of the wire (0: no expiry)."""
    return min(int(ttl_s * 1000), MAX_TTL_MS)
