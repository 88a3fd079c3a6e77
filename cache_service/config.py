"""The cache service's one configuration: `CacheServiceConfig`, checked field by field when it is built.

Its fields that a user sets carry their flag (telemetry/options.py): `cache_service.cli` and `kdamesh up` generate
their parsers from them (byte sizes as `4GiB`, `512MiB`, `2GB` or plain bytes: `telemetry.units.parse_bytes`).

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
from telemetry.options import address_option, grace_option, metrics_port_option, option
from telemetry.units import byte_size

MEMORY_ARENAS = ("shm", "heap")
MESSAGE_OVERHEAD_BYTES = 64 << 10  # room for a chunk's non-payload fields under the message limit


@dataclass(frozen=True)
class CacheServiceConfig:
    # host:port to listen on; port 0 picks a free port.
    address: str = address_option("127.0.0.1:50053")
    # "memory", a Redis URL "redis://host:port/db" (also rediss://, unix://), or a Redis Cluster
    # "redis+cluster://host:port,host:port" (seed nodes; the rest is discovered).
    backend: str = option("--cache-backend", "--backend", default="memory",
                          help="'memory', redis://host:port/db, or a Redis Cluster redis+cluster://host:port,host:port")
    # Memory backend: payload bytes kept before eviction (bytes), and the eviction watermarks (fractions of it).
    byte_budget: int = option("--byte-budget", default=1 << 30, parse=byte_size,
                              help="memory backend budget, e.g. 4GiB")
    high_watermark: float = option("--high-watermark", default=0.9, parse=float)
    low_watermark: float = option("--low-watermark", default=0.8, parse=float)
    # Default TTL of HANDOFF objects put without one (seconds); default lease duration (seconds).
    handoff_ttl_s: float = option("--handoff-ttl-s", default=30.0, parse=float)
    lease_ttl_s: float = option("--lease-ttl-s", default=30.0, parse=float)
    # Payload bytes per streamed message, and the gRPC message limit both ways (bytes).
    chunk_bytes: int = option("--chunk-bytes", default=1 << 20, parse=byte_size)
    max_message_bytes: int = option("--max-message-bytes", default=4 << 20, parse=byte_size)
    # Largest object accepted (bytes).
    max_object_bytes: int = option("--max-object-bytes", default=1 << 30, parse=byte_size)
    # Redis backend: key prefix, chunk size of stored values (bytes), payloads stored inside their manifest up to
    # this size (bytes), socket timeouts (seconds).
    redis_key_prefix: str = option("--redis-key-prefix", default="kdamesh:")
    redis_chunk_bytes: int = 1 << 20
    redis_inline_bytes: int = option("--redis-inline-bytes", default=DEFAULT_INLINE_BYTES, parse=byte_size,
                                     help="Redis backend: payloads up to this size are stored inside their manifest")
    redis_socket_timeout_s: float = 2.0
    redis_connect_timeout_s: float = 0.5
    # Offer clients a direct data plane (DataPlane RPC): the Redis backend's URL, the memory backend's arena.
    data_plane: bool = option("--no-data-plane", default=True, kind="off",
                              help="offer no direct data plane (Redis URL, shared-memory arena): payloads over gRPC "
                                   "only")
    # Memory backend: "shm" keeps payloads in a shared-memory arena of byte_budget bytes in shm_dir (its memory is
    # reserved at start; local clients copy in and out directly), prefaulted in this process with shm_populate;
    # "heap" keeps them in this process's memory (gRPC only).
    memory_arena: str = option("--memory-arena", default="shm", choices=MEMORY_ARENAS,
                               help="memory backend: payloads in a shared-memory arena local clients map (shm), or "
                                    "the heap")
    shm_dir: str = option("--shm-dir", default="/dev/shm", help="directory of the shared-memory arena (a tmpfs)")
    shm_populate: bool = True
    # Commit re-verifies each payload over the arena before publishing it (reads verify either way; see memory_store).
    verify_commits: bool = option("--verify-commits", default=False, kind="switch",
                                  help="re-verify shared-memory puts at Commit (reads always verify)")
    # Longest Reserve reservation / Locate pin granted (seconds).
    max_hold_s: float = 60.0
    # Threads running store calls; BatchPut batch size (bytes); BatchGet read-ahead (keys).
    store_threads: int = 8
    put_batch_bytes: int = 8 << 20
    get_window_keys: int = 16
    # Serve Prometheus /metrics on this port (0: a free port); None: no HTTP endpoint.
    metrics_port: int | None = metrics_port_option()
    # On SIGTERM/SIGINT: how long calls in flight get to finish (seconds; `cli.main` stops the server with it).
    shutdown_grace_s: float = grace_option()
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
        if self.memory_arena not in MEMORY_ARENAS:
            raise ValueError(f"memory_arena must be 'shm' or 'heap', got {self.memory_arena!r}")
