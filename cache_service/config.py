"""The cache service's one configuration: `CacheServiceConfig`, checked field by field when it is built.

Contract: `CacheServiceConfig(...)` raises ValueError for a backend that is neither "memory" nor a Redis URL (or a
Redis Cluster URL with a valid node list and a key prefix without braces), a
`chunk_bytes` that leaves less than `MESSAGE_OVERHEAD_BYTES` under `max_message_bytes`, watermarks outside
0 < low <= high <= 1, a non-positive TTL or hold time, an unknown `memory_arena` and a mesh token that is too short.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from cache_service.redis_cluster import parse_cluster_url
from cache_service.redis_layout import DEFAULT_INLINE_BYTES, RedisKeys
from telemetry.mesh_auth import check_token

MESSAGE_OVERHEAD_BYTES = 64 << 10  # room for a chunk's non-payload fields under the message limit


@dataclass(frozen=True)
class CacheServiceConfig:
    # host:port to listen on; port 0 picks a free port.
    address: str = "127.0.0.1:50053"
    # "memory", a Redis URL "redis://host:port/db" (also rediss://, unix://), or a Redis Cluster
    # "redis+cluster://host:port,host:port" (seed nodes; the rest is discovered).
    backend: str = "memory"
    # Memory backend: payload bytes kept before eviction (bytes), and the eviction watermarks (fractions of it).
    byte_budget: int = 1 << 30
    high_watermark: float = 0.9
    low_watermark: float = 0.8
    # Default TTL of HANDOFF objects put without one (seconds); default lease duration (seconds).
    handoff_ttl_s: float = 30.0
    lease_ttl_s: float = 30.0
    # Payload bytes per streamed message, and the gRPC message limit both ways (bytes).
    chunk_bytes: int = 1 << 20
    max_message_bytes: int = 4 << 20
    # Largest object accepted (bytes).
    max_object_bytes: int = 1 << 30
    # Redis backend: key prefix, chunk size of stored values (bytes), payloads stored inside their manifest up to
    # this size (bytes), socket timeouts (seconds).
    redis_key_prefix: str = "kdamesh:"
    redis_chunk_bytes: int = 1 << 20
    redis_inline_bytes: int = DEFAULT_INLINE_BYTES
    redis_socket_timeout_s: float = 2.0
    redis_connect_timeout_s: float = 0.5
    # Offer clients a direct data plane (DataPlane RPC): the Redis backend's URL, the memory backend's arena.
    data_plane: bool = True
    # Memory backend: "shm" keeps payloads in a shared-memory arena of byte_budget bytes in shm_dir (its memory is
    # reserved at start; local clients copy in and out directly), prefaulted in this process with shm_populate;
    # "heap" keeps them in this process's memory (gRPC only).
    memory_arena: str = "shm"
    shm_dir: str = "/dev/shm"
    shm_populate: bool = True
    # Commit re-verifies each payload over the arena before publishing it (reads verify either way; see memory_store).
    verify_commits: bool = False
    # Longest Reserve reservation / Locate pin granted (seconds).
    max_hold_s: float = 60.0
    # Threads running store calls; BatchPut batch size (bytes); BatchGet read-ahead (keys).
    store_threads: int = 8
    put_batch_bytes: int = 8 << 20
    get_window_keys: int = 16
    # Serve Prometheus /metrics on this port (0: a free port); None: no HTTP endpoint.
    metrics_port: int | None = None
    # The shared mesh token every call but health/reflection must carry (telemetry.mesh_auth); None: open service.
    mesh_token: str | None = field(default=None, repr=False)

    def __post_init__(self):
        if self.backend != "memory" and not re.match(r"^(rediss?|unix|redis\+cluster)://", self.backend):
            raise ValueError(f"backend must be 'memory', a redis:// URL or redis+cluster://host:port,..., "
                             f"got {self.backend!r}")
        if self.backend.startswith("redis+cluster://"):
            parse_cluster_url(self.backend)  # ValueError for a malformed node list
            RedisKeys(self.redis_key_prefix.encode(), tagged=True)  # and for a prefix with braces
        if self.chunk_bytes <= 0 or self.chunk_bytes + MESSAGE_OVERHEAD_BYTES > self.max_message_bytes:
            raise ValueError(f"chunk_bytes {self.chunk_bytes} must be > 0 and leave {MESSAGE_OVERHEAD_BYTES} bytes "
                             f"under max_message_bytes {self.max_message_bytes}")
        if not 0 < self.low_watermark <= self.high_watermark <= 1:
            raise ValueError("need 0 < low_watermark <= high_watermark <= 1")
        if self.handoff_ttl_s <= 0 or self.lease_ttl_s <= 0 or self.max_hold_s <= 0:
            raise ValueError("handoff_ttl_s, lease_ttl_s and max_hold_s must be > 0")
        check_token(self.mesh_token)
        if self.memory_arena not in ("shm", "heap"):
            raise ValueError(f"memory_arena must be 'shm' or 'heap', got {self.memory_arena!r}")
