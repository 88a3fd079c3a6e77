"""A prompt's prefix in the cache service, for both roles: look it up, load it into the engine, find its junction.

Contract:
- `RemotePrefix.lookup(hashes, salt, num_tokens)` -> `RemotePresence`: which of the prompt's full blocks (by hash, in
  order) and which KDA snapshots at their ends the cache service holds; all absent when it cannot answer (counted
  in `remote_load_failures`).
- `load(num_tokens, hashes, salt, presence)` imports the cache service's longest usable prefix (the engine's prefix
  hit rule, `engine.memory.manager.resumable_blocks`) into the engine's prefix cache when it beats the local one —
  the blocks the engine lacks and the snapshot at its end, in one `BatchGet` — so the engine's ordinary prefix hit
  then uses it. A load that fails (missing, corrupt — every object is checksummed —, another model, service down) is
  counted, marks the objects it tried absent in `presence` (so they are published again) and never fails the request.
- `junction(presence, num_tokens)` -> the token position where the prompt leaves the blocks the cache service holds
  when no snapshot there lets it resume (the engine snapshots there as a structure hint, so the next prompt on this
  branch hits), else None.
- `PrefixCounters` are the counts both roles keep for these loads and for offloads (worker/offload.py).
Tracing: `prefix.lookup` (blocks looked up, blocks held, hit tokens of the usable prefix) and `prefix.load` (blocks,
keys and bytes loaded) spans, `error.type` on failures.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from opentelemetry.trace import Tracer

from cache_service.client import CacheClient, LookupResult
from cache_service.objects import Status, object_key
from engine.async_engine import AsyncEngine
from engine.memory.manager import resumable_blocks
from engine.transfer import TransferError
from protos import common_pb2
from telemetry import tracing
from worker.transfers import timed_get

log = logging.getLogger(__name__)

KV_BLOCK = common_pb2.OBJECT_KIND_KV_BLOCK
SNAPSHOT = common_pb2.OBJECT_KIND_STATE_SNAPSHOT


@dataclass
class PrefixCounters:
    """Counts since the worker started (read by tests and metrics)."""

    remote_loads: int = 0  # prefixes loaded from the cache service
    remote_load_tokens: int = 0
    remote_load_failures: int = 0  # lookups or loads that failed (the prompt was computed instead)
    remote_load_bytes: int = 0  # prefix blocks and snapshots read
    remote_load_seconds: float = 0.0
    offloaded_snapshots: int = 0  # snapshots the engine let go, stored in the cache service (worker/offload.py)
    offloaded_blocks: int = 0
    offload_failures: int = 0  # offloads that failed or were dropped (the cache service answered no, or was down)
    offload_bytes: int = 0
    offload_seconds: float = 0.0


@dataclass(frozen=True)
class RemotePresence:
    blocks: list[bool]  # per full block of the prompt, in order (a failed load sets entries back to False)
    snapshots: list[bool]  # a KDA snapshot at the end of that block (all False without KDA layers)


class RemotePrefix:
    def __init__(self, engine: AsyncEngine, cache: CacheClient, tracer: Tracer, counters: PrefixCounters,
                 enabled: bool = True):
        self.engine = engine
        self.cache = cache
        self.tracer = tracer
        self.counters = counters
        self.enabled = enabled  # False: look up (for publishing) but never load
        self.fingerprint: bytes = engine.layout.fingerprint
        self.block_size: int = engine.layout.block_size
        self.has_kda = engine.layout.has_kda

    def _usable(self, num_tokens: int, blocks: list[bool], snapshots: list[bool]) -> int:
        return resumable_blocks(num_tokens, self.block_size, blocks, snapshots if self.has_kda else None)

    async def lookup(self, hashes: list[bytes], salt: bytes, num_tokens: int) -> RemotePresence:
        absent = [False] * len(hashes)
        if not hashes:
            return RemotePresence(absent, list(absent))
        with tracing.child_span(self.tracer, "prefix.lookup", {tracing.BLOCKS: len(hashes)}) as span:
            blocks, snaps = await asyncio.gather(
                self.cache.lookup(self.fingerprint, salt, KV_BLOCK, hashes, include_presence=True),
                self.cache.lookup(self.fingerprint, salt, SNAPSHOT, hashes, include_presence=True) if self.has_kda
                else _no_lookup())
            if blocks.error or snaps.error:
                log.warning("cache lookup failed: %s", blocks.error or snaps.error)
                self.counters.remote_load_failures += 1
                tracing.mark_error(span, "lookup_failed", blocks.error or snaps.error)
                return RemotePresence(absent, list(absent))
            presence = RemotePresence(blocks.present or list(absent),
                                      (snaps.present or list(absent)) if self.has_kda else list(absent))
            usable = self._usable(num_tokens, presence.blocks, presence.snapshots)
            tracing.set_attributes(span, {tracing.HIT_BLOCKS: sum(presence.blocks),
                                          tracing.HIT_TOKENS: usable * self.block_size})
            return presence

    def junction(self, presence: RemotePresence, num_tokens: int) -> int | None:
        held = next((i for i, present in enumerate(presence.blocks) if not present), len(presence.blocks))
        if not self.has_kda or held <= self._usable(num_tokens, presence.blocks, presence.snapshots):
            return None
        return held * self.block_size

    async def load(self, num_tokens: int, hashes: list[bytes], salt: bytes, presence: RemotePresence) -> None:
        if not self.enabled or not hashes:
            return
        remote = self._usable(num_tokens, presence.blocks, presence.snapshots)
        if remote == 0:
            return  # nothing to load: no need to ask the engine (between two of its steps)
        local = await self.engine.prefix_presence(hashes)  # a hint: admission decides what is used
        if remote <= self._usable(num_tokens, local.blocks, local.snapshots):
            return
        wanted = [i for i in range(remote) if not local.blocks[i]]
        keys = [object_key(self.fingerprint, salt, KV_BLOCK, hashes[i]) for i in wanted]
        if self.has_kda:
            keys.append(object_key(self.fingerprint, salt, SNAPSHOT, hashes[remote - 1]))
        with tracing.child_span(self.tracer, "prefix.load", {tracing.BLOCKS: len(wanted), tracing.KEYS: len(keys),
                                                             tracing.HIT_TOKENS: remote * self.block_size}) as span:
            loaded, why = await self._fetch_and_import(keys, len(wanted), span)
            if why is None:
                if loaded:  # (else the engine had no room for it, or had it already: not a failure)
                    self.counters.remote_loads += 1
                    self.counters.remote_load_tokens += remote * self.block_size
                return
            log.info("remote prefix of %d blocks not loaded (%s); computing it", remote, why)
            self.counters.remote_load_failures += 1
            for i in wanted:
                presence.blocks[i] = False
            if self.has_kda:
                presence.snapshots[remote - 1] = False

    async def _fetch_and_import(self, keys: list[common_pb2.ObjectKey], num_blocks: int,
                                span) -> tuple[bool, str | None]:
        """One BatchGet and the import -> (whether the prefix is now resumable here, why the objects were unusable
        or None)."""
        got, nbytes, seconds = await timed_get(self.cache, keys, span)
        self.counters.remote_load_bytes += nbytes
        self.counters.remote_load_seconds += seconds
        bad = [r for r in got if r.status != Status.FOUND]
        if bad:
            tracing.mark_error(span, bad[0].status.name, bad[0].message or None)
            return False, f"{bad[0].status.name} {bad[0].message}".strip()
        try:
            loaded = await self.engine.import_prefix([r.data for r in got[:num_blocks]],
                                                     got[-1].data if self.has_kda else None)
        except TransferError as exc:
            tracing.mark_error(span, "rejected", str(exc))
            return False, f"rejected: {exc}"
        return loaded, None


async def _no_lookup() -> LookupResult:
    return LookupResult(0, [])
