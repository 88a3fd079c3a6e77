"""The prefill side of a handoff: what goes to the cache service, in which order, and when the caller may go on.

Contract (`HandoffPublisher(cache, fingerprint, part_bytes, full_kv, counters)`;
`await publish(key, salt, state, hashes, missing, ttl_s) -> Published`): `state` is the request's exported
`RequestState` (all N prompt tokens, token N+1 carried), `hashes` the prompt's full-block hashes, `missing` the
indices of the full blocks the cache service lacks (published as content-addressed KV_BLOCK objects, which the
prefix cache shares), `key` the handoff's key (None: the output already ended, only the blocks go).
- Whole: when the lean handoff (`transfer.lean_handoff`) and the blocks to publish fit in `part_bytes`, one
  BatchPut holds the blocks and the handoff object (the lean state; with `full_kv` the whole state).
- Streamed (more than that): the manifest and the head pieces (worker/handoff_parts.py) go first, in one
  BatchPut, and `publish` returns once they are stored; the blocks follow in the background, in order, in groups
  of about `part_bytes`: group k+1 is serialised (each block hashed on its own, on worker/hash_pool.py's threads)
  while group k is being sent. With `full_kv` every full block is also a part of the handoff (request-scoped, with
  the handoff's TTL). The decode side reads block k while block k+1 is on its way (worker/handoff_fetch.py).
- A handoff object or head piece the service did not store raises `HandoffPublishError`. A background group the
  service refuses stops the rest (the decode side waits for the block until its deadline, then recomputes) and
  counts as a publish failure. `drain()` waits for the background groups.
- Counters (duck-typed: `PrefillCounters`): bytes and seconds put, blocks stored, failures, handoff parts.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass

from cache_service.client import CacheClient, PutObject
from cache_service.objects import Status, object_key
from engine.transfer import RequestState, encode_block, lean_handoff
from protos import common_pb2
from worker.handoff_parts import manifest_bytes, part_key, split_head
from worker.hash_pool import parallel_map
from worker.transfers import timed_put

log = logging.getLogger(__name__)

KV_BLOCK = common_pb2.OBJECT_KIND_KV_BLOCK
BLOCK_HEADER_BYTES = 512  # a kv_block/v1 object's header, about (for sizing only)


class HandoffPublishError(RuntimeError):
    """The handoff object could not be stored in the cache service (the request cannot be handed to decode)."""


@dataclass(frozen=True)
class Published:
    handoff_bytes: int  # the handoff object (or manifest and head pieces) and its block parts
    blocks: int  # content blocks stored before `publish` returned (streamed: the rest are on their way)
    streamed: bool
    objects: int = 0  # objects put before `publish` returned (blocks and handoff pieces)
    stored_bytes: int = 0  # their bytes


@dataclass(frozen=True)
class _Job:
    key: common_pb2.ObjectKey | None
    salt: bytes
    state: RequestState
    hashes: list[bytes]
    missing: list[int]
    ttl_s: float | None


class HandoffPublisher:
    def __init__(self, cache: CacheClient, fingerprint: bytes, part_bytes: int, full_kv: bool, counters):
        if part_bytes <= 0:
            raise ValueError(f"part_bytes must be positive, got {part_bytes}")
        self.cache = cache
        self.fingerprint = fingerprint
        self.part_bytes = part_bytes
        self.full_kv = full_kv
        self.counters = counters
        self._background: set[asyncio.Task] = set()

    async def publish(self, key: common_pb2.ObjectKey | None, salt: bytes, state: RequestState, hashes: list[bytes],
                      missing: list[int], ttl_s: float | None) -> Published:
        job = _Job(key, salt, state, hashes, missing, ttl_s)
        lean = await asyncio.to_thread(lean_handoff(state).to_bytes) if key is not None else b""
        full = len(hashes) if key is not None and self.full_kv else 0
        block_bytes = state.kv[:, :1].numel() * state.kv.element_size() + BLOCK_HEADER_BYTES
        if key is None or len(lean) + block_bytes * (len(missing) + full) <= self.part_bytes:
            return await self._whole(job, lean)
        return await self._streamed(job, lean, block_bytes)

    async def drain(self) -> None:
        while self._background:
            await asyncio.gather(*list(self._background), return_exceptions=True)

    # -- whole ----------------------------------------------------------------------------------------------------

    async def _whole(self, job: _Job, lean: bytes) -> Published:
        def serialise() -> list[PutObject]:
            objects = self._block_objects(job, job.missing, head_pieces=0, parts=False)
            if job.key is not None:
                handoff = job.state.to_bytes() if self.full_kv else lean
                objects.append(PutObject(job.key, handoff, job.ttl_s))
            return objects

        objects = await asyncio.to_thread(serialise)
        results = await self._put(objects)
        stored = self._count_blocks(results[:len(job.missing)])
        handoff = objects[len(job.missing):]
        self._require_stored(results[len(job.missing):], bool(handoff))
        return Published(sum(len(o.data) for o in handoff), stored, streamed=False, objects=len(objects),
                         stored_bytes=sum(len(o.data) for o in objects))

    # -- streamed -------------------------------------------------------------------------------------------------

    async def _streamed(self, job: _Job, lean: bytes, block_bytes: int) -> Published:
        def head() -> list[PutObject]:
            pieces = split_head(lean, self.part_bytes)
            manifest = manifest_bytes(pieces, len(job.hashes), self.full_kv)
            return [PutObject(job.key, manifest, job.ttl_s)] + [
                PutObject(part_key(job.key, i), p, job.ttl_s) for i, p in enumerate(pieces)]

        objects = await asyncio.to_thread(head)
        results = await self._put(objects)
        self.counters.handoff_parts += len(objects) - 1
        try:
            self._require_stored(results, True)
        except HandoffPublishError:
            await self.cache.remove([o.key for o in objects])
            raise
        todo = list(range(len(job.hashes))) if self.full_kv else list(job.missing)
        per_group = max(1, self.part_bytes // block_bytes)
        groups = [todo[a:a + per_group] for a in range(0, len(todo), per_group)]
        if groups:
            task = asyncio.create_task(self._publish_groups(job, len(objects) - 1, groups))
            self._background.add(task)
            task.add_done_callback(self._background.discard)
        nbytes = sum(len(o.data) for o in objects) + (block_bytes * len(job.hashes) if self.full_kv else 0)
        return Published(nbytes, 0, streamed=True, objects=len(objects),
                         stored_bytes=sum(len(o.data) for o in objects))

    async def _publish_groups(self, job: _Job, head_pieces: int, groups: list[list[int]]) -> None:
        """Serialises group k+1 while group k is sent; stops at the first group the service refuses."""
        def serialise(g: int) -> asyncio.Future:
            return asyncio.ensure_future(asyncio.to_thread(self._block_objects, job, groups[g], head_pieces,
                                                           self.full_kv))
        pending = serialise(0)
        try:
            for g in range(len(groups)):
                objects = await pending
                pending = serialise(g + 1) if g + 1 < len(groups) else None
                results = await self._put(objects)
                refused = [r for r in results if r.status != Status.STORED]
                self._count_blocks([r for r in results if r.key.kind == KV_BLOCK])
                self.counters.handoff_parts += len(results) - sum(1 for r in results if r.key.kind == KV_BLOCK)
                if refused:
                    self.counters.publish_failures += 1
                    log.warning("handoff: block group %d of %d not stored (%s: %s); decode will recompute",
                                g + 1, len(groups), refused[0].status.name, refused[0].message)
                    return
        except Exception:  # noqa: BLE001 - a background publication; the decode side waits, then recomputes
            self.counters.publish_failures += 1
            log.exception("handoff: publishing its blocks failed")
        finally:
            if pending is not None and not pending.done():
                with contextlib.suppress(BaseException):
                    await pending

    # -- shared ---------------------------------------------------------------------------------------------------

    def _block_objects(self, job: _Job, indices: list[int], head_pieces: int, parts: bool) -> list[PutObject]:
        """The full blocks `indices` serialised on the hash pool's threads: each as a content-addressed KV_BLOCK
        object when the service lacks it, and (`parts`) as a part of the handoff."""
        missing = set(job.missing)
        data = parallel_map(lambda i: encode_block(job.state.kv[:, i], job.hashes[i], self.fingerprint), indices)
        objects = []
        for i, blob in zip(indices, data):
            if i in missing:
                objects.append(PutObject(object_key(self.fingerprint, job.salt, KV_BLOCK, job.hashes[i]), blob))
            if parts:
                objects.append(PutObject(part_key(job.key, head_pieces + i), blob, job.ttl_s))
        return objects

    async def _put(self, objects: list[PutObject]):
        results, nbytes, seconds = await timed_put(self.cache, objects)
        self.counters.published_bytes += nbytes
        self.counters.publish_seconds += seconds
        return results

    def _count_blocks(self, results) -> int:
        stored = sum(1 for r in results if r.status == Status.STORED)
        self.counters.published_blocks += stored
        self.counters.publish_failures += len(results) - stored
        return stored

    def _require_stored(self, results, expected: bool) -> None:
        refused = [r for r in results if r.status != Status.STORED]
        if expected and (refused or not results):
            self.counters.publish_failures += 1
            why = f"{refused[0].status.name}: {refused[0].message}" if refused else "no answer"
            raise HandoffPublishError(f"the cache service did not store the handoff ({why})")
