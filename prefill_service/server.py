"""The prefill service's gRPC server (`grpc.aio`): a thin `PrefillService` servicer over `PrefillWorker`.

Contract:
- Its options are `PrefillServiceConfig` (prefill_service/config.py), whose fields carry their flags.
- `serve(config)` binds `config.address` (port 0: a free port), starts the server with standard health
  (`grpc.health.v1.Health`: NOT_SERVING for "" and `kdamesh.v1.PrefillService` until the model is loaded, then
  SERVING) and reflection, then loads the model in the background; it returns `(PrefillServer, port)` at once.
  `await server.ready()` waits for the model (and raises what loading raised).
- Calls before the model is loaded, or while stopping, fail UNAVAILABLE. The call deadline becomes the engine
  request's deadline; a cancelled call aborts the request and publishes no handoff.
- Errors are statuses with messages: INVALID_ARGUMENT (bad prompt or sampling parameters, n > 1, a prompt plus
  max_tokens beyond the context), NOT_FOUND (another model), UNAVAILABLE (loading, stopping,
  the handoff could not be stored, the engine died), DEADLINE_EXCEEDED, ABORTED.
- `PrefillServer.stop(grace)` reports NOT_SERVING, stops accepting calls, gives calls in flight `grace` seconds, waits
  for background snapshot publications, then stops the engine and closes the cache client.
- Telemetry (telemetry/): each call gets a SERVER span continuing the caller's `traceparent` (the worker adds
  `prefill`, `prefix.*` and `handoff.publish` spans; cache calls carry the trace and the request id on), the caller's
  `x-request-id` (else the request's own id) is bound for log lines, one access line per call on `kdamesh.rpc`.
  Metrics (`kdamesh_prefill_*`, telemetry/metrics.py) go to the registry passed to `serve` and, with
  `metrics_port`, to a side HTTP `/metrics` server.
"""

from __future__ import annotations

import logging

import grpc

from opentelemetry.trace import TracerProvider
from prometheus_client import CollectorRegistry

from engine.sampling import SamplingParams
from prefill_service.worker import (HandoffPublishError, PrefillAbortedError, PrefillResult,
                                    PrefillWorker)
from prefill_service.config import PrefillServiceConfig  # noqa: F401 (re-exported)
from protos import prefill_pb2, prefill_pb2_grpc
from telemetry import tracing
from telemetry.metrics import CounterSample, RequestTimer
from worker.codec import FINISH_REASONS, logprob_to_proto, prompt_logprobs_to_proto
from worker.server import WorkerServer, offload_samples, start_worker_server, transfer_samples
from worker.servicer import ENGINE_ERROR_STATUSES, WorkerServicer, decode_job

log = logging.getLogger(__name__)

SERVICE_NAME = prefill_pb2.DESCRIPTOR.services_by_name["PrefillService"].full_name


def response_to_proto(result: PrefillResult, params: SamplingParams) -> prefill_pb2.PrefillResponse:
    t = result.timings
    response = prefill_pb2.PrefillResponse(
        request_id=result.request_id, first_token_id=result.first_token_id,
        finish_reason=FINISH_REASONS[result.finish_reason], prompt_tokens=result.prompt_tokens,
        cached_tokens=result.cached_tokens, handoff_bytes=result.handoff_bytes,
        published_blocks=result.published_blocks,
        timings=prefill_pb2.PrefillTimings(load_ms=t.load_ms, compute_ms=t.compute_ms, publish_ms=t.publish_ms,
                                           total_ms=t.total_ms))
    if result.handoff_key is not None:
        response.handoff_key.CopyFrom(result.handoff_key)
    if result.first_token_logprobs is not None:
        response.first_token_logprob.CopyFrom(
            logprob_to_proto(result.first_token_logprobs, result.first_token_id, params.logprobs or 0))
    response.prompt_logprobs.extend(prompt_logprobs_to_proto(result.prompt_logprobs, result.prompt_token_ids,
                                                             params.prompt_logprobs or 0))
    return response


# -- the servicer ----------------------------------------------------------------------------------------------


class PrefillServicer(WorkerServicer, prefill_pb2_grpc.PrefillServiceServicer):
    """`worker` (a `PrefillWorker`) is set once the model is loaded."""

    role = "prefill"
    stopping_message = "prefill worker is stopping and takes no new requests"
    error_statuses = ENGINE_ERROR_STATUSES + ((HandoffPublishError, grpc.StatusCode.UNAVAILABLE),
                                              (PrefillAbortedError, grpc.StatusCode.ABORTED))

    async def Prefill(self, request: prefill_pb2.PrefillRequest, context) -> prefill_pb2.PrefillResponse:
        timer = RequestTimer()
        worker: PrefillWorker = await self.admit(request.generation, context)
        try:
            job = await decode_job(request, context)
            params = job.params
            result = await worker.prefill(job, request.handoff_ttl_ms / 1000 if request.handoff_ttl_ms else None)
        except self.handled_errors as exc:
            await self.fail(context, exc)
        timer.add_tokens(1)
        self.metrics.serving.observe(timer, ("prefill",), prompt_tokens=result.prompt_tokens, completion_tokens=1,
                                     cached_tokens=result.cached_tokens)
        return response_to_proto(result, params)


# -- metrics read at scrape time -------------------------------------------------------------------------------


def worker_counters(worker: PrefillWorker) -> list[CounterSample]:
    c = worker.counters
    return [*transfer_samples("publish", c.published_bytes, c.publish_seconds),
            *transfer_samples("prefix_load", c.remote_load_bytes, c.remote_load_seconds),
            CounterSample("remote_prefix_loads", "Prefixes loaded from the cache service", c.remote_loads),
            CounterSample("remote_prefix_load_tokens", "Prompt tokens of the prefixes loaded from the cache service",
                          c.remote_load_tokens),
            CounterSample("remote_prefix_load_failures", "Cache lookups or prefix loads that failed (computed instead)",
                          c.remote_load_failures),
            CounterSample("published_blocks", "KV blocks stored in the cache service", c.published_blocks),
            CounterSample("published_snapshots", "KDA state snapshots stored in the cache service",
                          c.published_snapshots),
            CounterSample("publish_failures", "Objects the cache service did not store", c.publish_failures),
            *offload_samples(c)]


# -- lifecycle ---------------------------------------------------------------------------------------------------


class PrefillServer(WorkerServer):
    """A running prefill service (lifecycle: worker/server.py)."""

    role = "prefill"
    service_name = SERVICE_NAME
    with_tpot = False

    def make_worker(self) -> PrefillWorker:
        return PrefillWorker(self.engine, self.cache, handoff_full_kv=self.config.handoff_full_kv,
                             handoff_part_bytes=self.config.handoff_part_bytes,
                             load_remote_prefix=self.config.load_remote_prefix,
                             tracer=tracing.get_tracer("kdamesh.prefill", self.tracer_provider))

    def worker_counters(self, worker: PrefillWorker) -> list[CounterSample]:
        return worker_counters(worker)


async def serve(config: PrefillServiceConfig, *, registry: CollectorRegistry | None = None,
                tracer_provider: TracerProvider | None = None) -> tuple[PrefillServer, int]:
    """Starts the server and begins loading the model -> (server, bound port). Metrics go to `registry` (None: a
    new one, `server.metrics.registry`); spans to `tracer_provider` (None: OpenTelemetry's global provider)."""
    add = prefill_pb2_grpc.add_PrefillServiceServicer_to_server
    return await start_worker_server(PrefillServer, PrefillServicer, config, add, registry, tracer_provider)
