"""The cache service's gRPC server (`grpc.aio`): the servicer (`servicer`) over a `Store`, plus health and reflection.

Contract:
- `serve(config)` starts a server on `config.address` (port 0: a free port) and returns `(CacheServer, port)`. Health
  (`grpc.health.v1.Health`) reports SERVING for "" and `kdamesh.v1.CacheService` once it is started; reflection lists
  the cache, health and reflection services. `CacheServer.stop(grace)` reports NOT_SERVING first, lets calls in
  flight finish for `grace` seconds, then closes the store (removing a shared-memory arena). A start that fails
  (the address in use, say) closes the store it made before raising; `cli` stops the server on SIGINT, SIGTERM and
  any error, and the next start of a service killed outright removes the arena it left (`shm_arena`).
- The store is `store_factory.make_store(config, clock)` unless one is passed; `clock` (monotonic seconds) is the
  memory store's, so tests run TTLs and leases on a fake clock.
- Messages stay below `max_message_bytes` (default 4 MiB): payloads stream in `chunk_bytes` pieces (default 1 MiB).
- Data planes: `DataPlane` tells clients how they may move payloads without this hop (`describe_data_plane`): the
  Redis backend offers its URL and layout; the memory backend with its shared-memory arena (`memory_arena="shm"`,
  the default) offers the arena, which `Reserve` / `Commit` (put) and `Locate` / `Release` (get) serve; otherwise
  (or with `data_plane=False`) gRPC only. An arena that cannot be created (no such directory) leaves the service on
  heap memory, logged; an arena whose tmpfs fills up stops growing and evicts instead (see `memory_store`). Direct
  Redis traffic shows only in the store's counters.
- KV events: the service also serves `KVEventService.Subscribe` (protos/kv_events.proto, `kv_stream`): the KV
  blocks and KDA snapshots its store holds, as they are stored and dropped (`any_model` snapshots: hashes of every
  model and tenant), for the gateways' routing. The memory backend only: a Redis store evicts by itself and workers
  write it directly, neither seen here, so the call answers UNIMPLEMENTED there (gateways then count the cache
  service as holding nothing).
- Telemetry (telemetry/): every call gets a SERVER span continuing the caller's W3C `traceparent`, with the child
  spans and metrics of `servicer`; the caller's `x-request-id` is bound for the call's log lines; calls are counted
  by status in `kdamesh_cache_requests_total` and logged at DEBUG on `kdamesh.rpc`. `metrics_port` serves the
  registry on Prometheus `/metrics`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2
from opentelemetry.trace import TracerProvider
from prometheus_client import CollectorRegistry

from cache_service.config import CacheServiceConfig
from cache_service.kv_stream import KVEventPublisher, StoreEventSource, serve_subscription
from cache_service.metrics import CacheMetrics
from cache_service.servicer import CacheServicer
from cache_service.store import Store
from cache_service.store_factory import make_store
from protos import cache_pb2, cache_pb2_grpc, kv_events_pb2_grpc
from telemetry.grpc_server import start_grpc_server
from telemetry import tracing
from telemetry.metrics import MetricsServer, RpcMetrics, metrics_host, start_metrics_server
from telemetry.rpc import server_interceptors

__all__ = ["SERVICE_NAME", "CacheServer", "CacheServiceConfig", "serve"]

log = logging.getLogger(__name__)

SERVICE_NAME = cache_pb2.DESCRIPTOR.services_by_name["CacheService"].full_name


@dataclass
class CacheServer:
    """A running cache service: the gRPC server plus what it owns (store, thread pool, metrics endpoint)."""

    grpc_server: grpc.aio.Server
    port: int
    store: Store
    health: object  # the health servicer
    metrics: CacheMetrics
    executor: ThreadPoolExecutor
    metrics_http: MetricsServer | None = None  # /metrics (GET and HEAD)
    kv_events: KVEventPublisher | None = None  # None: the backend publishes no KV events

    @property
    def metrics_port(self) -> int | None:
        return None if self.metrics_http is None else self.metrics_http.port

    async def stop(self, grace: float | None = 5.0) -> None:
        """NOT_SERVING, then stop accepting calls and give those in flight `grace` seconds, then close the store."""
        await self.health.enter_graceful_shutdown()
        if self.kv_events is not None:
            await self.kv_events.stop()  # ends the event streams, which would otherwise hold the grace period
        await self.grpc_server.stop(grace)
        self.executor.shutdown(wait=False, cancel_futures=True)
        self.store.close()
        if self.metrics_http is not None:
            self.metrics_http.close()

    async def wait_for_termination(self) -> None:
        await self.grpc_server.wait_for_termination()


async def serve(config: CacheServiceConfig, *, store: Store | None = None, registry: CollectorRegistry | None = None,
                tracer_provider: TracerProvider | None = None,
                clock: Callable[[], float] = time.monotonic) -> tuple[CacheServer, int]:
    """Starts the service -> (server, bound port). `store` overrides the backend; `clock` is the memory store's
    (tests pass a fake one); `tracer_provider` None: OpenTelemetry's global provider."""
    store = store if store is not None else make_store(config, clock)
    executor = ThreadPoolExecutor(max_workers=config.store_threads, thread_name_prefix="cache-store")
    try:
        return await _start(config, store, executor, registry, tracer_provider)
    except BaseException:  # a port in use, a cancelled start: the arena must not outlive the attempt
        executor.shutdown(wait=False, cancel_futures=True)
        store.close()
        raise


