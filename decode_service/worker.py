"""The decode worker: continues a request from a prefill handoff, or prefills it locally, and streams its tokens.

Contract (docs/architecture.md, "The mesh", step 3):
- `DecodeWorker.decode(job, handoff)` (a `worker.codec.GenerationJob`; `handoff` None: the local path) is an async
  iterator of `DecodeChunk`s (protos/decode.proto: the one output event a worker streams to the gateway) carrying
  every completion token of the request, the first one included, ending with one chunk per choice whose
  `finish_reason` is set; the last chunk of the stream carries `usage` and `used_handoff`. Each engine output's
  chunks go out as they come, except for a request the client reads whole (`GenerationRequest.output_interval_ms`
  set, a non-streamed API request): after its first chunk, its tokens are held back and merged, and sent once per
  interval (with the first engine output after it) and at the end.
- Handoff path (`handoff` set): one `BatchGet` fetches the handoff object (an `engine.transfer.RequestState` after
  all N prompt tokens, sampled token N+1 carried as its output) together with the prompt's full KV blocks, which the
  lean handoff names by hash (the worker computes the hashes from the prompt, its model fingerprint and the tenant
  salt, and checks them against the handoff's); a handoff stored as a manifest and parts (worker/handoff_parts.py)
  takes a second `BatchGet` for its parts, checked against the manifest's size and sha256. The state is verified (prompt, first token, token count, block
  hashes here; fingerprint, block size and shapes by `engine.transfer.stitch_handoff`, which also puts the full
  blocks back into a lean handoff) before anything is streamed; then the first token is streamed at once, the handoff is
  removed from the cache service (claimed), and the engine continues with continuous batching from token N+1.
- When the handoff cannot be used (cache service down, handoff expired, missing block, corrupt or mismatched object)
  the worker counts the failure and, with `kv_load_failure_policy="recompute"` (default), prefills the prompt itself
  (greedy and seeded outputs are unchanged); with `"fail"` it raises `HandoffUnavailableError`.
- Local path (`handoff` None, the colocated mode): the engine prefills (using its own prefix cache, and before
  that the longer prefix the cache service may hold — offloaded snapshots included — loaded as prefill loads it,
  worker/prefix.py; not with `load_remote_prefix=False`) and decodes; `n > 1` is served here. The job's structure hints (`snapshot_hints`) and the remote
  junction are snapshot points of the prompt (prefill_service/worker.py), on this path and on the recompute one.
- With a cache service, the snapshots the engine lets go — evicted ones, and a finished handoff's turn end (the state
  after its last full block of prompt + output, so the next turn, prefilled anywhere, hits the whole previous
  turn) — are offloaded to it with their blocks in the background (worker/offload.py); `drain()` waits for them.
- Leaving the iteration early (client cancel, deadline) aborts the engine request, which frees its blocks and slot.
- `await probe(prompt, salt)` answers how many leading prompt tokens this worker's prefix cache would serve (the
  engine's prefix hit rule) with the engine's load (running, waiting, KV usage); it runs between two engine steps
  (a hint for the gateway's P/D decider). The engine is reached only through `AsyncEngine`'s service API.
- Tracing (the tracer passed in; default the global provider's): a `decode` span per request (path "handoff",
  "local" or "recompute", output tokens, finish reason, cached tokens), with a `handoff.claim` child (objects, blocks
  and bytes fetched; `error.type` = the failure reason when the handoff is unusable). `counters` also counts the bytes
  and seconds of handoff fetches (the metrics read them).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from opentelemetry.trace import Tracer

from cache_service.client import CacheClient
from cache_service.objects import Status, object_key
from decode_service.config import KV_LOAD_FAILURE_POLICIES
from engine.async_engine import AsyncEngine
from engine.memory.policy import hint_points
from engine.outputs import RequestOutput
from engine.transfer import (CorruptObjectError, MissingBlockError, ModelMismatchError, RequestState,
                             ShapeMismatchError, TransferError, stitch_handoff)
from protos import common_pb2, decode_pb2
from telemetry import tracing
from worker.codec import FINISH_REASONS, GenerationJob, extend_chunk, output_chunk, prompt_logprobs_to_proto
from worker.handoff_parts import PartsError, join_parts, part_keys, read_manifest
from worker.offload import SnapshotPublisher
from worker.prefix import PrefixCounters, RemotePrefix
from worker.tenancy import engine_cache_salt, prompt_block_hashes
from worker.transfers import timed_get

log = logging.getLogger(__name__)

KV_BLOCK = common_pb2.OBJECT_KIND_KV_BLOCK
FINISH_NAMES = {code: name for name, code in FINISH_REASONS.items() if name is not None}  # for the span



class HandoffUnavailableError(RuntimeError):
    """The handoff could not be loaded and the policy is `fail`."""


@dataclass(frozen=True)
class Handoff:
    """Where prefill left the request."""

    key: common_pb2.ObjectKey
    first_token_id: int
    first_token_logprob: common_pb2.TokenLogprob | None = None  # passed through on the first chunk
    cached_tokens: int = 0  # prompt tokens prefill served from the cache


@dataclass
class DecodeCounters(PrefixCounters):
    """Counts since the worker started (read by tests and metrics); the remote prefix and offload counts are
    `PrefixCounters`' (worker/prefix.py)."""

    handoff_requests: int = 0
    handoff_loaded: int = 0
    handoff_failures: int = 0  # handoffs that could not be used
    recomputed: int = 0  # of those, prompts computed here instead
    local_requests: int = 0
    failure_reasons: dict[str, int] = field(default_factory=dict)
    handoff_bytes: int = 0  # handoff objects and blocks fetched from the cache service
    handoff_parts: int = 0  # parts of handoffs that came as a manifest and parts (worker/handoff_parts.py)
    handoff_seconds: float = 0.0  # wall time of those fetches


