"""The lifecycle the prefill and decode services share: a gRPC server whose model loads in the background.

Contract:
- `start_worker_server(server_cls, servicer_cls, config, add_servicer, registry, tracer_provider)` makes the role's
  `WorkerMetrics` (in `registry`; None: a new one) and servicer, binds `config.address` (port 0: a free port) with
  standard health (NOT_SERVING for "" and the service until the model is loaded) and reflection (calls to anything
  else need `config.mesh_token` when it is set: `telemetry.mesh_auth`), starts the side
  `/metrics` server when `config.metrics_port` is set, begins loading the model and returns `(server, port)` at
  once. `await server.ready()` waits for the load and raises what it raised.
- Loading (`WorkerServer._load`): `config.torch_threads` set, the `AsyncEngine` created (ids only:
  `detokenize=False`, the gateway detokenises and matches stop strings once for the mesh) and warmed up (its grammar
  backend built, so the first structured request does not import xgrammar), a `CacheClient` opened when
  `config.cache_address` is set (trace context and `config.mesh_token` on its calls), the role's worker built
  (`make_worker`), the KV event stream started (worker/kv_events.py, `config.kv_events`), then SERVING.
- Every worker also serves `KVEventService` (protos/kv_events.proto): the gateway's view of its prefix cache, and
  `WorkerInfoService` (protos/worker.proto, worker/info.py): its engine's context length, block size, speculation
  and parallel layout, set once the model is loaded, and `MetricsService` (protos/metrics.proto): its registry,
  which the gateway re-exposes on its own /metrics.
  Health is served on the gRPC event loop, never behind the step thread, and nothing heavy runs on that loop or on
  the step thread (a request's structured-output spec is decoded on a thread, worker/servicer.py `decode_job`; its
  grammar and images are prepared off the step thread by `AsyncEngine`), so a worker busy stepping answers in time.
  Health turns NOT_SERVING when the engine fails (`AsyncEngine.is_healthy`: its step loop died or, under tensor
  parallelism, a rank process is gone; checked every `ENGINE_WATCH_S`).
- `stop(grace)`: NOT_SERVING first, new calls refused (`servicer.stopping`), a load in progress cancelled, the KV
  event streams ended, running
  calls drained (`drain_calls`, per role), then the worker, the engine, the cache client and `/metrics` closed.
- The engine gauges (`engine_gauges`: the `EngineStats` the step thread published last, so a scrape never waits
  for a step; they feed the engine-level `vllm:` series too, labelled `config.model_name`) and the worker's
  counters are exported through `servicer.metrics` while a worker exists;
  `transfer_samples(op, bytes, seconds)` are the two counters every role keeps per kind of cache-service transfer,
  `offload_samples(counters)` the snapshot offloads both roles count (worker/offload.py).
"""

from __future__ import annotations

import dataclasses

import asyncio
import logging
import time
from collections.abc import Callable

import grpc
from grpc_health.v1 import health, health_pb2
from opentelemetry.trace import TracerProvider
from prometheus_client import CollectorRegistry

from cache_service.client import CacheClient
from engine.async_engine import AsyncEngine
from telemetry import mesh_auth
from telemetry.grpc_server import start_grpc_server
from telemetry.metrics import (CounterSample, EngineGauges, MetricsServer, WorkerMetrics, metrics_host,
                               start_metrics_server)
from telemetry.rpc import client_interceptors, server_interceptors
from protos import kv_events_pb2_grpc, metrics_pb2_grpc, worker_pb2_grpc
from worker.info import MetricsServicer, WorkerInfoServicer, worker_info
from worker.kv_events import KVEventPublisher, KVEventServicer, engine_publisher
from worker.prefix import PrefixCounters

log = logging.getLogger(__name__)
ENGINE_WATCH_S = 0.25  # how often a loaded worker checks that its engine (and its rank processes) still run


def engine_gauges(engine: AsyncEngine) -> EngineGauges:
    """The engine's scheduler and pools as of its latest step (published by the step thread; no waiting)."""
    stats = engine.stats_snapshot()
    phases = stats.phase_times  # the request phase histograms (engine.phase_times)
    return EngineGauges(running=stats.num_running, waiting=stats.num_waiting, kv_blocks_total=stats.num_blocks,
                        kv_blocks_free=stats.num_free_blocks, kv_blocks_cached=stats.num_cached_blocks,
                        kv_usage=stats.kv_usage, state_groups_total=stats.num_state_groups,
                        state_groups_free=stats.num_free_state_groups, snapshots=stats.num_snapshots,
                        snapshot_slots=stats.num_snapshot_slots, prefix_lookup_tokens=stats.prefix_lookup_tokens,
                        prefix_hit_tokens=stats.prefix_hit_tokens, preemptions=stats.num_preemptions,
                        queue_time=phases.queue if phases else None, prefill_time=phases.prefill if phases else None,
                        decode_time=phases.decode if phases else None,
                        inference_time=phases.inference if phases else None,
                        iteration_tokens=phases.iteration_tokens if phases else None,
                        cache_config=cache_config(engine, stats.num_blocks), spec_num_drafts=stats.spec_num_drafts,
                        spec_num_draft_tokens=stats.spec_num_draft_tokens,
                        spec_num_accepted_tokens=stats.spec_num_accepted_tokens,
                        spec_accepted_per_pos=stats.spec_accepted_per_pos,
                        fair_preemptions=stats.num_fair_preemptions,
                        tenants=tuple((t.tenant, t.running, t.waiting, t.weight) for t in stats.tenants))


