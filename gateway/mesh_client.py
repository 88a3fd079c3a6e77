"""The gateway's request orchestrator: the P/D decision, prefill -> decode over the worker pools, token events.

Contract:
- `MeshClient` is a `gateway.worker_pool.WorkerPool` (channels, membership, health, KV-event subscriptions, the
  workers' reported facts; same constructor, plus the P/D `decider` and `handoff_ttl_ms`) that runs requests over
  its pools. `generate(request)` is an async iterator of `TokenEvent`s for one prompt: every completion token of
  every choice in order, a choice's last event with its `finish_reason`, and `usage` (the mesh's one
  `common_pb2.Usage`) on the very last event. Leaving the iteration early cancels the gRPC calls in flight (decode
  aborts the request and frees its memory).
- Every worker call carries the request once, as a `GenerationRequest` (`generation_request`): prefill and decode
  get the same message. Output comes back as one event type, decode's `DecodeChunk` (a prefill that already ended
  the output is turned into one); `token_event(chunk, route)` is the one place it becomes a `TokenEvent`.
- Disaggregated path (when the P/D decision says so: `gateway.routing.PDDecider`, re-exported here): `Prefill` on
  a prefill worker, then `Decode` from its handoff on a decode worker. When the first token already ends the
  output, decode is skipped. When prefill fails with UNAVAILABLE / ABORTED / INTERNAL / UNKNOWN (cache service
  down, worker gone), the request falls back to the colocated path on the decode worker (counted in
  `stats.prefill_fallbacks`).
- Colocated path: `Decode` with a local prompt; the decode worker prefills with its own prefix cache.
- A request the client reads whole (`MeshRequest.streamed` False: a non-streamed API request) asks decode to batch
  its tokens after the first (`GenerationRequest.output_interval_ms` = the stall policy's `output_interval_s()`):
  the events then carry many tokens each, one per interval instead of one per token (the first comes at once).
- The decision's inputs come from here: the chosen decode worker's prefix hit (its KV-event index, the same
  `Pick` that chose it; no call), and the prefills this gateway has in flight.
- Stalls (`gateway.stall.StallPolicy`, `stall`): a decode stream silent past the policy's limit (the first message:
  the prompt's expected prefill time more) from a worker that has not answered its health check SERVING for as
  long (a queued or preempted request of a busy worker waits on) raises `gateway.stall.WorkerStalled`; a prefill silent past its first
  message limit is redone on the decode worker (the fallback path, counted in `stats.prefill_stalls` too).
- Errors: `MeshError` with the gRPC status code and message of the failing call (INVALID_ARGUMENT, NOT_FOUND,
  DEADLINE_EXCEEDED, UNAVAILABLE, ...); the REST layer maps it to an HTTP status.
- Worker choice (`gateway.routing.Router`, one per pool): the healthy worker of least cost = uncached prompt tokens
  on that worker (its prefix index, fed by its KV event stream; the prompt is hashed as the engine hashes it,
  `prompt_key`) + a load term (queue and KV usage); ties go to the first listed. No healthy decode worker:
  `MeshError(UNAVAILABLE)`; no healthy prefill worker: the colocated path. When a worker reports fewer cached
  tokens than its index promised (a local prefill's first chunk, a prefill response), the index is emptied and
  resubscribed (`Router.observe`, `stats.stale_beliefs`), so no second request is routed on that belief.
- The cache service (`cache_address`): a prefix it holds counts as reusable (at a transfer's cost) on a worker that
  loads remote prefixes — in the cost and in the P/D decision (gateway/routing.py).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import grpc

from engine.memory.hashing import MediaSpan
from gateway.prefix_index import PromptKey
from gateway.routing import CACHE, NoHealthyWorker, PDDecider, Pick, Router, RouterConfig
from gateway.stall import StallPolicy, next_message
from gateway.worker_pool import WorkerChannel, WorkerPool
from protos import common_pb2, decode_pb2, prefill_pb2

log = logging.getLogger(__name__)

FINISH_NAMES = {common_pb2.FINISH_REASON_STOP: "stop", common_pb2.FINISH_REASON_LENGTH: "length",
                common_pb2.FINISH_REASON_ABORT: "abort", common_pb2.FINISH_REASON_TOOL_CALLS: "tool_calls",
                common_pb2.FINISH_REASON_ERROR: "error"}
FALLBACK_CODES = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.ABORTED, grpc.StatusCode.INTERNAL,
                  grpc.StatusCode.UNKNOWN}
# A decode stream that sent its last chunk (with usage) is given this long to end by itself when its consumer stops
# there, so the worker records it as OK rather than CANCELLED (seconds).
END_OF_STREAM_S = 1.0
__all__ = ["MeshClient", "MeshError", "MeshRequest", "MeshStats", "PDDecider", "TokenEvent", "generation_request"]


class MeshError(Exception):
    """A mesh call failed; `code` is the gRPC status code."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code, self.message = code, message


