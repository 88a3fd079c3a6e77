"""The gateway's client of the mesh: prefill -> decode orchestration (after the P/D decision), and token events.

Contract:
- `MeshClient.generate(request)` is an async iterator of `TokenEvent`s for one prompt: every completion token of
  every choice in order, a choice's last event with its `finish_reason`, and `usage` on the very last event. Leaving
  the iteration early cancels the gRPC calls in flight (decode aborts the request and frees its memory).
- Disaggregated path (when the P/D decision says so: `gateway.routing.PDDecider`, re-exported here): `Prefill` on
  a prefill worker, then `Decode` from its handoff on a decode worker. When the first token already ends the
  output, decode is skipped. When prefill fails with UNAVAILABLE / ABORTED / INTERNAL / UNKNOWN (cache service
  down, worker gone), the request falls back to the colocated path on the decode worker (counted in
  `stats.prefill_fallbacks`).
- Colocated path: `Decode` with a local prompt; the decode worker prefills with its own prefix cache.
- The decision's inputs come from here: the chosen decode worker's prefix hit (asked with `Probe` when
  `PDDecider.needs_probe`; a failed probe counts as no hit), and the prefills this gateway has in flight.
- Errors: `MeshError` with the gRPC status code and message of the failing call (INVALID_ARGUMENT, NOT_FOUND,
  DEADLINE_EXCEEDED, UNAVAILABLE, ...); the REST layer maps it to an HTTP status.
- Worker choice (`gateway.routing.Router`, one per pool): the healthy worker of least cost = uncached prompt blocks
  (the prefixes this gateway sent it before, per tenant salt) + `load_weight` x requests in flight from this
  gateway; ties go to the first listed. No healthy decode worker: `MeshError(UNAVAILABLE)`; no healthy prefill
  worker: the colocated path.
- Pool membership: `set_worker_addresses(role, addresses)` replaces a pool's workers (service discovery,
  gateway/discovery.py); see `Router.set_addresses`.
- Health: `check_health()` asks every worker's gRPC health service once and marks it healthy or unhealthy in its
  router (an unhealthy worker gets no new requests until it passes again); `run_health_checks(interval_s)` does that
  until cancelled (the gateway runs it as a background task). `on_health_change(address, healthy)` is called on
  every transition.
- Telemetry: the worker channels carry `telemetry.rpc.client_interceptors()`: every call sends the caller's current
  trace context (`traceparent`) and request id (`x-request-id`), so the workers' spans join the request's trace.
- Security: with `mesh_token`, every call carries it (`x-kdamesh-mesh-token`, `telemetry.mesh_auth`); workers
  started with the token reject calls without it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.routing import (NoHealthyWorker, PDDecider, Router, RouterConfig, parse_worker_list,
                             prompt_block_hashes)
from protos import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from telemetry import mesh_auth
from telemetry.rpc import client_interceptors

log = logging.getLogger(__name__)

FINISH_NAMES = {common_pb2.FINISH_REASON_STOP: "stop", common_pb2.FINISH_REASON_LENGTH: "length",
                common_pb2.FINISH_REASON_ABORT: "abort", common_pb2.FINISH_REASON_TOOL_CALLS: "tool_calls",
                common_pb2.FINISH_REASON_ERROR: "error"}
FALLBACK_CODES = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.ABORTED, grpc.StatusCode.INTERNAL,
                  grpc.StatusCode.UNKNOWN}
PROBE_TIMEOUT_S = 1.0
# A decode stream that sent its last chunk (with usage) is given this long to end by itself when its consumer stops
# there, so the worker records it as OK rather than CANCELLED (seconds).
END_OF_STREAM_S = 1.0
MAX_MESSAGE_BYTES = 16 << 20
# A worker removed from its pool (service discovery) keeps its channel this long for the calls it still serves (s).
RETIRED_CHANNEL_GRACE_S = 600.0


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
    priority: int = 0
    timeout_s: float | None = None  # the whole request, prefill and decode together
    media: tuple[common_pb2.MediaItem, ...] = ()  # the prompt's images (gateway/media.py), sent to both workers
    snapshot_hints: tuple[int, ...] = ()  # prompt positions to snapshot (gateway.hints); sent to prefill and decode


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


class _Worker:
    def __init__(self, address: str, stub_type, mesh_token: str | None = None):
        self.address = address
        options = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                   ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)]
        self.channel = grpc.aio.insecure_channel(
            address, options=options,
            interceptors=[*client_interceptors(), *mesh_auth.client_interceptors(mesh_token)])
        self.stub = stub_type(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)


class MeshClient:
    def __init__(self, decode_addresses: Sequence[str], prefill_addresses: Sequence[str] = (),
                 decider: PDDecider | None = None, handoff_ttl_ms: int = 0, *, block_size: int = 16,
                 router_config: RouterConfig = RouterConfig(), on_health_change=None,
                 mesh_token: str | None = None):
        if not decode_addresses:
            raise ValueError("the mesh needs at least one decode worker")
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.decoders = {a: _Worker(a, decode_pb2_grpc.DecodeServiceStub, mesh_token) for a in decode_addresses}
        self.prefillers = {a: _Worker(a, prefill_pb2_grpc.PrefillServiceStub, mesh_token) for a in prefill_addresses}
        self.decode_router = Router(list(self.decoders), router_config)
        self.prefill_router = Router(list(self.prefillers), router_config) if self.prefillers else None
        self.decider = decider or PDDecider()
        self.handoff_ttl_ms = handoff_ttl_ms
        self.block_size = block_size
        self.on_health_change = on_health_change  # (address, healthy) on every transition
        self.stats = MeshStats()
        self._router_config = router_config
        self._mesh_token = mesh_token
        self._retired: list[_Worker] = []  # removed by `set_worker_addresses`; channels closing
        self._retiring: set[asyncio.Task] = set()

    async def close(self) -> None:
        for task in list(self._retiring):
            task.cancel()
        for w in list(self.decoders.values()) + list(self.prefillers.values()) + self._retired:
            await w.channel.close()

    async def set_worker_addresses(self, role: str, addresses: Sequence[str]) -> tuple[tuple[str, ...], ...]:
        """Replaces the worker set of a pool (`role` "decode" or "prefill"): what service discovery calls after each
        resolution. New workers get a channel and join the pool's router (empty index, healthy); removed workers
        leave the router at once and their channel closes once their calls in flight end (at most
        `RETIRED_CHANNEL_GRACE_S`). The decode pool may not become empty (`ValueError`: keep the last resolution);
        an empty prefill pool sends every request down the colocated path. Returns `(added, removed)`."""
        if role not in ("decode", "prefill"):
            raise ValueError(f"role must be 'decode' or 'prefill', got {role!r}")
        wanted = parse_worker_list(list(addresses))
        if role == "decode" and not wanted:
            raise ValueError("the decode pool needs at least one worker address")
        workers = self.decoders if role == "decode" else self.prefillers
        stub = decode_pb2_grpc.DecodeServiceStub if role == "decode" else prefill_pb2_grpc.PrefillServiceStub
        router = self.decode_router if role == "decode" else self.prefill_router
        if router is None:  # the first prefill workers of a gateway that started without any
            if not wanted:
                return (), ()
            router = self.prefill_router = Router(wanted, self._router_config)
            added, removed = wanted, ()
        else:
            added, removed = router.set_addresses(wanted)
        for address in added:
            workers[address] = _Worker(address, stub, self._mesh_token)
        for address in removed:
            self._retire(workers.pop(address))
        return added, removed

    def _retire(self, worker: _Worker) -> None:
        self._retired.append(worker)
        task = asyncio.get_running_loop().create_task(worker.channel.close(grace=RETIRED_CHANNEL_GRACE_S))
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)

    async def health(self, timeout_s: float = 1.0) -> dict[str, bool]:
        """address -> whether the worker reports SERVING."""
        async def check(w: _Worker) -> bool:
            try:
                r = await w.health.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout_s)
            except grpc.aio.AioRpcError:
                return False
            return r.status == health_pb2.HealthCheckResponse.SERVING

        workers = list(self.decoders.values()) + list(self.prefillers.values())
        results = await asyncio.gather(*(check(w) for w in workers))
        return {w.address: ok for w, ok in zip(workers, results)}

    async def check_health(self, timeout_s: float = 1.0) -> dict[str, bool]:
        """Asks every worker once and updates the routers; returns address -> healthy."""
        results = await self.health(timeout_s)
        for address, ok in results.items():
            router = self.decode_router if address in self.decoders else self.prefill_router
            if address not in self.decoders and address not in self.prefillers:
                continue  # removed from its pool while being checked
            if router.is_healthy(address) == ok:
                continue
            if ok:
                router.mark_healthy(address)
                log.info("mesh worker %s is healthy again", address)
            else:
                router.mark_unhealthy(address)
                log.warning("mesh worker %s failed its health check; routing around it", address)
            if self.on_health_change is not None:
                self.on_health_change(address, ok)
        return results

    async def run_health_checks(self, interval_s: float, timeout_s: float = 1.0) -> None:
        """`check_health` every `interval_s` seconds until cancelled."""
        while True:
            try:
                await self.check_health(timeout_s)
            except Exception:  # a health round must never kill the loop
                log.exception("health check round failed")
            await asyncio.sleep(interval_s)

    def block_hashes(self, req: MeshRequest) -> list[bytes]:
        """The prompt's full-block hashes as the routers see them (salted per tenant, namespaced per model)."""
        salt = req.tenant_salt.hex() if req.tenant_salt else None
        return prompt_block_hashes(req.prompt_token_ids, self.block_size, salt, namespace=req.model.encode())

    # -- one request --------------------------------------------------------------------------------------------

    async def generate(self, req: MeshRequest) -> AsyncIterator[TokenEvent]:
        deadline = None if req.timeout_s is None else time.monotonic() + req.timeout_s
        hashes = self.block_hashes(req)
        try:
            pick = self.decode_router.route(hashes)
        except NoHealthyWorker as exc:
            raise MeshError(grpc.StatusCode.UNAVAILABLE, f"no healthy decode worker ({exc})") from None
        decoder = self.decoders[pick.address]
        try:
            route = await self._route(req, decoder, deadline)
            source: dict = {"local": decode_pb2.LocalPrefill(prompt=common_pb2.TokenIds(ids=req.prompt_token_ids))}
            prompt_logprobs: list[common_pb2.TokenLogprob] = []
            if route == "remote":
                response = await self._prefill(req, hashes, deadline)
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
                            "first_token_logprob") else None,
                        prompt=common_pb2.TokenIds(ids=req.prompt_token_ids), cached_tokens=response.cached_tokens)}
            if route != "remote":
                self.stats.local += 1
            request = decode_pb2.DecodeRequest(request_id=req.request_id, model=req.model, sampling=req.sampling,
                                               tenant_salt=req.tenant_salt, priority=req.priority, media=req.media,
                                               snapshot_hints=req.snapshot_hints, **source)
            async for event in self._decode(decoder, request, deadline, route, prompt_logprobs):
                yield event
        finally:
            self.decode_router.finish(pick.address)

    def _prefill_inflight(self) -> int:
        return sum(self.prefill_router.active(a) for a in self.prefill_router.addresses)

    def _any_prefill_healthy(self) -> bool:
        return any(self.prefill_router.is_healthy(a) for a in self.prefill_router.addresses)

    async def _route(self, req: MeshRequest, decoder: _Worker, deadline: float | None) -> str:
        """The P/D decision for this request ("remote" or "local"), with its inputs gathered here."""
        n, choices = len(req.prompt_token_ids), req.sampling.n or 1
        have_prefill = self.prefill_router is not None and self._any_prefill_healthy()
        cached = 0
        if self.decider.needs_probe(n, choices, have_prefill):
            cached = await self._probe(req, decoder, deadline)
        inflight = self._prefill_inflight() if have_prefill else 0
        return self.decider.decide(n, choices, cached, inflight, have_prefill=have_prefill)

    async def _probe(self, req: MeshRequest, decoder: _Worker, deadline: float | None) -> int:
        """Prompt tokens in the decode worker's prefix cache (0 when the probe fails)."""
        request = decode_pb2.ProbeRequest(model=req.model, prompt=common_pb2.TokenIds(ids=req.prompt_token_ids),
                                          tenant_salt=req.tenant_salt)
        try:
            return (await decoder.stub.Probe(request, timeout=_remaining(deadline, PROBE_TIMEOUT_S))).cached_tokens
        except grpc.aio.AioRpcError as exc:
            log.debug("probe of %s failed: %s", decoder.address, exc.code().name)
            return 0

    async def _prefill(self, req: MeshRequest, hashes: list[bytes],
                       deadline: float | None) -> prefill_pb2.PrefillResponse | None:
        """The prefill response, or None when the request should fall back to the colocated path."""
        try:
            pick = self.prefill_router.route(hashes)
        except NoHealthyWorker:
            self.stats.prefill_fallbacks += 1
            return None
        worker = self.prefillers[pick.address]
        request = prefill_pb2.PrefillRequest(request_id=req.request_id, model=req.model,
                                             prompt=common_pb2.TokenIds(ids=req.prompt_token_ids),
                                             sampling=req.sampling, tenant_salt=req.tenant_salt,
                                             priority=req.priority, handoff_ttl_ms=self.handoff_ttl_ms,
                                             media=req.media, snapshot_hints=req.snapshot_hints)
        try:
            response = await worker.stub.Prefill(request, timeout=_remaining(deadline))
        except grpc.aio.AioRpcError as exc:
            if exc.code() in FALLBACK_CODES:
                log.warning("prefill on %s failed (%s: %s); prefilling on the decode worker", worker.address,
                            exc.code().name, exc.details())
                self.stats.prefill_fallbacks += 1
                return None
            raise MeshError(exc.code(), exc.details() or exc.code().name) from None
        finally:
            self.prefill_router.finish(pick.address)
        self.stats.remote += 1
        self.stats.handoff_bytes += response.handoff_bytes
        self.stats.prefill_ms += response.timings.total_ms
        self.stats.publish_ms += response.timings.publish_ms
        return response

    async def _decode(self, decoder: _Worker, request: decode_pb2.DecodeRequest, deadline: float | None,
                      route: str, prompt_logprobs: list[common_pb2.TokenLogprob]) -> AsyncIterator[TokenEvent]:
        """The decode stream as events; `prompt_logprobs` (the prefill's) go on the first one."""
        call = decoder.stub.Decode(request, timeout=_remaining(deadline))
        finished = False
        try:
            async for chunk in call:
                event = TokenEvent(index=chunk.index, token_ids=list(chunk.token_ids), logprobs=list(chunk.logprobs),
                                   finish_reason=FINISH_NAMES.get(chunk.finish_reason),
                                   stop_token_id=chunk.stop_token_id if chunk.HasField("stop_token_id") else None,
                                   prompt_logprobs=list(chunk.prompt_logprobs) or prompt_logprobs)
                prompt_logprobs = []
                if chunk.HasField("cached_tokens"):
                    event.cached_tokens = chunk.cached_tokens
                if chunk.HasField("usage"):
                    event.usage = chunk.usage
                    event.route = route
                    finished = True
                yield event
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


def _remaining(deadline: float | None, cap: float | None = None) -> float | None:
    if deadline is None:
        return cap
    left = max(0.001, deadline - time.monotonic())
    return left if cap is None else min(left, cap)


def _first_token_only(response: prefill_pb2.PrefillResponse) -> TokenEvent:
    finish = FINISH_NAMES.get(response.finish_reason)
    return TokenEvent(index=0, token_ids=[response.first_token_id], cached_tokens=response.cached_tokens,
                      logprobs=[response.first_token_logprob] if response.HasField("first_token_logprob") else [],
                      finish_reason=finish, prompt_logprobs=list(response.prompt_logprobs),
                      usage=common_pb2.Usage(prompt_tokens=response.prompt_tokens, completion_tokens=1,
                                             cached_tokens=response.cached_tokens),
                      route="remote")
