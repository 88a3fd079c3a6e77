"""The decode service's gRPC server (`grpc.aio`): a thin `DecodeService` servicer over `DecodeWorker`.

Contract:
- Its options are `DecodeServiceConfig` (decode_service/config.py), whose fields carry their flags.
- `serve(config)` binds `config.address` (port 0: a free port), starts the server with standard health
  (NOT_SERVING for "" and `kdamesh.v1.DecodeService` until the model is loaded, then SERVING) and reflection, then
  loads the model in the background; it returns `(DecodeServer, port)` at once. `await server.ready()` waits for it.
- `Decode` streams `DecodeChunk`s (see protos/decode.proto): every completion token, the last chunk of each choice
  with its finish reason, usage and `used_handoff` on the last chunk of the stream. Cancelling the call or passing
  its deadline aborts the engine request (its blocks and state slot are freed).
- `Probe` answers the local prefix-cache hit and the load, between two engine steps (at most the step in progress
  delays it).
- Errors are statuses with messages: INVALID_ARGUMENT (bad request), NOT_FOUND (another model),
  UNAVAILABLE (loading, stopping, engine dead, or the handoff unusable under `--kv-load-failure-policy fail`),
  DEADLINE_EXCEEDED.
- Graceful drain, `DecodeServer.stop(grace)` (what SIGTERM runs): health reports NOT_SERVING first; then new Decode
  and Probe calls fail UNAVAILABLE ("draining") while the listener stays open; running Decode streams get `grace`
  seconds to finish normally; streams still running then are aborted in the engine and end with UNAVAILABLE after
  the tokens already sent (a clean error, never a hang); only then does the gRPC server stop, the engine shut down
  and the cache client close.
- Telemetry (telemetry/): each call gets a SERVER span continuing the caller's `traceparent` (the worker adds
  `decode` and `handoff.claim` spans; cache calls carry the trace and request id on), the caller's `x-request-id`
  (else the request's own id) is bound for log lines, one access line per call on `kdamesh.rpc`. Metrics
  (`kdamesh_decode_*`, telemetry/metrics.py) go to the registry passed to `serve` and, with `metrics_port`, to a side
  HTTP `/metrics` server.
"""

from __future__ import annotations

import asyncio
import logging

import grpc

from opentelemetry.trace import TracerProvider
from prometheus_client import CollectorRegistry

from decode_service.worker import (DecodeWorker, Handoff,
                                   HandoffUnavailableError)
from engine.errors import InvalidRequestError
from decode_service.config import DecodeServiceConfig  # noqa: F401 (re-exported)
from protos import common_pb2, decode_pb2, decode_pb2_grpc
from telemetry import tracing
from telemetry.metrics import CounterSample, RequestTimer, WorkerMetrics
from worker.server import WorkerServer, offload_samples, start_worker_server, transfer_samples
from worker.servicer import ENGINE_ERROR_STATUSES, WorkerServicer, decode_job

log = logging.getLogger(__name__)

SERVICE_NAME = decode_pb2.DESCRIPTOR.services_by_name["DecodeService"].full_name
ABORT_WAIT_S = 2.0  # after the grace period: how long aborted streams get to end before the server cancels them
DRAINING = "decode worker is draining (shutting down) and takes no new requests; send this one to another worker"


def handoff_from_proto(request: decode_pb2.DecodeRequest) -> Handoff | None:
    """The request's handoff (None: the local path); InvalidRequestError when it names no source."""
    source = request.WhichOneof("source")
    if source == "local":
        return None
    if source != "handoff":
        raise InvalidRequestError("a decode request needs a handoff or a local prompt", param="source")
    h = request.handoff
    return Handoff(key=h.handoff_key, first_token_id=h.first_token_id,
                   first_token_logprob=h.first_token_logprob if h.HasField("first_token_logprob") else None,
                   cached_tokens=h.cached_tokens)


# -- the servicer ----------------------------------------------------------------------------------------------