@dataclass(frozen=True)
class MeshRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: common_pb2.SamplingParams
    model: str = ""
    tenant_salt: bytes = b""
    tenant: common_pb2.TenantShare | None = None  # the fair share the workers give it (None: the salt decides)
    priority: int = 0
    timeout_s: float | None = None  # the whole request, prefill and decode together
    media: tuple[common_pb2.MediaItem, ...] = ()  # the prompt's images (gateway/media.py), sent to both workers
    snapshot_hints: tuple[int, ...] = ()  # prompt positions to snapshot (gateway.hints); sent to prefill and decode
    streamed: bool = True  # False: the client reads the response whole, so decode may batch its tokens


@dataclass
class TokenEvent:
    index: int  # choice
    token_ids: list[int]
    logprobs: list[common_pb2.TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_token_id: int | None = None  # with finish "stop": the stop token that ended the output (EOS or stop id)
    usage: common_pb2.Usage | None = None  # on the last event of the request
    cached_tokens: int | None = None  # prompt tokens served from the cache; on the first event of the request
    route: str = ""  # on the last event: "remote" | "local" | "fallback"
    # `sampling.prompt_logprobs`: prompt tokens 2..N (from prefill or a colocated decode); on the first event only
    prompt_logprobs: list[common_pb2.TokenLogprob] = field(default_factory=list)


@dataclass
class MeshStats:
    remote: int = 0
    local: int = 0
    prefill_fallbacks: int = 0
    prefill_finished: int = 0  # outputs that ended at prefill's first token
    handoff_bytes: int = 0  # handoff objects published by prefill workers (bytes)
    prefill_ms: float = 0.0  # prefill workers' own time (load + compute + publish), summed (milliseconds)
    publish_ms: float = 0.0  # of which publishing blocks and handoffs
    stale_beliefs: int = 0  # requests whose worker served fewer cached tokens than its KV-event index promised
    prefill_stalls: int = 0  # prefills recomputed on the decode worker because their prefill worker went silent


class MeshClient(WorkerPool):
    def __init__(self, decode_addresses: Sequence[str], prefill_addresses: Sequence[str] = (),
                 decider: PDDecider | None = None, handoff_ttl_ms: int = 0, *,
                 router_config: RouterConfig = RouterConfig(), stall: StallPolicy = StallPolicy(), **pool_options):
        super().__init__(decode_addresses, prefill_addresses, router_config=router_config, **pool_options)
        self.stall = stall
        self.decider = decider or PDDecider()
        self.handoff_ttl_ms = handoff_ttl_ms
        self.stats = MeshStats()

    def prompt_key(self, req: MeshRequest) -> PromptKey:
        """The prompt as the routers see it: hashed like the engine does (the tenant's engine cache salt,
        worker/tenancy.py; the images' content hashes), in each worker's hash space."""
        media = tuple(sorted((MediaSpan(m.token_offset, m.num_tokens, m.content_hash) for m in req.media),
                             key=lambda m: m.offset))
        return PromptKey(req.prompt_token_ids, req.tenant_salt.hex() if req.tenant_salt else None, media)

    # -- one request --------------------------------------------------------------------------------------------

    async def generate(self, req: MeshRequest) -> AsyncIterator[TokenEvent]:
        deadline = None if req.timeout_s is None else time.monotonic() + req.timeout_s
        key = self.prompt_key(req)
        try:
            pick = self.decode_router.route(key)
        except NoHealthyWorker as exc:
            raise MeshError(grpc.StatusCode.UNAVAILABLE, f"no healthy decode worker ({exc})") from None
        decoder = self.decoders[pick.address]
        generation = generation_request(req)
        if not req.streamed:  # after the first token, one message per interval instead of one per token
            generation.output_interval_ms = round(self.stall.output_interval_s() * 1000)
        try:
            route = self._route(req, pick)
            source: dict = {"local": decode_pb2.LocalPrefill()}
            prompt_logprobs: list[common_pb2.TokenLogprob] = []
            if route == "remote":
                response = await self._prefill(generation, key, deadline, _comparable(req))
                if response is None:
                    route = "fallback"
                elif response.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
                    self.stats.prefill_finished += 1
                    yield _first_token_only(response)
                    return
                else:
                    prompt_logprobs = list(response.prompt_logprobs)
                    source = {"handoff": decode_pb2.HandoffSource(
                        handoff_key=response.handoff_key, first_token_id=response.first_token_id,
                        first_token_logprob=response.first_token_logprob if response.HasField(
                            "first_token_logprob") else None, cached_tokens=response.cached_tokens)}
            if route != "remote":
                self.stats.local += 1
            request = decode_pb2.DecodeRequest(generation=generation, **source)
            belief = pick if route != "remote" and _comparable(req) else None  # a local prefill reports its hit
            async for event in self._decode(decoder, request, deadline, route, prompt_logprobs):
                if belief is not None and event.cached_tokens is not None:
                    self._observe(self.decode_router, belief, event.cached_tokens)
                    belief = None
                yield event
        finally:
            self.decode_router.finish(pick.address)

    def _prefill_inflight(self) -> int:
        return sum(self.prefill_router.active(a) for a in self.prefill_router.addresses)

    def _any_prefill_healthy(self) -> bool:
        return any(self.prefill_router.is_healthy(a) for a in self.prefill_router.addresses)

    def _route(self, req: MeshRequest, pick: Pick) -> str:
        """The P/D decision for this request ("remote" or "local"): the decode pick's cached tokens come from the
        same KV-event index that chose the worker."""
        have_prefill = self.prefill_router is not None and self._any_prefill_healthy()
        inflight = self._prefill_inflight() if have_prefill else 0
        return self.decider.decide(len(req.prompt_token_ids), req.sampling.n or 1, pick.cached_tokens, inflight,
                                   have_prefill=have_prefill)

    def _observe(self, router: Router, pick: Pick, actual_tokens: int) -> None:
        """A worker served `actual_tokens` from its cache where its index promised `pick.cached_tokens`: fewer
        means the index is wrong; it is emptied and resubscribed before another request relies on it."""
        wrong = router.observe(pick, actual_tokens)
        if wrong is not None:
            self.stats.stale_beliefs += 1
            source = self.cache_address if wrong == CACHE else pick.address
            log.info("%s served %d cached tokens where the indexes promised %d; resyncing the KV events of %s",
                     pick.address, actual_tokens, pick.cached_tokens, source)
            self.resync(source)

    async def _prefill(self, generation: common_pb2.GenerationRequest, key: PromptKey, deadline: float | None,
                       comparable: bool) -> prefill_pb2.PrefillResponse | None:
        """The prefill response, or None when the request should fall back to the colocated path."""
        try:
            pick = self.prefill_router.route(key)
        except NoHealthyWorker:
            self.stats.prefill_fallbacks += 1
            return None
        worker = self.prefillers[pick.address]
        request = prefill_pb2.PrefillRequest(generation=generation, handoff_ttl_ms=self.handoff_ttl_ms)
        stall_s = self.stall.first_message_s(len(generation.prompt.ids))
        try:
            response = await worker.stub.Prefill(request, timeout=_remaining(deadline, stall_s))
        except grpc.aio.AioRpcError as exc:
            stalled = exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED and (
                deadline is None or deadline - time.monotonic() > 0.01)
            if stalled:  # the prefill worker went silent, not the request's deadline: recompute on decode
                log.warning("prefill on %s sent nothing for %.1f s (--stall-timeout-s); prefilling on the decode "
                            "worker", worker.address, stall_s)
                self.stats.prefill_stalls += 1
            if exc.code() in FALLBACK_CODES or stalled:
                log.warning("prefill on %s failed (%s: %s); prefilling on the decode worker", worker.address,
                            exc.code().name, exc.details())
                self.stats.prefill_fallbacks += 1
                return None
            raise MeshError(exc.code(), exc.details() or exc.code().name) from None
        finally:
            self.prefill_router.finish(pick.address)
        if comparable:
            self._observe(self.prefill_router, pick, response.cached_tokens)
        self.stats.remote += 1
        self.stats.handoff_bytes += response.handoff_bytes
        self.stats.prefill_ms += response.timings.total_ms
        self.stats.publish_ms += response.timings.publish_ms
        return response

    async def _decode(self, decoder: WorkerChannel, request: decode_pb2.DecodeRequest, deadline: float | None,
                      route: str, prompt_logprobs: list[common_pb2.TokenLogprob]) -> AsyncIterator[TokenEvent]:
        """The decode stream as events; `prompt_logprobs` (the prefill's) go on the first one."""
        call = decoder.stub.Decode(request, timeout=_remaining(deadline))
        finished = False
        messages = call.__aiter__()
        limit_s = self.stall.first_message_s(len(request.generation.prompt.ids))
        describe = f"decode worker {decoder.address}"
        since_serving = functools.partial(self.since_serving, decoder.address)
        try:
            while True:
                try:
                    chunk = await next_message(messages, limit_s, describe, since_serving)
                except StopAsyncIteration:
                    break
                limit_s = self.stall.gap_s()
                if not chunk.prompt_logprobs:
                    chunk.prompt_logprobs.extend(prompt_logprobs)
                prompt_logprobs = []
                finished = chunk.HasField("usage")
                yield token_event(chunk, route)
        except grpc.aio.AioRpcError as exc:
            raise MeshError(exc.code(), exc.details() or exc.code().name) from None
        finally:
            await _end_call(call, finished)


async def _end_call(call, finished: bool) -> None:
    """Cancels a decode stream still running (decode aborts the request); one that already sent its last chunk is
    first given `END_OF_STREAM_S` to end by itself."""
    try:
        if finished:
            await asyncio.wait_for(call.code(), END_OF_STREAM_S)
    except (asyncio.TimeoutError, grpc.aio.AioRpcError):
        pass
    finally:
        call.cancel()  # a no-op once the call has ended


def generation_request(req: MeshRequest) -> common_pb2.GenerationRequest:
    """The one message both workers get for `req` (protos/common.proto `GenerationRequest`)."""
    return common_pb2.GenerationRequest(request_id=req.request_id, model=req.model,
                                        prompt=common_pb2.TokenIds(ids=req.prompt_token_ids), sampling=req.sampling,
                                        tenant_salt=req.tenant_salt, media=req.media, priority=req.priority,
                                        snapshot_hints=req.snapshot_hints, tenant=req.tenant)


def _comparable(req: MeshRequest) -> bool:
    """Whether the cached tokens a worker reports for `req` measure its prefix cache (prompt logprobs compute the
    whole prompt, whatever is cached)."""
    return not req.sampling.HasField("prompt_logprobs")


def _remaining(deadline: float | None, cap: float | None = None) -> float | None:
    if deadline is None:
        return cap
    left = max(0.001, deadline - time.monotonic())
    return left if cap is None else min(left, cap)


def token_event(chunk: decode_pb2.DecodeChunk, route: str) -> TokenEvent:
    """The gateway's view of a worker's output event (the only place one is read); `route` goes on the last."""
    last = chunk.HasField("usage")
    return TokenEvent(index=chunk.index, token_ids=list(chunk.token_ids), logprobs=list(chunk.logprobs),
                      finish_reason=FINISH_NAMES.get(chunk.finish_reason),
                      stop_token_id=chunk.stop_token_id if chunk.HasField("stop_token_id") else None,
                      usage=chunk.usage if last else None,
                      cached_tokens=chunk.cached_tokens if chunk.HasField("cached_tokens") else None,
                      route=route if last else "", prompt_logprobs=list(chunk.prompt_logprobs))


def _first_token_only(response: prefill_pb2.PrefillResponse) -> TokenEvent:
    """A prefill that already ended the output, as the one-chunk stream decode would have sent."""
    chunk = decode_pb2.DecodeChunk(index=0, token_ids=[response.first_token_id], finish_reason=response.finish_reason,
                                   cached_tokens=response.cached_tokens, prompt_logprobs=response.prompt_logprobs,
                                   usage=common_pb2.Usage(prompt_tokens=response.prompt_tokens, completion_tokens=1,
                                                          cached_tokens=response.cached_tokens))
    if response.HasField("first_token_logprob"):
        chunk.logprobs.append(response.first_token_logprob)
    return token_event(chunk, "remote")
