"""The worker's `WorkerInfoService` (protos/worker.proto): the facts of its engine the gateway must not recompute.

Contract:
- `worker_info(engine, role, model_name)` reads what is fixed when the engine started: the context length its
  cache plan allows (`CachePlan.max_model_len`, the limit `EngineCore` checks every prompt against), the KV block
  size, the speculative method and k (`EngineArgs.speculative_config`), the tensor-parallel size and expert
  parallelism. Nothing waits for the step thread.
- `WorkerInfoServicer(role_servicer)` serves `Info` with the role servicer's admission checks (UNAVAILABLE while
  loading or stopping, NOT_FOUND for another model); `info` is set once the model is loaded.
- `MetricsServicer(registry)` serves `MetricsService.Scrape` (protos/metrics.proto): the worker's registry as its
  side /metrics renders it, from start-up on (no admission check: a loading worker reports `model_loaded 0`), so the
  gateway shows the workers' series on its own /metrics (gateway/worker_metrics.py).
"""

from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry

from protos import metrics_pb2, metrics_pb2_grpc, worker_pb2, worker_pb2_grpc
from telemetry.metrics import render


def worker_info(engine, role: str, model_name: str) -> worker_pb2.WorkerInfo:
    """`engine` is the worker's `AsyncEngine`; only start-up facts of its core are read."""
    args, plan = engine.core.args, engine.core.plan
    spec = args.speculative_config  # a parsed SpeculativeConfig or None (engine/config.py)
    return worker_pb2.WorkerInfo(role=role, model=model_name, max_model_len=plan.max_model_len,
                                 block_size=engine.layout.block_size,
                                 speculative_method=spec.method if spec is not None else "",
                                 num_speculative_tokens=spec.num_speculative_tokens if spec is not None else 0,
                                 tensor_parallel_size=args.tensor_parallel_size,
                                 expert_parallel=args.enable_expert_parallel)


class WorkerInfoServicer(worker_pb2_grpc.WorkerInfoServiceServicer):
    """`Info` over the role servicer's admission checks; `info` is set once the model is loaded."""

    def __init__(self, role_servicer):
        self.role_servicer = role_servicer
        self.info: worker_pb2.WorkerInfo | None = None

    async def Info(self, request: worker_pb2.WorkerInfoRequest, context) -> worker_pb2.WorkerInfo:
        await self.role_servicer.checked_worker(request.model, context)
        return self.info


class MetricsServicer(metrics_pb2_grpc.MetricsServiceServicer):
    """`Scrape`: the registry in the Prometheus text format (collected on a thread: collectors read engine stats)."""

    def __init__(self, registry: CollectorRegistry):
        self.registry = registry

    async def Scrape(self, request: metrics_pb2.ScrapeRequest, context) -> metrics_pb2.ScrapeResponse:
        body, _ = await asyncio.to_thread(render, self.registry)
        return metrics_pb2.ScrapeResponse(text=body)