class DecodeServicer(WorkerServicer, decode_pb2_grpc.DecodeServiceServicer):
    """`worker` (a `DecodeWorker`) is set once the model is loaded; while draining, new calls are refused."""

    role = "decode"
    stopping_message = DRAINING
    error_statuses = ENGINE_ERROR_STATUSES + ((HandoffUnavailableError, grpc.StatusCode.UNAVAILABLE),)

    def __init__(self, config: DecodeServiceConfig, metrics: WorkerMetrics):
        super().__init__(config, metrics)
        self._running: dict[object, str] = {}  # Decode calls in progress -> their request ids
        self._aborted: set[object] = set()  # calls aborted because the grace period passed
        self._idle = asyncio.Event()
        self._idle.set()

    async def Decode(self, request: decode_pb2.DecodeRequest, context):
        timer = RequestTimer()
        worker: DecodeWorker = await self.admit(request.generation, context)
        call, last, handoff = object(), None, None
        self._enter(call, request.generation.request_id)
        try:
            handoff = handoff_from_proto(request)
            job = await decode_job(request, context)
            async for chunk in worker.decode(job, handoff):
                if chunk.finish_reason == common_pb2.FINISH_REASON_ABORT and call in self._aborted:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "decode worker shut down before this request "
                                        "finished (its drain grace period passed)")
                timer.add_tokens(len(chunk.token_ids))
                last = chunk
                yield chunk
        except self.handled_errors as exc:
            await self.fail(context, exc)
        finally:
            self._leave(call)
        if last is not None and last.HasField("usage"):
            u = last.usage
            path = "local" if handoff is None else ("handoff" if last.used_handoff else "recompute")
            self.metrics.serving.observe(timer, (path,), prompt_tokens=u.prompt_tokens,
                                         completion_tokens=u.completion_tokens, cached_tokens=u.cached_tokens)

    # -- drain ---------------------------------------------------------------------------------------------------

    def _enter(self, call: object, request_id: str) -> None:
        self._running[call] = request_id
        self._idle.clear()

    def _leave(self, call: object) -> None:
        self._running.pop(call, None)
        self._aborted.discard(call)
        if not self._running:
            self._idle.set()

    async def wait_idle(self, timeout_s: float) -> bool:
        """Waits until no Decode call runs -> True, or False when `timeout_s` passes first."""
        try:
            async with asyncio.timeout(max(timeout_s, 0.0)):
                await self._idle.wait()
        except TimeoutError:
            return False
        return True

    async def abort_running(self) -> int:
        """Aborts the engine requests of the running Decode calls (each ends with UNAVAILABLE) -> how many."""
        calls = list(self._running.items())
        self._aborted.update(call for call, _ in calls)
        if self.worker is not None:
            for _, request_id in calls:
                try:
                    await self.worker.engine.abort(request_id)
                except Exception as exc:  # noqa: BLE001 - best effort: the server cancels what is left
                    log.warning("could not abort %s while draining: %r", request_id, exc)
        return len(calls)

    async def Probe(self, request: decode_pb2.ProbeRequest, context) -> decode_pb2.ProbeResponse:
        worker: DecodeWorker = await self.checked_worker(request.model, context)
        try:
            cached, running, waiting, usage = await worker.probe(list(request.prompt.ids), request.tenant_salt)
        except self.handled_errors as exc:
            await self.fail(context, exc)
        return decode_pb2.ProbeResponse(cached_tokens=cached, running=running, waiting=waiting, kv_usage=usage)


# -- metrics read at scrape time ---------------------------------------------------------------------------------


def worker_counters(worker: DecodeWorker) -> list[CounterSample]:
    c = worker.counters
    samples = [
        *transfer_samples("handoff_load", c.handoff_bytes, c.handoff_seconds),
        CounterSample("handoffs", "Decode requests by how their handoff went", c.handoff_loaded,
                      (("outcome", "loaded"),)),
        CounterSample("handoffs", "Decode requests by how their handoff went", c.handoff_failures,
                      (("outcome", "failed"),)),
        CounterSample("recomputed_prompts", "Prompts computed here because their handoff was unusable", c.recomputed),
        CounterSample("handoff_streamed_groups", "Block groups of handoffs written into the engine ahead of a lean "
                      "import, the next one being read", c.handoff_groups),
        CounterSample("handoff_local_blocks", "Full blocks of loaded handoffs taken from this worker's prefix cache "
                      "instead of the cache service", c.handoff_local_blocks),
        CounterSample("local_requests", "Requests prefilled here (colocated)", c.local_requests),
        *transfer_samples("prefix_load", c.remote_load_bytes, c.remote_load_seconds),
        CounterSample("remote_prefix_loads", "Prefixes loaded from the cache service", c.remote_loads),
        CounterSample("remote_prefix_load_tokens", "Prompt tokens of the prefixes loaded from the cache service",
                      c.remote_load_tokens),
        CounterSample("remote_prefix_load_failures", "Cache lookups or prefix loads that failed (computed instead)",
                      c.remote_load_failures),
        *offload_samples(c)]
    samples += [CounterSample("handoff_failures", "Unusable handoffs by reason", n, (("reason", reason),))
                for reason, n in sorted(dict(c.failure_reasons).items())]  # a copy: the loop thread may add one
    return samples


# -- lifecycle ---------------------------------------------------------------------------------------------------


class DecodeServer(WorkerServer):
    """A running decode service (lifecycle: worker/server.py); `stop` drains streams as described above."""

    role = "decode"
    service_name = SERVICE_NAME
    with_tpot = True

    def make_worker(self) -> DecodeWorker:
        return DecodeWorker(self.engine, self.cache, kv_load_failure_policy=self.config.kv_load_failure_policy,
                            load_remote_prefix=self.config.load_remote_prefix,
                            tracer=tracing.get_tracer("kdamesh.decode", self.tracer_provider),
                            handoff_fetch_bytes=self.config.handoff_fetch_bytes,
                            handoff_part_wait_s=self.config.handoff_part_wait_s)

    def worker_counters(self, worker: DecodeWorker) -> list[CounterSample]:
        return worker_counters(worker)

    async def drain_calls(self, grace: float) -> None:
        if not await self.servicer.wait_idle(grace):
            aborted = await self.servicer.abort_running()
            log.warning("decode worker draining: %d stream(s) still running after the %.1f s grace period were "
                        "aborted", aborted, grace)
            await self.servicer.wait_idle(ABORT_WAIT_S)
        await self.grpc_server.stop(min(grace, 1.0))  # what is left (health watches, a stuck call) is cancelled


async def serve(config: DecodeServiceConfig, *, registry: CollectorRegistry | None = None,
                tracer_provider: TracerProvider | None = None) -> tuple[DecodeServer, int]:
    """Starts the server and begins loading the model -> (server, bound port). Metrics go to `registry` (None: a
    new one, `server.metrics.registry`); spans to `tracer_provider` (None: OpenTelemetry's global provider)."""
    add = decode_pb2_grpc.add_DecodeServiceServicer_to_server
    return await start_worker_server(DecodeServer, DecodeServicer, config, add, registry, tracer_provider)