def cache_config(engine: AsyncEngine, num_blocks: int) -> tuple[tuple[str, str], ...]:
    """vllm:cache_config_info's labels: the KV cache's configuration (fixed at start-up)."""
    args = engine.core.args
    return (("block_size", str(engine.layout.block_size)), ("cache_dtype", str(args.dtype)),
            ("enable_prefix_caching", str(bool(args.enable_prefix_caching))), ("num_gpu_blocks", str(num_blocks)),
            ("num_cpu_blocks", "0"))


def transfer_samples(op: str, nbytes: int, seconds: float) -> list[CounterSample]:
    """`transfer_bytes_total{op}` and `transfer_seconds_total{op}` of one kind of transfer to or from the cache."""
    labels = (("op", op),)
    return [CounterSample("transfer_bytes", "Payload bytes moved to or from the cache service", nbytes, labels),
            CounterSample("transfer_seconds", "Wall time of the cache service calls that moved them (seconds)",
                          seconds, labels)]


def offload_samples(c: PrefixCounters) -> list[CounterSample]:
    """The offloads of snapshots the engine let go (worker/offload.py), as counters."""
    return [*transfer_samples("snapshot_offload", c.offload_bytes, c.offload_seconds),
            CounterSample("offloaded_snapshots", "KDA snapshots the engine evicted (or a finished turn's end), stored "
                          "in the cache service", c.offloaded_snapshots),
            CounterSample("offloaded_blocks", "KV blocks stored with offloaded snapshots", c.offloaded_blocks),
            CounterSample("offload_failures", "Snapshot offloads dropped, refused or failed", c.offload_failures)]


