"""The decode worker: continues a request from a prefill handoff, or prefills it locally, and streams its tokens.

Contract (docs/architecture.md, "The mesh", step 3):
- `DecodeWorker.decode(job, handoff)` (a `worker.codec.GenerationJob`; `handoff` None: the local path) is an async
  iterator of `DecodeChunk`s (protos/decode.proto: the one output event a worker streams to the gateway) carrying
  every completion token of the request, the first one included, ending with one chunk per choice whose
  `finish_reason` is set; the last chunk of the stream carries `usage` and `used_handoff` (whether the handoff's KV
  was used). Each engine output's chunks go out as they come, except for a request the client reads whole
  (`GenerationRequest.output_interval_ms` set, a non-streamed API request): after its first chunk, its tokens are
  held back and merged, and sent once per interval (with the first engine output after it) and at the end.
- Handoff path (`handoff` set): worker/handoff_fetch.py reads the handoff object (an `engine.transfer.RequestState`
  after all N prompt tokens, sampled token N+1 carried as its output; or a streamed handoff's manifest and head
  pieces, worker/handoff_parts.py) with the first group of the prompt's full KV blocks, which the lean handoff names
  by hash (the worker computes the hashes from the prompt, its model fingerprint and the tenant salt, and checks
  them against the handoff's), then the other groups — only the blocks the engine's prefix cache lacks when it has
  room (a later turn reads only the new tail), each checked block by block on a thread pool and, for a handoff of
  several groups or one whose other blocks are held here, written into the engine's pools as it arrives while the
  next is fetched (`handoff_fetch_bytes` per group; a streamed handoff's blocks not published yet are waited for,
  at most `handoff_part_wait_s` per wait). The handoff's own objects are removed from the cache service (claimed)
  once read or given up, also when the client leaves in between. The head state is verified (prompt, first token,
  token count, block hashes here; fingerprint, block size and shapes by `engine.transfer.check_request_state`)
  before anything is streamed. With `kv_load_failure_policy="recompute"` (default) the first token (N+1, from the
  `Handoff`) is streamed as soon as the head is verified, before the blocks are read — a long prompt's blocks no
  longer delay it; with `"fail"` it is streamed once everything is loaded (a failure must be an error before any
  token). Then the engine continues with continuous batching from token N+1.
- When the handoff cannot be used (cache service down, handoff expired, missing block, corrupt or mismatched object,
  a part still missing after `handoff_part_wait_s`, an engine pool that cannot take a group) the worker counts the
  failure (by reason: `handoff_failures`, `failure_reasons`) and, with `"recompute"`, computes it here (counted in
  `recomputed`; greedy and seeded outputs are unchanged): a head that could not be read or verified (nothing sent
  yet) prefills the prompt from scratch; a failure after the first token was sent (a block missing, corrupt or
  late, no room) imports the verified head lean: the engine computes the prompt and the carried first token from
  the tokens (resuming from the longest prefix its cache can, the blocks imported so far included) and continues
  after that token with the carried sampler seed — the first token is neither sampled again nor sent twice; the
  usage's cached tokens are the handoff's (as the first chunk said) and the final chunk's `used_handoff` is false
  (the path is "recompute"). With `"fail"` it raises `HandoffUnavailableError`.
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
from contextlib import aclosing
from dataclasses import dataclass, field

from opentelemetry.trace import Tracer

from cache_service.client import CacheClient
from decode_service.config import KV_LOAD_FAILURE_POLICIES
from engine.async_engine import AsyncEngine
from engine.memory.policy import hint_points
from engine.outputs import RequestOutput
from engine.transfer import RequestState
from protos import common_pb2, decode_pb2
from telemetry import tracing
from worker.codec import FINISH_REASONS, GenerationJob, extend_chunk, output_chunk, prompt_logprobs_to_proto
from worker.handoff_fetch import FetchCounters, HandoffFetcher, Loaded, Opened, Unusable
from worker.offload import SnapshotPublisher
from worker.prefix import PrefixCounters, RemotePrefix
from worker.tenancy import engine_cache_salt, prompt_block_hashes

log = logging.getLogger(__name__)

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
class _HandoffRead:
    """What reading one handoff got: the head (`opened`), the blocks too (`loaded`), or why not (`failure`)."""

    failure: Unusable | None = None
    opened: Opened | None = None
    loaded: Loaded | None = None
    first_sent: bool = False  # the first token's chunk went out once the head was checked


def first_chunk(handoff: Handoff) -> decode_pb2.DecodeChunk:
    """The first token (N+1, sampled by the prefill) as the stream's first chunk."""
    chunk = decode_pb2.DecodeChunk(index=0, token_ids=[handoff.first_token_id], cached_tokens=handoff.cached_tokens)
    if handoff.first_token_logprob is not None:
        chunk.logprobs.append(handoff.first_token_logprob)
    return chunk


@dataclass
class DecodeCounters(PrefixCounters, FetchCounters):
    """Counts since the worker started (read by tests and metrics); the remote prefix and offload counts are
    `PrefixCounters`' (worker/prefix.py), the bytes, seconds, parts and groups of handoff reads `FetchCounters'`
    (worker/handoff_fetch.py)."""

    handoff_requests: int = 0
    handoff_loaded: int = 0
    handoff_failures: int = 0  # handoffs that could not be used
    recomputed: int = 0  # of those, prompts computed here instead
    local_requests: int = 0
    failure_reasons: dict[str, int] = field(default_factory=dict)


