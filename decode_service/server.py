"""The decode service's gRPC server (`grpc.aio`): a thin `DecodeService` servicer over `DecodeWorker`.

Contract:
- `serve(config)` binds `config.address` (port 0: a free port), starts the server with standard health
  (NOT_SERVING for "" and `kdamesh.v1.DecodeService` until the model is loaded, then SERVING) and reflection, then
  loads the model in the background; it returns `(DecodeServer, port)` at once. `await server.ready()` waits for it.
- `Decode` streams `DecodeChunk`s (see protos/decode.proto): every completion token, the last chunk of each choice
  with its finish reason, usage and `used_handoff` on the last chunk of the stream. Cancelling the call or passing
  its deadline aborts the engine request (its blocks and state slot are freed).
- `Probe` answers the local prefix-cache hit and the load without waiting for the engine's step loop.
- Errors are statuses with messages: INVALID_ARGUMENT (bad request), NOT_FOUND (another model), UNIMPLEMENTED
  (media), UNAVAILABLE (loading, stopping, engine dead, or the handoff unusable under `--kv-load-failure-policy fail`),
  DEADLINE_EXCEEDED.
- `DecodeServer.stop(grace)` reports NOT_SERVING, stops accepting calls and gives running streams `grace` seconds,
  then stops the engine and closes the cache client.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from cache_service.client import CacheClient
from decode_service.worker import (KV_LOAD_FAILURE_POLICIES, DecodeJob, DecodeWorker, Handoff,
                                   HandoffUnavailableError, TokenBatch)
from engine.async_engine import AsyncEngine
from engine.config import EngineArgs
from engine.errors import EngineDeadError, InvalidRequestError, RequestTimeoutError
from engine.outputs import PositionLogprobs
from engine.sampling import SamplingParams
from protos import common_pb2, decode_pb2, decode_pb2_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = decode_pb2.DESCRIPTOR.services_by_name["DecodeService"].full_name
FINISH_REASONS = {None: common_pb2.FINISH_REASON_UNSPECIFIED, "stop": common_pb2.FINISH_REASON_STOP,
                  "length": common_pb2.FINISH_REASON_LENGTH, "abort": common_pb2.FINISH_REASON_ABORT}


@dataclass(frozen=True)
class DecodeServiceConfig:
    engine: EngineArgs
    # host:port of the cache service handoffs come from; None: every handoff is unusable (local prefill only).
    cache_address: str | None = None
    # host:port to listen on; port 0 picks a free port.
    address: str = "127.0.0.1:50054"
    # Name clients use for the model; None: the model folder's name.
    served_model_name: str | None = None
    # What to do when a handoff cannot be loaded: "recompute" the prompt here, or "fail" the call (UNAVAILABLE).
    kv_load_failure_policy: str = "recompute"
    # Deadline of each cache service call (seconds); gRPC message limit both ways (bytes).
    cache_timeout_s: float = 10.0
    max_message_bytes: int = 16 << 20
    # torch intra-op threads for this process; None: torch's default.
    torch_threads: int | None = None

    def __post_init__(self):
        if self.kv_load_failure_policy not in KV_LOAD_FAILURE_POLICIES:
            raise ValueError(f"kv_load_failure_policy must be one of {KV_LOAD_FAILURE_POLICIES}, "
                             f"got {self.kv_load_failure_policy!r}")

    @property
    def model_name(self) -> str:
        return self.served_model_name or Path(self.engine.model).name


# -- proto <-> engine (kept apart from prefill_service's copy: prefill and decode never import each other) --------


def sampling_from_proto(msg: common_pb2.SamplingParams) -> SamplingParams:
    """Raises InvalidRequestError for values out of range (proto3 defaults mean vLLM's defaults)."""
    return SamplingParams(
        n=msg.n or 1, max_tokens=msg.max_tokens if msg.HasField("max_tokens") else None, min_tokens=msg.min_tokens,
        temperature=msg.temperature if msg.HasField("temperature") else 1.0,
        top_p=msg.top_p if msg.HasField("top_p") else 1.0, top_k=msg.top_k if msg.HasField("top_k") else 0,
        min_p=msg.min_p if msg.HasField("min_p") else 0.0, seed=msg.seed if msg.HasField("seed") else None,
        presence_penalty=msg.presence_penalty, frequency_penalty=msg.frequency_penalty,
        repetition_penalty=msg.repetition_penalty if msg.HasField("repetition_penalty") else 1.0,
        stop=list(msg.stop), stop_token_ids=list(msg.stop_token_ids), ignore_eos=msg.ignore_eos,
        include_stop_str_in_output=msg.include_stop_str_in_output,
        logprobs=msg.top_logprobs if msg.logprobs else None, skip_special_tokens=msg.skip_special_tokens)


def logprob_to_proto(entries: PositionLogprobs, token_id: int, top: int) -> common_pb2.TokenLogprob:
    ranked = sorted((lp.rank, t, lp.logprob) for t, lp in entries.items() if lp.rank <= top)
    return common_pb2.TokenLogprob(token_id=token_id, logprob=entries[token_id].logprob,
                                   top_logprobs=[common_pb2.TopLogprob(token_id=t, logprob=v) for _, t, v in ranked])


def chunk_to_proto(batch: TokenBatch, top_logprobs: int) -> decode_pb2.DecodeChunk:
    chunk = decode_pb2.DecodeChunk(index=batch.index, token_ids=batch.token_ids,
                                   finish_reason=FINISH_REASONS[batch.finish_reason])
    if batch.first_token_logprob is not None:
        chunk.logprobs.append(batch.first_token_logprob)
    elif batch.logprobs:
        chunk.logprobs.extend(logprob_to_proto(e, t, top_logprobs) for e, t in zip(batch.logprobs, batch.token_ids))
    if batch.finish_reason == "stop" and not isinstance(batch.stop_reason, str):
        stop_id = batch.stop_reason if isinstance(batch.stop_reason, int) else (
            batch.token_ids[-1] if batch.token_ids else None)
        if stop_id is not None:
            chunk.stop_token_id = stop_id
    if batch.usage is not None:
        u = batch.usage
        chunk.usage.CopyFrom(common_pb2.Usage(prompt_tokens=u.prompt_tokens, completion_tokens=u.completion_tokens,
                                              cached_tokens=u.cached_tokens))
        chunk.used_handoff = batch.used_handoff
    return chunk


def job_from_proto(request: decode_pb2.DecodeRequest, deadline: float | None) -> DecodeJob:
    params = sampling_from_proto(request.sampling)
    source = request.WhichOneof("source")
    handoff = None
    if source == "handoff":
        h = request.handoff
        prompt = tuple(h.prompt.ids)
        handoff = Handoff(key=h.handoff_key, first_token_id=h.first_token_id,
                          first_token_logprob=h.first_token_logprob if h.HasField("first_token_logprob") else None,
                          cached_tokens=h.cached_tokens)
    elif source == "local":
        prompt = tuple(request.local.prompt.ids)
    else:
        raise InvalidRequestError("a decode request needs a handoff or a local prompt", param="source")
    if not prompt:
        raise InvalidRequestError("the prompt is empty", param="prompt")
    return DecodeJob(request_id=request.request_id, prompt_token_ids=prompt, params=params, handoff=handoff,
                     tenant_salt=request.tenant_salt, priority=request.priority, deadline=deadline)


def _deadline(context) -> float | None:
    remaining = context.time_remaining()
    return None if remaining is None else time.monotonic() + remaining


# -- the servicer ----------------------------------------------------------------------------------------------


class DecodeServicer(decode_pb2_grpc.DecodeServiceServicer):
    def __init__(self, config: DecodeServiceConfig):
        self.config = config
        self.worker: DecodeWorker | None = None  # set once the model is loaded
        self.stopping = False

    async def _check(self, model: str, context) -> DecodeWorker:
        worker = self.worker
        if worker is None or self.stopping:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "decode worker is loading its model or stopping")
        if model and model != self.config.model_name:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"model {model!r} is not served here (this worker "
                                                           f"serves {self.config.model_name!r})")
        return worker

    async def Decode(self, request: decode_pb2.DecodeRequest, context):
        worker = await self._check(request.model, context)
        if request.media:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "media in prompts is not supported yet")
        try:
            job = job_from_proto(request, _deadline(context))
            top = job.params.logprobs or 0
            async for batch in worker.decode(job):
                yield chunk_to_proto(batch, top)
        except InvalidRequestError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except RequestTimeoutError as exc:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, str(exc))
        except (HandoffUnavailableError, EngineDeadError) as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))

    async def Probe(self, request: decode_pb2.ProbeRequest, context) -> decode_pb2.ProbeResponse:
        worker = await self._check(request.model, context)
        running, waiting, usage = worker.load()
        cached = worker.probe(list(request.prompt.ids), request.tenant_salt) if request.prompt.ids else 0
        return decode_pb2.ProbeResponse(cached_tokens=cached, running=running, waiting=waiting, kv_usage=usage)