class _LoadFailure(Exception):
    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


# why a handoff the engine's checks refused is unusable, by the class of the error (first match)
_REFUSALS = ((MissingBlockError, "missing_block"), (ModelMismatchError, "mismatch"), (ShapeMismatchError, "mismatch"),
             (CorruptObjectError, "corrupt"), (TransferError, "corrupt"))


class DecodeWorker:
    def __init__(self, engine: AsyncEngine, cache: CacheClient | None, *, kv_load_failure_policy: str = "recompute",
                 load_remote_prefix: bool = True, tracer: Tracer | None = None):
        if kv_load_failure_policy not in KV_LOAD_FAILURE_POLICIES:
            raise ValueError(f"kv_load_failure_policy must be one of {KV_LOAD_FAILURE_POLICIES}")
        self.engine = engine
        self.tracer = tracer if tracer is not None else tracing.get_tracer("kdamesh.decode")
        self.cache = cache
        self.policy = kv_load_failure_policy
        self.layout = engine.layout
        self.fingerprint: bytes = self.layout.fingerprint
        self.counters = DecodeCounters()
        self._claims: set[asyncio.Task] = set()
        self.prefix = self.offload = None
        if cache is not None:
            self.prefix = RemotePrefix(engine, cache, self.tracer, self.counters, enabled=load_remote_prefix)
            self.offload = SnapshotPublisher(engine, cache, self.counters)
            self.offload.start()

    # -- probe ---------------------------------------------------------------------------------------------------

    async def probe(self, ids: list[int] | tuple[int, ...], tenant_salt: bytes) -> tuple[int, int, int, float]:
        """-> (leading prompt tokens the local prefix cache would serve, running, waiting, KV usage)."""
        hashes = prompt_block_hashes(self.layout, ids, tenant_salt) if ids else []
        cached, stats = await self.engine.probe_prefix(hashes, len(ids))
        return cached, stats.num_running, stats.num_waiting, stats.kv_usage

    # -- decode --------------------------------------------------------------------------------------------------

    async def decode(self, job: GenerationJob, handoff: Handoff | None = None) -> AsyncIterator[decode_pb2.DecodeChunk]:
        attributes = {tracing.REQUEST_ID: job.request_id, tracing.PROMPT_TOKENS: len(job.prompt_token_ids)}
        with tracing.child_span(self.tracer, "decode", attributes) as span:
            output_tokens, finish = 0, []
            async for chunk in self._decode(job, handoff):
                output_tokens += len(chunk.token_ids)
                if chunk.finish_reason:
                    finish.append(FINISH_NAMES[chunk.finish_reason])
                if chunk.HasField("usage"):
                    path = "local" if handoff is None else ("handoff" if chunk.used_handoff else "recompute")
                    tracing.set_attributes(span, {tracing.DECODE_PATH: path,
                                                  tracing.HIT_TOKENS: chunk.usage.cached_tokens})
                yield chunk
            tracing.set_attributes(span, {tracing.GEN_AI_USAGE_OUTPUT_TOKENS: output_tokens,
                                          tracing.GEN_AI_RESPONSE_FINISH_REASONS: tuple(finish) or None})

    async def _decode(self, job: GenerationJob, handoff: Handoff | None) -> AsyncIterator[decode_pb2.DecodeChunk]:
        hint_points(job.snapshot_hints, len(job.prompt_token_ids), self.layout.block_size)  # before anything runs
        if handoff is None:
            self.counters.local_requests += 1
            hints = job.snapshot_hints + await self._load_remote_prefix(job)
            async for chunk in self._generate(job, job.params.n, cached_tokens=None, hints=hints):
                yield chunk
            return
        self.counters.handoff_requests += 1
        try:
            state = await self._load_handoff(job, handoff)
        except _LoadFailure as exc:
            self.counters.handoff_failures += 1
            reasons = self.counters.failure_reasons
            reasons[exc.reason] = reasons.get(exc.reason, 0) + 1
            if self.policy == "fail":
                raise HandoffUnavailableError(f"handoff of {job.request_id!r} unavailable ({exc})") from None
            log.info("request %s: handoff unusable (%s); computing the prompt here", job.request_id, exc)
            self.counters.recomputed += 1
            async for chunk in self._generate(job, 1, cached_tokens=None):
                yield chunk
            return
        self.counters.handoff_loaded += 1
        async for chunk in self._continue(job, handoff, state):
            yield chunk

    async def _load_remote_prefix(self, job: GenerationJob) -> tuple[int, ...]:
        """Loads the cache service's longer prefix of a local prompt -> its remote junction, as a hint."""
        if self.prefix is None:
            return ()
        ids = job.prompt_token_ids
        hashes = prompt_block_hashes(self.layout, ids, job.tenant_salt)
        presence = await self.prefix.lookup(hashes, job.tenant_salt, len(ids))
        await self.prefix.load(len(ids), hashes, job.tenant_salt, presence)
        junction = self.prefix.junction(presence, len(ids))
        return (junction,) if junction else ()

    async def _generate(self, job: GenerationJob, n: int, cached_tokens: int | None,
                        hints: tuple[int, ...] | None = None) -> AsyncIterator[decode_pb2.DecodeChunk]:
        stream = self.engine.generate(job.request_id, {"prompt_token_ids": list(job.prompt_token_ids)}, job.params,
                                      priority=job.priority, cache_salt=engine_cache_salt(job.tenant_salt),
                                      deadline=job.deadline, media=job.media,
                                      snapshot_hints=job.snapshot_hints if hints is None else hints,
                                      tenant=job.tenant)
        async for chunk in self._chunks(stream, job, n, cached_tokens, used_handoff=False, carried=0):
            yield chunk

    async def _continue(self, job: GenerationJob, handoff: Handoff,
                        state: RequestState) -> AsyncIterator[decode_pb2.DecodeChunk]:
        first = decode_pb2.DecodeChunk(index=0, token_ids=[handoff.first_token_id], cached_tokens=handoff.cached_tokens)
        if handoff.first_token_logprob is not None:
            first.logprobs.append(handoff.first_token_logprob)
        yield first
        stream = self.engine.import_request(job.request_id, state, job.params, priority=job.priority,
                                            deadline=job.deadline, media=job.media, tenant=job.tenant)
        async for chunk in self._chunks(stream, job, 1, handoff.cached_tokens, used_handoff=True, carried=1,
                                         first=False):
            yield chunk

    async def _chunks(self, stream: AsyncIterator[RequestOutput], job: GenerationJob, n: int, cached_tokens: int | None,
                      used_handoff: bool, carried: int, first: bool = True) -> AsyncIterator[decode_pb2.DecodeChunk]:
        """Engine deltas -> chunks, each engine output's as it comes; the first chunk (when `first`) gets the cached
        tokens, the last the usage. With `job.output_interval_s` (a request the client reads whole) the chunks after
        the first are held back, merged per choice (`extend_chunk`), and sent with the first engine output that
        interval after the last send, and at the end: one message per choice and interval instead of one per
        token, on this loop and on the gateway's."""
        held: dict[int, decode_pb2.DecodeChunk] = {}  # choice -> its tokens not sent yet
        top = job.params.logprobs or 0
        totals = [carried] + [0] * (n - 1)
        sent_at = time.monotonic()
        async for out in stream:
            send_now = first or not job.output_interval_s or out.finished
            for c in out.outputs:
                totals[c.index] = len(c.token_ids)
                chunk = output_chunk(c.index, list(c.delta_token_ids), c.delta_logprobs, c.finish_reason,
                                     c.stop_reason, top)
                if first:
                    chunk.cached_tokens = out.num_cached_tokens if cached_tokens is None else cached_tokens
                    chunk.prompt_logprobs.extend(prompt_logprobs_to_proto(
                        out.prompt_logprobs, list(job.prompt_token_ids), job.params.prompt_logprobs or 0))
                    first = False
                if c.index in held:
                    extend_chunk(held[c.index], chunk)
                else:
                    held[c.index] = chunk
            if out.finished:
                cached = out.num_cached_tokens if cached_tokens is None else cached_tokens
                last = list(held.values())[-1] if held else held.setdefault(0, decode_pb2.DecodeChunk(index=0))
                last.usage.CopyFrom(common_pb2.Usage(prompt_tokens=len(job.prompt_token_ids),
                                                     completion_tokens=sum(totals), cached_tokens=cached))
                last.used_handoff = used_handoff
            if held and (send_now or time.monotonic() - sent_at >= job.output_interval_s):
                for chunk in held.values():
                    yield chunk
                held, sent_at = {}, time.monotonic()
        for chunk in held.values():  # the stream ended without a finished output (not expected): what is left
            yield chunk

    # -- the handoff ---------------------------------------------------------------------------------------------

    async def _load_handoff(self, job: GenerationJob, handoff: Handoff) -> RequestState:
        if self.cache is None:
            raise _LoadFailure("no_cache_service", "this worker has no cache service")
        if job.params.n != 1:
            raise _LoadFailure("n", "a handoff carries one sequence")
        hashes = prompt_block_hashes(self.layout, job.prompt_token_ids, job.tenant_salt, job.media)
        key = handoff.key
        keys = [key] + [object_key(key.model_fingerprint, key.tenant_salt, KV_BLOCK, h) for h in hashes]
        with tracing.child_span(self.tracer, "handoff.claim", {tracing.KEYS: len(keys),
                                                               tracing.BLOCKS: len(hashes)}) as span:
            got, nbytes, seconds = await timed_get(self.cache, keys, span)
            self.counters.handoff_bytes += nbytes
            self.counters.handoff_seconds += seconds
            try:
                if got[0].status != Status.FOUND:
                    raise _LoadFailure(got[0].status.name.lower(), got[0].message or "handoff not found")
                data = await self._whole_handoff(key, got[0].data, span)
                blocks = [r.data if r.status == Status.FOUND else None for r in got[1:]]
                return await asyncio.to_thread(self._assemble, job, handoff, data, hashes, blocks)
            except _LoadFailure as exc:
                tracing.mark_error(span, exc.reason, str(exc))
                raise

    async def _whole_handoff(self, key: common_pb2.ObjectKey, data: bytes, span) -> bytes:
        """The handoff's bytes — fetched part by part when `data` is a manifest (worker/handoff_parts.py) — claimed."""
        try:
            manifest = read_manifest(data)
        except PartsError as exc:
            raise _LoadFailure("corrupt", str(exc)) from None
        if manifest is None:
            self._claim([key])
            return data
        keys = part_keys(key, manifest)
        got, nbytes, seconds = await timed_get(self.cache, keys, span)
        self.counters.handoff_bytes += nbytes
        self.counters.handoff_seconds += seconds
        self.counters.handoff_parts += manifest.parts
        self._claim([key, *keys])
        try:
            return join_parts(manifest, [r.data if r.status == Status.FOUND else None for r in got])
        except PartsError as exc:
            raise _LoadFailure("missing_part" if "missing" in str(exc) else "corrupt", str(exc)) from None

    def _claim(self, keys: list[common_pb2.ObjectKey]) -> None:
        """Removes the handoff from the cache service (in the background: nobody else may use it)."""
        task = asyncio.create_task(self.cache.remove(keys))
        self._claims.add(task)
        task.add_done_callback(self._claims.discard)

    def _assemble(self, job: GenerationJob, handoff: Handoff, data: bytes, hashes: list[bytes],
                  blocks: list[bytes | None]) -> RequestState:
        """Parses and checks the handoff, filling the full blocks a lean handoff leaves out. Runs in a thread."""
        try:
            state = RequestState.from_bytes(data)
        except TransferError as exc:
            raise _LoadFailure("corrupt", str(exc)) from None
        n = len(job.prompt_token_ids)
        if (state.prompt_token_ids != list(job.prompt_token_ids) or state.num_computed_tokens != n
                or state.output_token_ids != [handoff.first_token_id]):
            raise _LoadFailure("mismatch", "the handoff belongs to another prompt or first token")
        if state.block_hashes != hashes[: n // self.layout.block_size]:
            raise _LoadFailure("mismatch", "the handoff's block hashes differ from this prompt's")
        try:
            return stitch_handoff(state, blocks[: len(state.block_hashes)], self.layout)
        except TransferError as exc:
            reason = next(why for kind, why in _REFUSALS if isinstance(exc, kind))
            raise _LoadFailure(reason, str(exc)) from None

    async def drain(self) -> None:
        """Waits for background handoff removals and snapshot offloads."""
        while self._claims:
            await asyncio.gather(*list(self._claims), return_exceptions=True)
        if self.offload is not None:
            await self.offload.drain()
