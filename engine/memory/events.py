"""What the prefix cache stores and evicts, recorded for whoever mirrors it (the worker's KV event stream).

Contract:
- `CacheEventSink` is fed on the engine's step thread by the block pool (a full block registered under its hash:
  `BLOCK_STORED`; its hash evicted: `BLOCK_REMOVED`) and the state pool (a KDA snapshot taking a slot:
  `SNAPSHOT_STORED`; evicted or dropped: `SNAPSHOT_REMOVED`), in the order they happen. A snapshot is keyed by the
  hash of the prefix's last block, so the pair (blocks, snapshots) is exactly what the prefix hit rule
  (`engine.memory.manager.resumable_blocks`) reads. Hashes are the engine's chained block hashes, salted per tenant.
- Off (`enabled` False, the default) recording costs one attribute test. On, each event is one tuple appended under an
  uncontended lock; `drain()` (any thread) takes everything recorded so far, in order, and whether events were lost:
  more than `capacity` events pending drops them all and reports `lost` once (the reader then lists the whole cache
  again, `CacheManager.start_events`), so the memory it holds is bounded.
"""

from __future__ import annotations

import enum
import threading

DEFAULT_CAPACITY = 1 << 18  # pending events (each a tuple and a 32-byte hash: ~25 MB at most)


class CacheEventKind(enum.IntEnum):
    BLOCK_STORED = 1
    BLOCK_REMOVED = 2
    SNAPSHOT_STORED = 3
    SNAPSHOT_REMOVED = 4


class CacheEventSink:
    def __init__(self, capacity: int = DEFAULT_CAPACITY):
        if capacity <= 0:
            raise ValueError(f"capacity must be positive, got {capacity}")
        self.capacity = capacity
        self.enabled = False
        self._events: list[tuple[CacheEventKind, bytes]] = []
        self._lost = False
        self._lock = threading.Lock()

    def record(self, kind: CacheEventKind, block_hash: bytes) -> None:
        if not self.enabled:
            return
        with self._lock:
            if len(self._events) >= self.capacity:
                self._events.clear()
                self._lost = True
            self._events.append((kind, block_hash))

    @property
    def pending(self) -> int:
        """Events recorded and not drained yet."""
        with self._lock:
            return len(self._events)

    def drain(self) -> tuple[list[tuple[CacheEventKind, bytes]], bool]:
        """-> (the events recorded since the last drain, in order; whether some were lost since then)."""
        with self._lock:
            events, self._events = self._events, []
            lost, self._lost = self._lost, False
        return events, lost

    def restart(self) -> None:
        """Turns recording on with nothing pending (the caller lists the cache in the same step-thread command)."""
        with self._lock:
            self._events.clear()
            self._lost = False
            self.enabled = True
