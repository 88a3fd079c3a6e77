"""The embedded, in-process store: a byte budget with watermark eviction in LRU order, leases and TTLs.

Contract (in addition to `store.Store`'s):
- `stored_bytes` counts payload bytes. When a put takes it above `high_watermark * byte_budget`, objects are evicted
  in least-recently-used order (a `get_many` hit makes an object most recent; `lookup` does not), skipping leased
  objects and the object just stored, until it is at or below `low_watermark * byte_budget`.
- An object larger than the budget, or one that cannot fit under the budget because leased objects fill it, is
  refused with TOO_LARGE (nothing else is evicted for it beyond the watermark rule).
- An object with a TTL is invisible once `clock() >= stored_at + ttl_s` unless leased; it is dropped (counted in
  `expirations`) by the next call that sweeps, at most `sweep_interval_s` later, or by `expire()`.
- Leases end at `release` or when `clock()` passes their deadline; an expired lease pins nothing.
- `clock` is injectable (monotonic seconds) so tests control time.
"""

from __future__ import annotations

import heapq
import threading
import time
import uuid
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from cache_service.objects import Checksum, Status
from cache_service.store import (GetOutcome, KeyOutcome, LeaseGrant, LookupOutcome, PutItem, Store, StoreCounters,
                                 StoreStats, prefix_length)


@dataclass(frozen=True)
class _Entry:
    data: bytes
    checksum: Checksum
    expires_at: float | None  # clock() seconds; None: never


@dataclass(frozen=True)
class _Lease:
    keys: tuple[bytes, ...]
    expires_at: float