class DecodeWorker:
    def __init__(self, engine: AsyncEngine, cache: CacheClient | None, *, kv_load_failure_policy: str = "recompute",
                 load_remote_prefix: bool = True, tracer: Tracer | None = None, handoff_fetch_bytes: int = 64 << 20,
                 handoff_part_wait_s: float = 10.0):
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
        self.prefix = self.offload = self.fetcher = None
        if cache is not None:
            self.fetcher = HandoffFetcher(cache, engine, handoff_fetch_bytes, handoff_part_wait_s, self.counters,
                                          self._claim)
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
        async for chunk in self._from_handoff(job, handoff):
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

    async def _continue(self, job: GenerationJob, handoff: Handoff, state: RequestState, lean: bool,
                        used_handoff: bool) -> AsyncIterator[decode_pb2.DecodeChunk]:
        """The engine continues the imported `state` after its carried first token (already sent)."""
        stream = self.engine.import_request(job.request_id, state, job.params, priority=job.priority,
                                            deadline=job.deadline, media=job.media, tenant=job.tenant, lean=lean)
        async for chunk in self._chunks(stream, job, 1, handoff.cached_tokens, used_handoff=used_handoff, carried=1,
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

    async def _from_handoff(self, job: GenerationJob, handoff: Handoff) -> AsyncIterator[decode_pb2.DecodeChunk]:
        """The handoff path (module docstring): the first token, then the rest from the handoff's KV, or computed
        here when it is unusable."""
        read = _HandoffRead(failure=self._refusal(job))
        if read.failure is None:
            async with aclosing(self._read_handoff(job, handoff, read)) as firsts:
                async for first in firsts:
                    yield first
        if read.failure is not None:
            self._count_failure(job, read.failure, first_sent=read.first_sent)  # raises with policy "fail"
        if read.opened is None:  # nothing sent yet: the prompt is computed here from scratch
            async for chunk in self._generate(job, 1, cached_tokens=None):
                yield chunk
            return
        if not read.first_sent:
            yield first_chunk(handoff)
        if read.loaded is not None:
            self.counters.handoff_loaded += 1
            state, lean = read.loaded.state, read.loaded.lean
        else:  # the blocks failed after the first token: the opened head, computed from its tokens by the engine
            state, lean = read.opened.state, True
        async for chunk in self._continue(job, handoff, state, lean, used_handoff=read.loaded is not None):
            yield chunk

    async def _read_handoff(self, job: GenerationJob, handoff: Handoff,
                            read: _HandoffRead) -> AsyncIterator[decode_pb2.DecodeChunk]:
        """Opens the handoff, yields the first token's chunk there with policy "recompute", then reads the blocks;
        what it got (or why not) is left in `read`. The handoff's objects are claimed whatever happens."""
        hashes = prompt_block_hashes(self.layout, job.prompt_token_ids, job.tenant_salt, job.media)
        with tracing.child_span(self.tracer, "handoff.claim", {tracing.KEYS: 1 + len(hashes),
                                                               tracing.BLOCKS: len(hashes)}) as span:
            try:
                read.opened = await self.fetcher.open(
                    handoff.key, hashes, lambda s: self._check(job, handoff, s, hashes), span, job.deadline)
                if self.policy == "recompute":  # its failures continue after this token: it can go out now
                    read.first_sent = True
                    yield first_chunk(handoff)
                read.loaded = await self.fetcher.finish(read.opened)
            except Unusable as exc:
                tracing.mark_error(span, exc.reason, str(exc))
                read.failure = exc
            finally:
                if read.opened is not None:
                    self.fetcher.release(read.opened)

    def _refusal(self, job: GenerationJob) -> Unusable | None:
        """Why this worker cannot take the request's handoff at all, before reading anything."""
        if self.fetcher is None:
            return Unusable("no_cache_service", "this worker has no cache service")
        if job.params.n != 1:
            return Unusable("n", "a handoff carries one sequence")
        return None

    def _count_failure(self, job: GenerationJob, exc: Unusable, first_sent: bool) -> None:
        """Counts an unusable handoff; raises `HandoffUnavailableError` with policy "fail"."""
        self.counters.handoff_failures += 1
        reasons = self.counters.failure_reasons
        reasons[exc.reason] = reasons.get(exc.reason, 0) + 1
        if self.policy == "fail":
            raise HandoffUnavailableError(f"handoff of {job.request_id!r} unavailable ({exc})") from None
        after = " after its first token" if first_sent else ""
        log.info("request %s: handoff unusable%s (%s); computing the prompt here", job.request_id, after, exc)
        self.counters.recomputed += 1

    def _claim(self, keys: list[common_pb2.ObjectKey]) -> None:
        """Removes the handoff's objects from the cache service (in the background: nobody else may use them)."""
        task = asyncio.create_task(self.cache.remove(keys))
        self._claims.add(task)
        task.add_done_callback(self._claims.discard)

    def _check(self, job: GenerationJob, handoff: Handoff, state: RequestState, hashes: list[bytes]) -> None:
        """The handoff belongs to this request: prompt, token count, first token, block hashes (runs in a thread)."""
        n = len(job.prompt_token_ids)
        if (state.prompt_token_ids != list(job.prompt_token_ids) or state.num_computed_tokens != n
                or state.output_token_ids != [handoff.first_token_id]):
            raise Unusable("mismatch", "the handoff belongs to another prompt or first token")
        if state.block_hashes != hashes[: n // self.layout.block_size]:
            raise Unusable("mismatch", "the handoff's block hashes differ from this prompt's")

    async def drain(self) -> None:
        """Waits for background handoff removals and snapshot offloads."""
        while self._claims:
            await asyncio.gather(*list(self._claims), return_exceptions=True)
        if self.offload is not None:
            await self.offload.drain()
