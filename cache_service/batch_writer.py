"""BatchPut's writer: completed objects go to the store in batches while the stream is still arriving.

Contract: `add(completed)` queues an object (or records an outcome decided without the store); a batch of about
`batch_bytes` payload bytes is sent once full, with at most `max_inflight` batches in flight (adding waits for the
oldest). `results()` sends the rest, waits for every batch and answers one (key, outcome) per object added, in the
order added.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from cache_service.put_assembler import Completed
from cache_service.store import KeyOutcome, PutItem
from protos import common_pb2


@dataclass
class _PutBatch:
    items: list[PutItem] = field(default_factory=list)
    nbytes: int = 0
    future: asyncio.Future | None = None


class BatchWriter:
    def __init__(self, put_many: Callable[[list[PutItem]], asyncio.Future], batch_bytes: int, max_inflight: int = 2):
        self._put_many = put_many
        self._batch_bytes = batch_bytes
        self._max_inflight = max_inflight
        self._slots: list[tuple[common_pb2.ObjectKey, KeyOutcome | tuple[_PutBatch, int]]] = []
        self._batch = _PutBatch()
        self._inflight: deque[asyncio.Future] = deque()

    async def add(self, done: Completed) -> None:
        if done.outcome is not None:
            self._slots.append((done.key, done.outcome))
            return
        self._slots.append((done.key, (self._batch, len(self._batch.items))))
        self._batch.items.append(done.item)
        self._batch.nbytes += len(done.item.data)
        if self._batch.nbytes >= self._batch_bytes:
            await self._flush()

    async def results(self) -> list[tuple[common_pb2.ObjectKey, KeyOutcome]]:
        await self._flush()
        await asyncio.gather(*self._inflight)
        return [(key, slot if isinstance(slot, KeyOutcome) else slot[0].future.result()[slot[1]])
                for key, slot in self._slots]

    async def _flush(self) -> None:
        if not self._batch.items:
            return
        while len(self._inflight) >= self._max_inflight:
            await self._inflight.popleft()
        self._batch.future = self._put_many(self._batch.items)
        self._inflight.append(self._batch.future)
        self._batch = _PutBatch()
