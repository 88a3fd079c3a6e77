"""The worker's KV event stream (protos/kv_events.proto): what its engine's prefix cache stores and evicts.

Contract:
- The publisher is the shared `cache_service.kv_stream.KVEventPublisher` (numbering, epochs, heartbeats, snapshots,
  slow subscribers; see its contract) over the worker's `AsyncEngine` as its source: `start_cache_events` turns the
  engine's event recording on and lists the cache in one step-thread command, `take_cache_events` drains without
  waiting for the step thread, the load is the engine's as of its last step. `engine_publisher(engine, config,
  loads_remote_prefix)` builds it with the engine's model fingerprint; `loads_remote_prefix` tells the gateways
  whether this worker imports prefixes the cache service holds (worker/prefix.py).
- `KVEventServicer` serves `KVEventService.Subscribe` with the role servicer's admission checks (UNAVAILABLE while
  loading or stopping, NOT_FOUND for another model). Servicers are thin: the logic is in the publisher.
"""

from __future__ import annotations

import grpc

from cache_service.kv_stream import KVEventConfig, KVEventPublisher, serve_subscription
from engine.memory.events import CacheEventKind
from protos import kv_events_pb2, kv_events_pb2_grpc

__all__ = ["KVEventConfig", "KVEventPublisher", "KVEventServicer", "engine_publisher"]

# the engine's event kinds are streamed by number: they must be the proto's
if any(int(k) != kv_events_pb2.KVEventKind.Value(f"KV_EVENT_KIND_{k.name}") for k in CacheEventKind):
    raise RuntimeError("engine.memory.events.CacheEventKind and protos KVEventKind disagree")


def engine_publisher(engine, config: KVEventConfig, loads_remote_prefix: bool) -> KVEventPublisher:
    return KVEventPublisher(engine, config, engine.layout.fingerprint, loads_remote_prefix=loads_remote_prefix)


class KVEventServicer(kv_events_pb2_grpc.KVEventServiceServicer):
    """`Subscribe` over the role servicer's admission checks; `publisher` is set once the model is loaded."""

    def __init__(self, role_servicer):
        self.role_servicer = role_servicer
        self.publisher: KVEventPublisher | None = None

    async def Subscribe(self, request: kv_events_pb2.KVSubscribeRequest, context):
        await self.role_servicer.checked_worker(request.model, context)
        publisher = self.publisher
        if publisher is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the KV event stream is not started yet")
        async for message in serve_subscription(publisher, context):
            yield message
