"""The prefill worker: a prompt in, its first output token and a handoff object for decode out.

Contract (docs/architecture.md, "The mesh", step 2, and "Exactly-once handoff"):
- `PrefillWorker.prefill(job, handoff_ttl_s)` (a `worker.codec.GenerationJob`; TTL None: the cache service's handoff
  default) consumes all N prompt tokens and samples token N+1, then publishes to the cache service
  one `BatchPut` holding the prompt's full KV blocks the service lacks and the handoff object, and returns a
  `PrefillResult` (first token, handoff key, cached tokens, timings). Decode continues from the state after N tokens
  with token N+1 as its first input, so every prompt token is applied to the KDA state exactly once.
- Before computing, the worker loads the longest prefix the cache service can serve (worker/prefix.py: the engine's
  prefix hit rule, every block up to a boundary present **and** a KDA snapshot at that boundary, leaving at least
  one token to compute) when it is longer than what its own prefix cache holds: the blocks and the snapshot are
  imported into the engine's prefix cache, and the engine's ordinary prefix hit then uses them. A load that fails
  (missing, corrupt, service down) is counted and the prompt is computed instead; it never fails the request.
- Snapshot points: the job's structure hints (`snapshot_hints`, checked before anything runs) and the remote
  junction — where the prompt leaves the blocks the cache service holds without a snapshot there — are passed to
  the engine as hints, so those states are snapshotted (and published below) for the next prompt on that prefix.
- The handoff object is an `engine.transfer.RequestState` (layout `request_state/v1`): the sampler state, the KDA
  state after the whole prompt and, by default, only the KV of the tail partial block (`transfer.lean_handoff`:
  `kv` holds the last `ceil(N/bs) - N//bs` blocks); the full blocks travel as ordinary content-addressed
  `KV_BLOCK` objects named by `block_hashes`, which decode fetches with the handoff. `handoff_full_kv=True` puts
  every block in the handoff. What goes out in which order is worker/handoff_publish.py's: a handoff bigger than
  `handoff_part_bytes` streams — a manifest and the head pieces are stored before `prefill` returns, the blocks
  follow in the background in groups, each block hashed on its own — so no object exceeds the cache service's
  object cap and the decode side imports block k while block k+1 is on its way.
- When the first token already ends the output (EOS / stop token / stop string, or `max_tokens == 1`) no handoff is
  published and `finish_reason` is set.
- KDA state snapshots the engine took at this prompt's block boundaries are published after the response, in the
  background (reading them waits for the engine's next step); snapshots the engine evicts are offloaded to the cache
  service with their blocks (worker/offload.py); `drain()` waits for both.
- The engine is reached only through `AsyncEngine`'s service API (never `EngineCore` from the event loop).
- Errors: `InvalidRequestError` for a bad request (n > 1, prompt too long, bad parameters) before anything runs;
  `HandoffPublishError` when the handoff could not be stored (the caller should prefill elsewhere or colocate);
  `RequestTimeoutError` past the deadline.
- Tracing (the tracer passed in; default the global provider's): a `prefill` span per request (prompt, cached and
  hit tokens, handoff bytes, published blocks), with children `prefix.lookup` and `prefix.load` (worker/prefix.py)
  and `handoff.publish` (objects, blocks and bytes stored); a failure sets `error.type`. `counters` also counts the bytes and seconds of every
  transfer to and from the cache service (the metrics read them).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
import time
import uuid
from dataclasses import dataclass, field

from opentelemetry.trace import Tracer

from cache_service.client import CacheClient, PutObject
from cache_service.objects import Status, object_key
from engine.async_engine import AsyncEngine
from engine.errors import InvalidRequestError
from engine.memory.policy import hint_points
from engine.outputs import PositionLogprobs, RequestOutput
from engine.transfer import RequestState
from protos import common_pb2
from telemetry import tracing
from worker.codec import GenerationJob
from worker.offload import SnapshotPublisher
from worker.prefix import PrefixCounters, RemotePrefix
from worker.tenancy import engine_cache_salt, prompt_block_hashes
from worker.handoff_publish import HandoffPublisher, HandoffPublishError  # noqa: F401 - raised by publish, re-exported
from worker.transfers import timed_put

log = logging.getLogger(__name__)

SNAPSHOT = common_pb2.OBJECT_KIND_STATE_SNAPSHOT
HANDOFF = common_pb2.OBJECT_KIND_HANDOFF


class PrefillAbortedError(RuntimeError):
    """The engine ended the request without a first token (aborted, e.g. while shutting down)."""


@dataclass(frozen=True)
class PrefillTimings:
    """Milliseconds, wall clock."""

    load_ms: float = 0.0  # remote prefix lookup and load
    compute_ms: float = 0.0  # engine queue + compute of the uncached tokens + first sample
    publish_ms: float = 0.0  # serialising and storing blocks and the handoff
    total_ms: float = 0.0


@dataclass(frozen=True)
class PrefillResult:
    request_id: str
    first_token_id: int
    first_token_logprobs: PositionLogprobs | None  # engine form: token id -> Logprob (sampled + top k)
    finish_reason: str | None  # "stop" | "length" when the first token ends the output; None: decode continues
    stop_reason: int | str | None
    handoff_key: common_pb2.ObjectKey | None  # None when finish_reason is set
    prompt_tokens: int
    cached_tokens: int
    handoff_bytes: int = 0
    published_blocks: int = 0
    timings: PrefillTimings = field(default_factory=PrefillTimings)
    prompt_logprobs: list[PositionLogprobs | None] | None = None  # `prompt_logprobs=k`: None first (engine form)
    prompt_token_ids: list[int] = field(default_factory=list)


@dataclass
class PrefillCounters(PrefixCounters):
    """Counts since the worker started (read by tests and metrics); the remote prefix and offload counts are
    `PrefixCounters`' (worker/prefix.py)."""

    requests: int = 0
    published_blocks: int = 0
    published_snapshots: int = 0
    publish_failures: int = 0  # objects the cache service did not store
    # transfers to the cache service: payload bytes, and the wall time of the calls (seconds)
    published_bytes: int = 0  # blocks, handoffs and snapshots put
    handoff_parts: int = 0  # head pieces and block parts of streamed handoffs (worker/handoff_parts.py)
    publish_seconds: float = 0.0


