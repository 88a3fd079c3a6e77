"""Offload instead of drop: the KDA snapshots an engine's prefix cache lets go go to the cache service, with their
blocks, in the background.

Contract:
- `SnapshotPublisher(engine, cache, counters).start()` installs itself as the engine's export sink
  (`AsyncEngine.set_export_sink`): from then on the engine hands over every snapshot evicted from its pool (for room,
  or because its last block was evicted) and every finished handoff's turn end (engine/exchange.py
  `SnapshotExport`). Each is stored as the ordinary content-addressed objects prefill publishes — the snapshot as
  `STATE_SNAPSHOT` under its last block's hash, its blocks as `KV_BLOCK`s — keyed by the model fingerprint and the
  tenant salt of the request that took it (worker/tenancy.py), so `worker.prefix.RemotePrefix` reads it back on a
  later hit (prefill and a colocated decode alike) and another tenant never can.
- Off the critical path: the engine thread only hands exports over; this loop asks the cache service which objects
  it lacks (one `Lookup` per kind), serialises those (in a thread: versioned header + sha256, so a corrupted object
  is refused when read back) and stores them in one `BatchPut`. At most `max_pending` exports wait; older ones are
  dropped and counted as failures, like objects the service refused. Nothing here fails a request.
- `drain()` waits until everything handed over so far is published; `stop()` uninstalls the sink.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque

from cache_service.client import CacheClient, PutObject
from cache_service.objects import Status, object_key
from engine.async_engine import AsyncEngine
from engine.exchange import SnapshotExport
from engine.transfer import encode_block, encode_state
from protos import common_pb2
from worker.prefix import PrefixCounters
from worker.tenancy import tenant_salt_of
from worker.transfers import timed_put

log = logging.getLogger(__name__)

KV_BLOCK = common_pb2.OBJECT_KIND_KV_BLOCK
SNAPSHOT = common_pb2.OBJECT_KIND_STATE_SNAPSHOT
MAX_PENDING = 64


class SnapshotPublisher:
    def __init__(self, engine: AsyncEngine, cache: CacheClient, counters: PrefixCounters,
                 max_pending: int = MAX_PENDING):
        self.engine = engine
        self.cache = cache
        self.counters = counters
        self.max_pending = max_pending
        self.fingerprint: bytes = engine.layout.fingerprint
        self._pending: deque[SnapshotExport] = deque()
        self._task: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.engine.set_export_sink(self._from_engine)

    def stop(self) -> None:
        self.engine.set_export_sink(None)

    def _from_engine(self, exports: list[SnapshotExport]) -> None:
        """Called on the engine's step thread: hands the exports to the event loop."""
        try:
            self._loop.call_soon_threadsafe(self._enqueue, exports)
        except RuntimeError:  # the loop is closed: the worker is gone
            pass

    def _enqueue(self, exports: list[SnapshotExport]) -> None:
        self._pending.extend(exports)
        while len(self._pending) > self.max_pending:
            self._pending.popleft()
            self.counters.offload_failures += 1
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while self._pending:
            export = self._pending.popleft()
            try:
                await self._publish(export)
            except Exception as exc:  # noqa: BLE001 - a background best effort; the service may be down
                log.info("snapshot offload failed: %r", exc)
                self.counters.offload_failures += 1

    async def _publish(self, export: SnapshotExport) -> None:
        salt, fp = tenant_salt_of(export.cache_salt), self.fingerprint
        hashes = [h for h, _ in export.blocks]
        held_blocks, held_snapshot = await asyncio.gather(
            self.cache.lookup(fp, salt, KV_BLOCK, hashes, include_presence=True),
            self.cache.lookup(fp, salt, SNAPSHOT, [export.block_hash], include_presence=True))
        have = set(h for h, present in zip(hashes, held_blocks.present) if present)
        with_snapshot = not any(held_snapshot.present)

        def serialise() -> list[PutObject]:
            objects = [PutObject(object_key(fp, salt, KV_BLOCK, h), encode_block(kv, h, fp))
                       for h, kv in export.blocks if h not in have]
            if with_snapshot:
                objects.append(PutObject(object_key(fp, salt, SNAPSHOT, export.block_hash),
                                         encode_state(export.state, export.block_hash, fp)))
            return objects

        objects = await asyncio.to_thread(serialise)
        if not objects:
            return
        results, nbytes, seconds = await timed_put(self.cache, objects)
        self.counters.offload_bytes += nbytes
        self.counters.offload_seconds += seconds
        stored = [r.status == Status.STORED for r in results]
        self.counters.offloaded_blocks += sum(stored[:-1] if with_snapshot else stored)
        if with_snapshot:
            self.counters.offloaded_snapshots += int(stored[-1])
        self.counters.offload_failures += stored.count(False)

    async def drain(self) -> None:
        """Waits until every export handed over so far is published (or failed)."""
        await asyncio.sleep(0)  # let exports the step thread just handed over reach the queue
        while self._task is not None and not self._task.done():
            await asyncio.shield(self._task)