# -- lifecycle ---------------------------------------------------------------------------------------------------


class DecodeServer:
    """A running decode service: the gRPC server, its health servicer and (once loaded) the engine and worker."""

    def __init__(self, config: DecodeServiceConfig, grpc_server: grpc.aio.Server, port: int,
                 health_servicer: health.aio.HealthServicer, servicer: DecodeServicer):
        self.config = config
        self.grpc_server = grpc_server
        self.port = port
        self.health = health_servicer
        self.servicer = servicer
        self.engine: AsyncEngine | None = None
        self.cache: CacheClient | None = None
        self._loading: asyncio.Task | None = None

    @property
    def worker(self) -> DecodeWorker | None:
        return self.servicer.worker

    async def _load(self) -> None:
        if self.config.torch_threads:
            import torch

            torch.set_num_threads(self.config.torch_threads)
        t0 = time.perf_counter()
        self.engine = await AsyncEngine.create(self.config.engine)
        if self.config.cache_address:
            self.cache = CacheClient(self.config.cache_address, timeout_s=self.config.cache_timeout_s,
                                     max_message_bytes=self.config.max_message_bytes)
        self.servicer.worker = DecodeWorker(self.engine, self.cache,
                                            kv_load_failure_policy=self.config.kv_load_failure_policy)
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        log.info("decode worker ready: model %s loaded in %.1f s", self.config.model_name, time.perf_counter() - t0)

    async def ready(self) -> None:
        """Waits until the model is loaded; raises what loading raised."""
        await asyncio.shield(self._loading)

    async def stop(self, grace: float | None = 5.0) -> None:
        self.servicer.stopping = True
        await self.health.enter_graceful_shutdown()
        await self.grpc_server.stop(grace)
        if self._loading is not None and not self._loading.done():
            self._loading.cancel()
        if self.worker is not None:
            await self.worker.drain()
        if self.engine is not None:
            await self.engine.shutdown()
        if self.cache is not None:
            await self.cache.close()

    async def wait_for_termination(self) -> None:
        await self.grpc_server.wait_for_termination()


async def serve(config: DecodeServiceConfig) -> tuple[DecodeServer, int]:
    """Starts the server and begins loading the model -> (server, bound port)."""
    options = [("grpc.max_receive_message_length", config.max_message_bytes),
               ("grpc.max_send_message_length", config.max_message_bytes), ("grpc.so_reuseport", 0)]
    grpc_server = grpc.aio.server(options=options)
    servicer = DecodeServicer(config)
    decode_pb2_grpc.add_DecodeServiceServicer_to_server(servicer, grpc_server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, grpc_server)
    reflection.enable_server_reflection([SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME], grpc_server)
    port = grpc_server.add_insecure_port(config.address)
    if port == 0:
        raise OSError(f"cannot bind the decode service to {config.address}")
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    await grpc_server.start()
    server = DecodeServer(config, grpc_server, port, health_servicer, servicer)
    server._loading = asyncio.create_task(server._load())
    server._loading.add_done_callback(_log_load_failure)
    log.info("decode service on port %d (loading %s)", port, config.engine.model)
    return server, port


def _log_load_failure(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("decode worker failed to load its model: %r", task.exception())
