"""An in-process mesh for integration tests: cache, prefill and decode `grpc.aio` servers on free ports in the test's
event loop (engines in their own threads), plus the gateway's `MeshClient` and direct stubs.

`async with Mesh(model_dir, ...) as mesh:` starts everything and waits for the models; leaving stops everything.
`mesh.run(prompt, sampling, route)` sends one request through the gateway's client: route "remote" forces prefill ->
decode (P/D threshold 0), "local" the colocated path; it returns a `Run` with the tokens, events and usage.
`mesh.run_direct(prompt, sampling, route, hints=..., tenant_salt=...)` sends it over the worker stubs themselves, with
the request fields the gateway's client does not set yet (structure hints, a tenant salt).
`Mesh(..., prefill_tp=2)` / `decode_tp=2` run that worker's model on 2 rank processes (tensor parallelism; at most
one worker per process may use TP > 1). `tiny_k3_checkpoint(tmp_path_factory)` generates the tiny K3 checkpoint these tests share (seed 3);
`run_bounded(coro)` runs a test's coroutine under a time limit (nothing may hang); `settle_kv_events(client,
servers)` waits until the workers' KV events reached a mesh client's routers; `await wait_idle(engine)` waits
until an `AsyncEngine` holds no request, `await assert_all_free(engine)` also checks that its pools got everything
back.
"""

from __future__ import annotations

import asyncio
import random
from contextlib import aclosing
from dataclasses import dataclass, field

import grpc

from cache_service.client import CacheClient
from cache_service.server import CacheServiceConfig
from cache_service.server import serve as serve_cache
from decode_service.server import DecodeServiceConfig
from decode_service.server import serve as serve_decode
from engine.config import EngineArgs
from engine.model.checkpoint import make_checkpoint
from engine.transfer import RequestState
from gateway.mesh_client import MeshClient, MeshRequest, PDDecider, TokenEvent
from prefill_service.server import PrefillServiceConfig
from prefill_service.server import serve as serve_prefill
from protos import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc

VOCAB = 7936  # the generated tokenizer's base tokens
CHECKPOINT_SEED = 3


def tiny_k3_checkpoint(tmp_path_factory):
    return make_checkpoint("tiny-k3", tmp_path_factory.mktemp("tiny-k3"), seed=CHECKPOINT_SEED)


def run_bounded(coro, timeout_s: float = 50.0):
    async def bounded():
        async with asyncio.timeout(timeout_s):  # nothing may hang
            return await coro
    return asyncio.run(bounded())


def engine_args(model_dir, **overrides) -> EngineArgs:
    base = dict(model=str(model_dir), kv_cache_memory=8 << 20, max_num_seqs=8, max_num_batched_tokens=256,
                snapshot_interval=32)
    base.update(overrides)
    return EngineArgs(**base)


def zero_kda_state(state: RequestState) -> None:
    """The negative control's edit of a handoff: every KDA state tensor zeroed (they must be non-zero before)."""
    assert state.state and all(t.abs().sum() > 0 for t in state.state.values())
    for tensor in state.state.values():
        tensor.zero_()


def greedy(max_tokens: int, **extra) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                                     skip_special_tokens=True, **extra)


def prompt_suite(seed: int = 0) -> list[list[int]]:
    """Lengths from 1 to several 16-token blocks; later prompts share prefixes with earlier ones (whole blocks,
    snapshot boundaries and mid-block), so prefill reuses cached blocks and snapshots."""
    rng = random.Random(seed)
    base = [rng.randrange(VOCAB) for _ in range(100)]
    other = [rng.randrange(VOCAB) for _ in range(70)]
    prompts = [base[:1], base[:2], base[:15], base[:16], base[:17], other[:31], base[:32], base[:33], base[:40],
               base[:64], base[:65], base[:100], other[:70]]
    prompts += [base[:32] + [rng.randrange(VOCAB) for _ in range(9)],  # shares 2 blocks + the 32-token snapshot
                base[:48] + [rng.randrange(VOCAB) for _ in range(20)],
                other[:64] + base[:5]]
    return prompts


@dataclass
class Run:
    tokens: dict[int, list[int]] = field(default_factory=dict)  # choice -> token ids
    events: list[TokenEvent] = field(default_factory=list)
    usage: common_pb2.Usage | None = None
    finish: dict[int, str] = field(default_factory=dict)
    route: str = ""

    @property
    def ids(self) -> list[int]:
        return self.tokens.get(0, [])