async def _start(config: CacheServiceConfig, store: Store, executor: ThreadPoolExecutor,
                 registry: CollectorRegistry | None, tracer_provider: TracerProvider | None
                 ) -> tuple[CacheServer, int]:
    metrics = CacheMetrics(registry)
    metrics.watch(store)
    interceptors = server_interceptors("cache", tracer_provider=tracer_provider,
                                       metrics=RpcMetrics(metrics.registry, "cache", with_latency=False),
                                       access_log_level=logging.DEBUG)
    tracer = tracing.get_tracer("kdamesh.cache", tracer_provider)
    servicer = CacheServicer(store, config, metrics, executor, tracer)
    events = StoreEventServicer(store)

    def add_services(s: grpc.aio.Server) -> None:
        cache_pb2_grpc.add_CacheServiceServicer_to_server(servicer, s)
        kv_events_pb2_grpc.add_KVEventServiceServicer_to_server(events, s)

    server, port, health_servicer = await start_grpc_server(config.address, SERVICE_NAME, add_services,
                                                            config.max_message_bytes, interceptors,
                                                            mesh_token=config.mesh_token)
    try:
        await events.start()
    except BaseException:
        await server.stop(0)
        raise
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    metrics_http = None
    if config.metrics_port is not None:
        try:
            metrics_http = start_metrics_server(config.metrics_port, metrics_host(config.address), metrics.registry)
        except BaseException:
            await server.stop(0)
            raise
    log.info("cache service on port %d, backend %s", port, store.backend)
    return CacheServer(server, port, store, health_servicer, metrics, executor, metrics_http, events.publisher), port


class StoreEventServicer(kv_events_pb2_grpc.KVEventServiceServicer):
    """`Subscribe` to what the store holds (see the module docstring); thin: the logic is in `kv_stream`."""

    def __init__(self, store: Store):
        self.store = store
        self.publisher: KVEventPublisher | None = None

    async def start(self) -> None:
        if StoreEventSource.supported(self.store):
            self.publisher = KVEventPublisher(StoreEventSource(self.store), any_model=True)
            await self.publisher.start()

    async def Subscribe(self, request, context):
        if self.publisher is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED,
                                f"the {self.store.backend} backend publishes no KV events (it evicts by itself and "
                                "workers write it directly); count this cache service as holding nothing")
        async for message in serve_subscription(self.publisher, context):
            yield message
