"""The store a `CacheServiceConfig` names, and the direct data plane that store lets clients use.

Contract:
- `make_store(config, clock)` builds the memory store (with its shared-memory arena when `memory_arena="shm"`; an
  arena that cannot be created leaves payloads in the heap, logged) or the Redis store. `clock` (monotonic seconds,
  default `time.monotonic`) is the memory store's: its TTLs (handoffs'), leases and holds run on it, so tests
  advance a fake clock instead of sleeping. A Redis store's TTLs run on Redis's own clock.
- `describe_data_plane(store, config)` is the DataPlane RPC's answer: the Redis URL and layout, the arena's path and
  token, or gRPC only with the reason.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from cache_service.config import CacheServiceConfig
from cache_service.memory_store import MemoryStore
from cache_service.redis_store import RedisStore
from cache_service.shm_arena import SharedArena
from cache_service.store import Store
from protos import cache_pb2

log = logging.getLogger(__name__)


def make_store(config: CacheServiceConfig, clock: Callable[[], float] = time.monotonic) -> Store:
    if config.backend == "memory":
        arena = _make_arena(config) if config.memory_arena == "shm" else None
        return MemoryStore(config.byte_budget, config.high_watermark, config.low_watermark, clock=clock, arena=arena,
                           verify_commits=config.verify_commits)
    return RedisStore(config.backend, chunk_bytes=config.redis_chunk_bytes, inline_bytes=config.redis_inline_bytes,
                      key_prefix=config.redis_key_prefix.encode(), socket_timeout_s=config.redis_socket_timeout_s,
                      connect_timeout_s=config.redis_connect_timeout_s)


def _make_arena(config: CacheServiceConfig) -> SharedArena | None:
    try:
        return SharedArena.create(config.byte_budget, config.shm_dir, populate=config.shm_populate)
    except OSError as exc:
        log.warning("no shared-memory arena of %d bytes in %s (%s): payloads stay in the heap, gRPC only",
                    config.byte_budget, config.shm_dir, exc)
        return None


def describe_data_plane(store: Store, config: CacheServiceConfig) -> cache_pb2.DataPlaneResponse:
    """The DataPlane answer for this store and configuration."""
    response = cache_pb2.DataPlaneResponse(max_object_bytes=config.max_object_bytes,
                                           handoff_ttl_ms=int(config.handoff_ttl_s * 1000))
    if not config.data_plane:
        response.grpc.reason = "direct data planes are disabled by configuration"
    elif isinstance(store, RedisStore):
        response.redis.CopyFrom(cache_pb2.RedisDataPlane(
            url=store.url, key_prefix=store.key_prefix, chunk_bytes=store.chunk_bytes,
            inline_bytes=store.inline_bytes, socket_timeout_ms=int(store.socket_timeout_s * 1000),
            connect_timeout_ms=int(store.connect_timeout_s * 1000)))
    elif isinstance(store, MemoryStore) and store.arena is not None:
        arena = store.arena
        response.shm.CopyFrom(cache_pb2.ShmDataPlane(path=str(arena.path), size_bytes=arena.size, token=arena.token,
                                                     token_offset=arena.token_offset))
    else:
        response.grpc.reason = f"the {store.backend} store here has no direct data plane"
    return response