class MemoryStore(Store):
    backend = "memory"

    def __init__(self, byte_budget: int, high_watermark: float = 0.9, low_watermark: float = 0.8,
                 clock: Callable[[], float] = time.monotonic, sweep_interval_s: float = 1.0):
        if byte_budget <= 0:
            raise ValueError(f"byte_budget must be > 0, got {byte_budget}")
        if not 0 < low_watermark <= high_watermark <= 1:
            raise ValueError(f"need 0 < low_watermark <= high_watermark <= 1, got {low_watermark}, {high_watermark}")
        self.byte_budget = byte_budget
        self.high_watermark = high_watermark
        self.low_watermark = low_watermark
        self._clock = clock
        self._sweep_interval_s = sweep_interval_s
        self._lock = threading.Lock()
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()  # least recently used first
        self._bytes = 0
        self._expiry_heap: list[tuple[float, bytes]] = []  # (expires_at, key); stale entries are skipped
        self._last_sweep = float("-inf")
        self._leases: dict[str, _Lease] = {}
        self._lease_heap: list[tuple[float, str]] = []  # (expires_at, lease_id)
        self._pins: Counter[bytes] = Counter()  # key -> number of active leases holding it
        self._counters = StoreCounters()

    # -- Store API ----------------------------------------------------------------------------------------------

    def put_many(self, items: Sequence[PutItem]) -> list[KeyOutcome]:
        verified = [item.checksum.matches(item.data) for item in items]  # outside the lock: the slow part
        with self._lock:
            now = self._tick()
            return [self._put_one(item, now) if ok else KeyOutcome(Status.CORRUPT, "checksum mismatch on arrival")
                    for item, ok in zip(items, verified)]

    def get_many(self, keys: Sequence[bytes]) -> list[GetOutcome]:
        with self._lock:
            now = self._tick()
            entries = [self._visible(key, now) for key in keys]
            for key, entry in zip(keys, entries):
                if entry is not None:
                    self._entries.move_to_end(key)
        verified = [entry is not None and entry.checksum.matches(entry.data) for entry in entries]
        with self._lock:
            return [self._get_result(key, entry, ok) for key, entry, ok in zip(keys, entries, verified)]

    def lookup(self, keys: Sequence[bytes], include_presence: bool = False) -> LookupOutcome:
        with self._lock:
            now = self._tick()
            if include_presence:
                present = [self._visible(key, now) is not None for key in keys]
                return LookupOutcome(prefix_length(present), present)
            hits = 0
            while hits < len(keys) and self._visible(keys[hits], now) is not None:
                hits += 1
            return LookupOutcome(hits)

    def lease(self, keys: Sequence[bytes], ttl_s: float) -> LeaseGrant:
        with self._lock:
            now = self._tick()
            found = [self._visible(key, now) is not None for key in keys]
            pinned = tuple(dict.fromkeys(k for k, ok in zip(keys, found) if ok))
            lease_id = uuid.uuid4().hex if pinned else ""
            if pinned:
                self._leases[lease_id] = _Lease(pinned, now + ttl_s)
                heapq.heappush(self._lease_heap, (now + ttl_s, lease_id))
                self._pins.update(pinned)
            outcomes = [KeyOutcome(Status.FOUND) if ok else KeyOutcome(Status.MISSING) for ok in found]
            return LeaseGrant(lease_id, outcomes, ttl_s)

    def release(self, lease_id: str) -> tuple[bool, int]:
        with self._lock:
            self._tick()
            lease = self._leases.pop(lease_id, None)
            if lease is None:
                return False, 0
            self._unpin(lease.keys)
            return True, len(lease.keys)

    def remove(self, keys: Sequence[bytes], force: bool = False) -> list[KeyOutcome]:
        with self._lock:
            now = self._tick()
            return [self._remove_one(key, now, force) for key in keys]

    def stats(self) -> StoreStats:
        with self._lock:
            self._tick()
            leased = sum(1 for key in self._pins if key in self._entries)
            return StoreStats(self.backend, len(self._entries), self._bytes, self.byte_budget, leased,
                              len(self._leases), StoreCounters(**vars(self._counters)), self.high_watermark,
                              self.low_watermark)

    def expire(self) -> int:
        with self._lock:
            now = self._clock()
            self._expire_leases(now)
            return self._sweep(now)

    # -- internals (call with the lock held) -------------------------------------------------------------------

    def _tick(self) -> float:
        """Ends due leases; sweeps expired objects when the sweep interval has passed. Returns now."""
        now = self._clock()
        self._expire_leases(now)
        if now - self._last_sweep >= self._sweep_interval_s:
            self._sweep(now)
        return now

    def _put_one(self, item: PutItem, now: float) -> KeyOutcome:
        size = len(item.data)
        if size > self.byte_budget:
            return KeyOutcome(Status.TOO_LARGE, f"object of {size} bytes exceeds the byte budget {self.byte_budget}")
        self._drop(item.key)
        expires_at = None if item.ttl_s is None else now + item.ttl_s
        self._entries[item.key] = _Entry(item.data, item.checksum, expires_at)
        self._bytes += size
        if expires_at is not None:
            heapq.heappush(self._expiry_heap, (expires_at, item.key))
        self._evict(protect=item.key)
        if self._bytes > self.byte_budget:
            self._drop(item.key)
            return KeyOutcome(Status.TOO_LARGE, "no room: leased objects fill the byte budget")
        self._counters.puts += 1
        return KeyOutcome(Status.STORED)

    def _evict(self, protect: bytes) -> None:
        """Watermark eviction in LRU order, skipping leased objects and `protect`."""
        if self._bytes <= self.high_watermark * self.byte_budget:
            return
        target = self.low_watermark * self.byte_budget
        for key in list(self._entries):
            if self._bytes <= target:
                break
            if key == protect or self._pins[key] > 0:
                continue
            self._drop(key)
            self._counters.evictions += 1

    def _visible(self, key: bytes, now: float) -> _Entry | None:
        """The entry when present and not expired (a leased entry never expires)."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        if entry.expires_at is not None and now >= entry.expires_at and self._pins[key] == 0:
            self._drop(key)
            self._counters.expirations += 1
            return None
        return entry

    def _get_result(self, key: bytes, entry: _Entry | None, verified: bool) -> GetOutcome:
        if entry is None:
            self._counters.misses += 1
            return GetOutcome(Status.MISSING)
        if not verified:
            if self._entries.get(key) is entry:
                self._drop(key)
            self._counters.corrupt_reads += 1
            self._counters.misses += 1
            return GetOutcome(Status.CORRUPT, message="stored object failed its checksum; removed")
        self._counters.hits += 1
        return GetOutcome(Status.FOUND, entry.data, entry.checksum)

    def _remove_one(self, key: bytes, now: float, force: bool) -> KeyOutcome:
        if self._visible(key, now) is None:
            return KeyOutcome(Status.MISSING)
        if self._pins[key] > 0 and not force:
            return KeyOutcome(Status.LEASED, "object is leased; pass force to remove it")
        self._drop(key)
        self._counters.removes += 1
        return KeyOutcome(Status.REMOVED)

    def _drop(self, key: bytes) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._bytes -= len(entry.data)

    def _sweep(self, now: float) -> int:
        """Drops expired unleased objects; leased ones stay queued until a later sweep."""
        self._last_sweep = now
        dropped, deferred = 0, []
        while self._expiry_heap and self._expiry_heap[0][0] <= now:
            expires_at, key = heapq.heappop(self._expiry_heap)
            entry = self._entries.get(key)
            if entry is None or entry.expires_at != expires_at:
                continue  # stale: removed or replaced since
            if self._pins[key] > 0:
                deferred.append((expires_at, key))
                continue
            self._drop(key)
            self._counters.expirations += 1
            dropped += 1
        for item in deferred:
            heapq.heappush(self._expiry_heap, item)
        return dropped

    def _expire_leases(self, now: float) -> None:
        while self._lease_heap and self._lease_heap[0][0] <= now:
            _, lease_id = heapq.heappop(self._lease_heap)
            lease = self._leases.pop(lease_id, None)
            if lease is not None:
                self._unpin(lease.keys)

    def _unpin(self, keys: tuple[bytes, ...]) -> None:
        self._pins.subtract(keys)
        for key in keys:
            if self._pins[key] <= 0:
                del self._pins[key]