class WorkerServer:
    """A running worker service: the gRPC server, its health servicer and (once loaded) the engine and worker.

    Subclasses name their `role` and `service_name`, build their worker in `make_worker` and export its counters
    in `worker_counters`; `drain_calls` may wait for running calls more gently than stopping the server."""

    role = ""  # "prefill" | "decode"
    service_name = ""  # the full gRPC service name health reports on
    with_tpot = False  # whether the role's serving metrics have time per output token

    def __init__(self, config, grpc_server: grpc.aio.Server, port: int, health_servicer: health.aio.HealthServicer,
                 servicer, tracer_provider: TracerProvider | None = None):
        self.config = config
        self.grpc_server = grpc_server
        self.port = port
        self.health = health_servicer
        self.servicer = servicer
        self.metrics = servicer.metrics
        self.tracer_provider = tracer_provider
        self.engine: AsyncEngine | None = None
        self.cache: CacheClient | None = None
        self.metrics_http: MetricsServer | None = None
        self.kv_event_servicer: KVEventServicer | None = None  # set by `start_worker_server`
        self.info_servicer: WorkerInfoServicer | None = None  # set by `start_worker_server`
        self.kv_events: KVEventPublisher | None = None  # once loaded
        self._loading: asyncio.Task | None = None
        self._watch: asyncio.Task | None = None  # health follows the engine (`_watch_engine`)
        self.metrics.watch_engine(lambda: engine_gauges(self.engine) if self.worker is not None else None)
        self.metrics.watch_counters(lambda: self.worker_counters(self.worker) if self.worker is not None else [])

    # -- per role ------------------------------------------------------------------------------------------------

    def make_worker(self):
        raise NotImplementedError

    def worker_counters(self, worker) -> list[CounterSample]:
        return []

    async def drain_calls(self, grace: float) -> None:
        await self.grpc_server.stop(grace)

    # -- shared --------------------------------------------------------------------------------------------------

    @property
    def metrics_port(self) -> int | None:
        return None if self.metrics_http is None else self.metrics_http.port

    @property
    def worker(self):
        return self.servicer.worker

    async def _load(self) -> None:
        if self.config.torch_threads:
            import torch

            torch.set_num_threads(self.config.torch_threads)
        t0 = time.perf_counter()
        # The gateway detokenises and matches stop strings for the mesh: the step thread streams ids only.
        self.engine = await AsyncEngine.create(dataclasses.replace(self.config.engine, detokenize=False))
        await self.engine.warm_up()  # the grammar backend, off the step thread, before SERVING
        if self.config.cache_address:
            self.cache = CacheClient(self.config.cache_address, timeout_s=self.config.cache_timeout_s,
                                     max_message_bytes=self.config.max_message_bytes,
                                     interceptors=[*client_interceptors(self.tracer_provider),
                                                   *mesh_auth.client_interceptors(self.config.mesh_token)])
        self.servicer.worker = self.make_worker()
        prefix = getattr(self.servicer.worker, "prefix", None)  # worker/prefix.py RemotePrefix, None: no cache
        self.kv_events = engine_publisher(self.engine, self.config.kv_events,
                                          loads_remote_prefix=prefix is not None and prefix.enabled)
        await self.kv_events.start()
        self.kv_event_servicer.publisher = self.kv_events
        self.info_servicer.info = worker_info(self.engine, self.role, self.config.model_name)
        for name in ("", self.service_name):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        log.info("%s worker ready: model %s loaded in %.1f s", self.role, self.config.model_name,
                 time.perf_counter() - t0)
        self._watch = asyncio.create_task(self._watch_engine())

    async def _watch_engine(self) -> None:
        """NOT_SERVING once the engine fails (its step loop died, or a tensor-parallel rank is gone)."""
        while self.engine.is_healthy:
            await asyncio.sleep(ENGINE_WATCH_S)
        log.error("%s worker: the engine failed; reporting NOT_SERVING", self.role)
        for name in ("", self.service_name):
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)

    async def ready(self) -> None:
        """Waits until the model is loaded; raises what loading raised."""
        await asyncio.shield(self._loading)

    async def stop(self, grace: float | None = 5.0) -> None:
        """Drains and closes everything (see the module docstring); `grace` None or 0: at once."""
        await self.health.enter_graceful_shutdown()  # NOT_SERVING first
        self.servicer.stopping = True  # new calls: UNAVAILABLE
        if self._loading is not None and not self._loading.done():
            self._loading.cancel()
        if self._watch is not None:
            self._watch.cancel()
        if self.kv_events is not None:
            await self.kv_events.stop()  # ends the event streams, which would otherwise hold the drain
        await self.drain_calls(grace or 0.0)
        if self.worker is not None:
            await self.worker.drain()
        if self.engine is not None:
            await self.engine.shutdown()
        if self.cache is not None:
            await self.cache.close()
        if self.metrics_http is not None:
            self.metrics_http.close()

    async def wait_for_termination(self) -> None:
        await self.grpc_server.wait_for_termination()


async def start_worker_server(server_cls: type[WorkerServer], servicer_cls: type, config,
                              add_servicer: Callable[[object, grpc.aio.Server], None],
                              registry: CollectorRegistry | None = None,
                              tracer_provider: TracerProvider | None = None) -> tuple[WorkerServer, int]:
    """Starts the server and begins loading the model -> (server, bound port). `add_servicer` is the generated
    `add_<Service>Servicer_to_server`."""
    metrics = WorkerMetrics(registry if registry is not None else CollectorRegistry(), server_cls.role,
                            with_tpot=server_cls.with_tpot, model_name=config.model_name)
    servicer = servicer_cls(config, metrics)
    kv_event_servicer = KVEventServicer(servicer)
    info_servicer = WorkerInfoServicer(servicer)

    def add_servicers(grpc_server: grpc.aio.Server) -> None:
        add_servicer(servicer, grpc_server)
        kv_events_pb2_grpc.add_KVEventServiceServicer_to_server(kv_event_servicer, grpc_server)
        worker_pb2_grpc.add_WorkerInfoServiceServicer_to_server(info_servicer, grpc_server)
        metrics_pb2_grpc.add_MetricsServiceServicer_to_server(MetricsServicer(metrics.registry), grpc_server)

    grpc_server, port, health_servicer = await start_grpc_server(
        config.address, server_cls.service_name, add_servicers, config.max_message_bytes,
        server_interceptors(server_cls.role, tracer_provider=tracer_provider, metrics=metrics.rpc),
        mesh_token=config.mesh_token)
    server = server_cls(config, grpc_server, port, health_servicer, servicer, tracer_provider)
    server.kv_event_servicer = kv_event_servicer
    server.info_servicer = info_servicer
    if config.metrics_port is not None:
        server.metrics_http = start_metrics_server(config.metrics_port, metrics_host(config.address),
                                                   metrics.registry)
    server._loading = asyncio.create_task(server._load())
    server._loading.add_done_callback(lambda task: _log_load_failure(server_cls.role, task))
    log.info("%s service on port %d (loading %s)", server_cls.role, port, config.engine.model)
    return server, port


def _log_load_failure(role: str, task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("%s worker failed to load its model: %r", role, task.exception())