class PrefillWorker:
    """Runs prefills on an `AsyncEngine` and hands them off through a `CacheClient` (see the module docstring)."""

    def __init__(self, engine: AsyncEngine, cache: CacheClient, *, handoff_full_kv: bool = False,
                 load_remote_prefix: bool = True, tracer: Tracer | None = None, handoff_part_bytes: int = 256 << 20):
        self.engine = engine
        self.tracer = tracer if tracer is not None else tracing.get_tracer("kdamesh.prefill")
        self.cache = cache
        self.handoff_full_kv = handoff_full_kv
        self.handoff_part_bytes = handoff_part_bytes  # a bigger handoff streams (worker/handoff_publish.py)
        self.load_remote_prefix = load_remote_prefix
        self.layout = engine.layout
        self.fingerprint: bytes = self.layout.fingerprint
        self.block_size: int = self.layout.block_size
        self.has_kda = self.layout.has_kda
        self.counters = PrefillCounters()
        self.prefix = RemotePrefix(engine, cache, self.tracer, self.counters, enabled=load_remote_prefix)
        self.offload = SnapshotPublisher(engine, cache, self.counters)
        self.offload.start()
        self.handoffs = HandoffPublisher(cache, self.fingerprint, handoff_part_bytes, handoff_full_kv, self.counters)
        self._background: set[asyncio.Task] = set()

    # -- the request -------------------------------------------------------------------------------------------

    async def prefill(self, job: GenerationJob, handoff_ttl_s: float | None = None) -> PrefillResult:
        attributes = {tracing.REQUEST_ID: job.request_id, tracing.PROMPT_TOKENS: len(job.prompt_token_ids)}
        with tracing.child_span(self.tracer, "prefill", attributes) as span:
            result = await self._prefill(job, handoff_ttl_s)
            tracing.set_attributes(span, {
                tracing.HIT_TOKENS: result.cached_tokens, tracing.BYTES: result.handoff_bytes,
                tracing.BLOCKS: result.published_blocks, "kdamesh.first_token_id": result.first_token_id,
                "kdamesh.finish_reason": result.finish_reason})
            return result

    async def _prefill(self, job: GenerationJob, handoff_ttl_s: float | None) -> PrefillResult:
        t0 = time.perf_counter()
        self.counters.requests += 1
        ids = list(job.prompt_token_ids)
        params = job.params
        if params.n != 1:
            raise InvalidRequestError("prefill hands off one sequence (n == 1); serve n > 1 colocated", param="n")
        _, _, max_tokens = self.engine.validate_prompt(ids, params)  # before anything runs
        hint_points(job.snapshot_hints, len(ids), self.block_size)
        salt = job.tenant_salt
        hashes = prompt_block_hashes(self.layout, ids, salt, job.media)

        presence = await self.prefix.lookup(hashes, salt, len(ids))
        await self.prefix.load(len(ids), hashes, salt, presence)
        junction = self.prefix.junction(presence, len(ids))
        t_loaded = time.perf_counter()

        final = await self._compute(job, ids, job.snapshot_hints + ((junction,) if junction else ()))
        t_computed = time.perf_counter()
        completion = final.outputs[0]
        state: RequestState = final.exported
        first = completion.token_ids[0]
        finish = completion.finish_reason
        if finish == "length" and max_tokens > 1:
            finish = None  # only prefill's own one-token limit: decode continues

        handoff_key, handoff_bytes, published = await self._publish(
            job, state, hashes, presence.blocks, with_handoff=finish is None, handoff_ttl_s=handoff_ttl_s)
        self._publish_snapshots_later(hashes, presence.snapshots, salt)
        t_done = time.perf_counter()
        return PrefillResult(
            request_id=job.request_id, first_token_id=first,
            first_token_logprobs=completion.logprobs[0] if completion.logprobs else None,
            finish_reason=finish, stop_reason=completion.stop_reason if finish else None,
            handoff_key=handoff_key, prompt_tokens=len(ids), cached_tokens=final.num_cached_tokens,
            handoff_bytes=handoff_bytes, published_blocks=published, prompt_logprobs=final.prompt_logprobs,
            prompt_token_ids=list(ids),
            timings=PrefillTimings(load_ms=(t_loaded - t0) * 1e3, compute_ms=(t_computed - t_loaded) * 1e3,
                                   publish_ms=(t_done - t_computed) * 1e3, total_ms=(t_done - t0) * 1e3))

    async def _compute(self, job: GenerationJob, ids: list[int], hints: tuple[int, ...]) -> RequestOutput:
        """Runs the prompt and samples one token with the request's parameters; returns the final output."""
        one = dataclasses.replace(job.params, max_tokens=1, min_tokens=min(job.params.min_tokens, 1))
        final = None
        async for out in self.engine.generate(job.request_id, {"prompt_token_ids": ids}, one,
                                              priority=job.priority, cache_salt=engine_cache_salt(job.tenant_salt),
                                              export_on_finish=True, deadline=job.deadline, media=job.media,
                                              snapshot_hints=hints, tenant=job.tenant):
            final = out
        if final is None or final.exported is None:
            raise PrefillAbortedError(f"request {job.request_id!r} was aborted before its first token")
        return final

    # -- publishing ---------------------------------------------------------------------------------------------

    async def _publish(self, job: GenerationJob, state: RequestState, hashes: list[bytes], remote_blocks: list[bool],
                       with_handoff: bool, handoff_ttl_s: float | None) -> tuple[common_pb2.ObjectKey | None, int, int]:
        """Stores the prompt's full blocks the service lacks and (`with_handoff`) the handoff
        (worker/handoff_publish.py). -> (handoff key or None, handoff bytes, blocks stored before returning).
        Raises HandoffPublishError."""
        missing = [i for i, present in enumerate(remote_blocks) if not present]
        handoff_key = None
        if with_handoff:
            nonce = hashlib.sha256(f"{job.request_id}\0{uuid.uuid4().hex}".encode()).digest()
            handoff_key = object_key(self.fingerprint, job.tenant_salt, HANDOFF, nonce)
        with tracing.child_span(self.tracer, "handoff.publish", {"kdamesh.handoff": with_handoff}) as span:
            published = await self.handoffs.publish(handoff_key, job.tenant_salt, state, hashes, missing,
                                                    handoff_ttl_s)
            tracing.set_attributes(span, {tracing.KEYS: published.objects, tracing.BLOCKS: len(missing),
                                          tracing.BYTES: published.stored_bytes,
                                          "kdamesh.handoff.bytes": published.handoff_bytes,
                                          "kdamesh.handoff.streamed": published.streamed,
                                          "kdamesh.blocks_stored": published.blocks})
            if not with_handoff and published.blocks < len(missing):
                tracing.mark_error(span, "blocks_not_stored", f"{len(missing) - published.blocks} blocks not stored")
        return handoff_key, published.handoff_bytes, published.blocks

    def _publish_snapshots_later(self, hashes: list[bytes], remote_snaps: list[bool], salt: bytes) -> None:
        todo = [h for h, present in zip(hashes, remote_snaps) if not present] if self.has_kda else []
        if not todo:
            return
        task = asyncio.create_task(self._publish_snapshots(todo, salt))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _publish_snapshots(self, hashes: list[bytes], salt: bytes) -> None:
        try:
            snapshots = await self.engine.export_snapshots(hashes)
        except Exception as exc:  # noqa: BLE001 - a background best effort; the engine may be shutting down
            log.debug("snapshot export skipped: %r", exc)
            return
        if not snapshots:
            return
        objects = [PutObject(object_key(self.fingerprint, salt, SNAPSHOT, h), data) for h, data in snapshots]
        results, nbytes, seconds = await timed_put(self.cache, objects)
        self.counters.published_bytes += nbytes
        self.counters.publish_seconds += seconds
        stored = sum(1 for r in results if r.status == Status.STORED)
        self.counters.published_snapshots += stored
        self.counters.publish_failures += len(results) - stored

    async def drain(self) -> None:
        """Waits for the background block groups, snapshot publications and offloads started so far."""
        await self.handoffs.drain()
        while self._background:
            await asyncio.gather(*list(self._background), return_exceptions=True)
        await self.offload.drain()