async def wait_idle(engine) -> None:
    for _ in range(200):
        stats = await engine.stats()
        if stats.num_running == 0 and stats.num_waiting == 0:
            return
        await asyncio.sleep(0.02)
    raise AssertionError("the engine still holds requests")


async def assert_all_free(engine) -> None:
    await wait_idle(engine)
    await engine.check_integrity()
    pool = engine.core.manager.block_pool
    assert pool.num_free_blocks == pool.num_blocks, "a finished request kept blocks"


async def settle_kv_events(client: MeshClient, servers: dict, timeout_s: float = 10.0) -> None:
    """Waits until every KV event the workers' engines recorded so far reached `client`'s routers (`servers`:
    address -> worker server): nothing pending in a sink, every index live at its publisher's sequence."""
    async with asyncio.timeout(timeout_s):
        while True:
            settled = True
            for address, server in servers.items():
                router = client.decode_router if address in client.decoders else client.prefill_router
                index = router.index(address)
                settled &= (server.engine.core.manager.events.pending == 0 and index.live
                            and index.epoch == server.kv_events.epoch
                            and index.next_sequence == server.kv_events.sequence)
            if settled:
                return
            await asyncio.sleep(0.01)


class Mesh:
    def __init__(self, model_dir, *, backend: str = "memory", engine: dict | None = None,
                 decode_engine: dict | None = None, kv_load_failure_policy: str = "recompute",
                 handoff_ttl_s: float = 30.0, handoff_full_kv: bool = False, with_prefill: bool = True,
                 cache_address: str | None = None, redis_key_prefix: str = "kdamesh:",
                 cache_data_plane: bool = True, prefill_tp: int = 1, decode_tp: int = 1,
                 load_remote_prefix: bool = True, max_object_bytes: int = 1 << 30,
                 handoff_part_bytes: int = 256 << 20, decode_options: dict | None = None):
        self.model_dir = model_dir
        self.backend = backend
        self.engine_overrides = engine or {}
        self.decode_engine_overrides = decode_engine if decode_engine is not None else self.engine_overrides
        self.tensor_parallel = {"prefill": prefill_tp, "decode": decode_tp}  # ranks per worker (one TP>1 per process)
        self.policy = kv_load_failure_policy
        self.handoff_ttl_s = handoff_ttl_s
        self.handoff_full_kv = handoff_full_kv
        self.with_prefill = with_prefill
        self.cache_address = cache_address  # an external (or dead) cache service instead of our own
        self.redis_key_prefix = redis_key_prefix
        self.cache_data_plane = cache_data_plane  # False: the workers' payloads travel over gRPC (BatchPut/BatchGet)
        self.load_remote_prefix = load_remote_prefix  # False: the workers import no prefixes from the cache service
        self.max_object_bytes = max_object_bytes  # the cache service's object cap
        self.handoff_part_bytes = handoff_part_bytes  # prefill: a bigger handoff streams
        self.decode_options = decode_options or {}  # more DecodeServiceConfig fields (handoff_fetch_bytes, ...)
        self.cache_server = self.prefill_server = self.decode_server = None
        self._channels: list[grpc.aio.Channel] = []

    async def __aenter__(self) -> "Mesh":
        if self.cache_address is None:
            self.cache_server, port = await serve_cache(CacheServiceConfig(
                address="127.0.0.1:0", backend=self.backend, handoff_ttl_s=self.handoff_ttl_s,
                redis_key_prefix=self.redis_key_prefix, data_plane=self.cache_data_plane,
                max_object_bytes=self.max_object_bytes))
            self.cache_address = f"127.0.0.1:{port}"
        starts = []
        if self.with_prefill:
            self.prefill_server, pport = await serve_prefill(PrefillServiceConfig(
                engine=self._engine("prefill", self.engine_overrides), cache_address=self.cache_address,
                address="127.0.0.1:0", handoff_full_kv=self.handoff_full_kv, cache_timeout_s=5.0,
                handoff_part_bytes=self.handoff_part_bytes,
                load_remote_prefix=self.load_remote_prefix))
            self.prefill_address = f"127.0.0.1:{pport}"
            starts.append(self.prefill_server.ready())
        self.decode_server, dport = await serve_decode(DecodeServiceConfig(
            engine=self._engine("decode", self.decode_engine_overrides), cache_address=self.cache_address,
            address="127.0.0.1:0", kv_load_failure_policy=self.policy, cache_timeout_s=5.0,
            load_remote_prefix=self.load_remote_prefix, **self.decode_options))
        self.decode_address = f"127.0.0.1:{dport}"
        starts.append(self.decode_server.ready())
        await asyncio.gather(*starts)
        self.client = MeshClient([self.decode_address], [self.prefill_address] if self.with_prefill else (),
                                 PDDecider(min_uncached_tokens=0))
        self.cache = CacheClient(self.cache_address, timeout_s=5.0)
        self.prefill_stub = prefill_pb2_grpc.PrefillServiceStub(self._channel(self.prefill_address)) \
            if self.with_prefill else None
        self.decode_stub = decode_pb2_grpc.DecodeServiceStub(self._channel(self.decode_address))
        return self

    def _engine(self, role: str, overrides: dict) -> EngineArgs:
        return engine_args(self.model_dir, **{"tensor_parallel_size": self.tensor_parallel[role], **overrides})

    def _channel(self, address: str) -> grpc.aio.Channel:
        channel = grpc.aio.insecure_channel(address)
        self._channels.append(channel)
        return channel

    async def __aexit__(self, *exc) -> None:
        await self.client.close()
        await self.cache.close()
        for channel in self._channels:
            await channel.close()
        for server in (self.decode_server, self.prefill_server, self.cache_server):
            if server is not None:
                await server.stop(1.0)

    @property
    def prefill_worker(self):
        return self.prefill_server.worker

    @property
    def decode_worker(self):
        return self.decode_server.worker

    async def run(self, prompt: list[int], sampling: common_pb2.SamplingParams, route: str = "remote",
                  request_id: str | None = None, timeout_s: float = 60.0, media: tuple = ()) -> Run:
        """One request through the gateway's mesh client; route "remote" (prefill -> decode) or "local"."""
        client = self.client if route == "remote" else MeshClient([self.decode_address])
        request = MeshRequest(request_id=request_id or f"req-{random.getrandbits(48):x}",
                              prompt_token_ids=tuple(prompt), sampling=sampling, timeout_s=timeout_s,
                              media=tuple(media))
        run = Run()
        try:
            async with aclosing(client.generate(request)) as events:
                async for event in events:
                    run.events.append(event)
                    run.tokens.setdefault(event.index, []).extend(event.token_ids)
                    if event.finish_reason:
                        run.finish[event.index] = event.finish_reason
                    if event.usage is not None:
                        run.usage, run.route = event.usage, event.route
        finally:
            if client is not self.client:
                await client.close()
        return run

    async def run_direct(self, prompt: list[int], sampling: common_pb2.SamplingParams, route: str = "remote",
                         hints: tuple[int, ...] = (), tenant_salt: bytes = b"", timeout_s: float = 30.0) -> Run:
        """One request over the stubs: `Prefill` then `Decode` from its handoff ("remote"), or a local `Decode`."""
        request_id = f"direct-{random.getrandbits(48):x}"
        run, ids = Run(route=route), common_pb2.TokenIds(ids=prompt)
        generation = common_pb2.GenerationRequest(request_id=request_id, prompt=ids, sampling=sampling,
                                                  tenant_salt=tenant_salt, snapshot_hints=hints)
        request = decode_pb2.DecodeRequest(generation=generation)
        if route == "local":
            request.local.SetInParent()
        else:
            first = await self.prefill_stub.Prefill(prefill_pb2.PrefillRequest(generation=generation),
                                                    timeout=timeout_s)
            if first.finish_reason:
                run.tokens[0] = [first.first_token_id]
                run.usage = common_pb2.Usage(prompt_tokens=len(prompt), completion_tokens=1,
                                             cached_tokens=first.cached_tokens)
                return run
            request.handoff.CopyFrom(decode_pb2.HandoffSource(
                handoff_key=first.handoff_key, first_token_id=first.first_token_id, cached_tokens=first.cached_tokens))
        async for chunk in self.decode_stub.Decode(request, timeout=timeout_s):
            run.tokens.setdefault(chunk.index, []).extend(chunk.token_ids)
            if chunk.HasField("usage"):
                run.usage = chunk.usage
        return run

    async def drain(self) -> None:
        """Waits for background publications (snapshots) and claims (handoff removals)."""
        if self.prefill_server is not None:
            await self.prefill_worker.drain()
        await self.decode_worker.drain()
