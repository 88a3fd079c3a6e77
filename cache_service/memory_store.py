"""The embedded, in-process store: a byte budget with watermark eviction in LRU order, leases and TTLs; payloads in
the process heap or in a shared-memory arena that clients on the same host read and write directly.

Contract (in addition to `store.Store`'s):
- `stored_bytes` counts payload bytes. When a put takes it above `high_watermark * byte_budget`, objects are evicted
  in least-recently-used order (a `get_many` or `locate` hit makes an object most recent; `lookup` does not),
  skipping pinned objects (leased, located, being read) and the object just stored, until it is at or below
  `low_watermark * byte_budget`.
- An object larger than the budget, or one that cannot fit under the budget because leased objects fill it, is
  refused with TOO_LARGE (nothing else is evicted for it beyond the watermark rule).
- An object with a TTL is invisible once `clock() >= stored_at + ttl_s` unless leased; it is dropped (counted in
  `expirations`) by the next call that sweeps, at most `sweep_interval_s` later, or by `expire()`.
- Leases end at `release` or when `clock()` passes their deadline; an expired lease pins nothing.
- `clock` is injectable (monotonic seconds) so tests control time. `start_events(log)` records every object the
  index gains or loses (stored, replaced, evicted, expired, removed, found corrupt) into a `kv_stream.StoreEventLog`.

With an `arena` (`shm_arena.SharedArena`), payloads live in its data area, in extents of an `ExtentAllocator`:
- A put reserves an extent first (`arena_space`: growing the arena's backed memory, else evicting unpinned objects
  in LRU order until one fits; TOO_LARGE when pinned and reserved objects leave no room), copies the payload in
  outside the lock, then publishes it.
- Local clients do the copying themselves: `reserve(items, ttl_s)` answers per object RESERVED with a file offset
  (or a refusal) under a reservation id; `commit(id, checksums)` publishes the objects, each atomically (the index
  switches from the old extent to the new one under the lock). The client computed each checksum from the bytes it
  wrote into the arena, and every read verifies it, so by default commit does not read the payloads again (a wrong
  write is CORRUPT at its first read: counted, removed, a miss); with `verify_commits` it verifies each object over
  the arena first and refuses a mismatch as CORRUPT. An uncommitted reservation ends at `release(id)` or its TTL
  and its extents are freed; `commit` then answers None.
- `locate(keys, ttl_s)` answers file offset, size and checksum of present objects (counted as hits and misses, like
  `get_many`) and pins them under a pin id until `release(pin_id)` or the TTL; the client copies and verifies.
- An extent is never freed, handed out again or written by the store while it is reserved or its object is pinned
  (leased, located or being read): removing, replacing, expiring or finding corrupt a pinned object takes it out of
  the index at once and frees its extent when the last pin ends.
- `close()` closes the arena (unlinking its file).
"""

from __future__ import annotations

import heapq
import threading
import time
from collections.abc import Callable, Sequence

from cache_service.arena_space import ArenaSpace
from cache_service.holds import LEASE, PIN, RESERVATION, Hold, Holds
from cache_service.kv_stream import StoreEventLog, WatchedEntries
from cache_service.memory_entries import Entry, Pending
from cache_service.objects import Checksum, Status
from cache_service.shm_arena import SharedArena
from cache_service.store import (GetOutcome, KeyOutcome, LeaseGrant, LocateGrant, Location, LookupOutcome, PutItem,
                                 ReservationGrant, ReserveItem, ReserveOutcome, Store, StoreCounters, StoreStats,
                                 prefix_length)

_CORRUPT_ON_ARRIVAL = KeyOutcome(Status.CORRUPT, "checksum mismatch on arrival")


class MemoryStore(Store):
    backend = "memory"

    def __init__(self, byte_budget: int, high_watermark: float = 0.9, low_watermark: float = 0.8,
                 clock: Callable[[], float] = time.monotonic, sweep_interval_s: float = 1.0,
                 arena: SharedArena | None = None, verify_commits: bool = False):
        if byte_budget <= 0:
            raise ValueError(f"byte_budget must be > 0, got {byte_budget}")
        if not 0 < low_watermark <= high_watermark <= 1:
            raise ValueError(f"need 0 < low_watermark <= high_watermark <= 1, got {low_watermark}, {high_watermark}")
        self.byte_budget = byte_budget
        self.high_watermark = high_watermark
        self.low_watermark = low_watermark
        self.arena = arena
        self.verify_commits = verify_commits
        self._space = ArenaSpace(arena) if arena is not None else None  # None: payloads in the heap
        self._clock = clock
        self._sweep_interval_s = sweep_interval_s
        self._lock = threading.Lock()
        self._entries: WatchedEntries = WatchedEntries()  # key -> Entry, least recently used first
        self._bytes = 0
        self._expiry_heap: list[tuple[float, bytes]] = []  # (expires_at, key); stale entries are skipped
        self._last_sweep = float("-inf")
        self._holds = Holds()  # leases, locate pins, reservations
        self._counters = StoreCounters()

    # -- Store API ----------------------------------------------------------------------------------------------

    def put_many(self, items: Sequence[PutItem]) -> list[KeyOutcome]:
        verified = [item.checksum.matches(item.data) for item in items]  # outside the lock: the slow part
        with self._lock:
            self._tick()
            slots = [self._reserve_one(item.key, len(item.data), item.checksum, item.ttl_s, item.data) if ok
                     else _CORRUPT_ON_ARRIVAL for item, ok in zip(items, verified)]
        if self._space is not None:
            self._copy_in(slots, items)  # outside the lock: the extents are this call's alone
        with self._lock:
            now = self._tick()
            return [self._publish(slot, now) if isinstance(slot, Pending) else slot for slot in slots]

    def get_many(self, keys: Sequence[bytes]) -> list[GetOutcome]:
        with self._lock:
            entries = self._read_pinned(keys, self._tick())  # pinned while copied and verified outside the lock
        try:
            payloads = [None if entry is None else self._payload(entry) for entry in entries]
            verified = [p is not None and e.checksum.matches(p) for e, p in zip(entries, payloads)]
        finally:
            with self._lock:
                for entry in entries:
                    if entry is not None:
                        self._unread(entry)
        with self._lock:
            return [self._get_result(key, entry, payload, ok)
                    for key, entry, payload, ok in zip(keys, entries, payloads, verified)]

    def start_events(self, event_log: StoreEventLog) -> list[bytes]:
        """From now on every key the index gains or loses goes to `event_log` -> the keys it holds now."""
        with self._lock:
            return self._entries.watch(event_log)

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
            lease_id = self._holds.add(LEASE, pinned, now + ttl_s) if pinned else ""
            outcomes = [KeyOutcome(Status.FOUND) if ok else KeyOutcome(Status.MISSING) for ok in found]
            return LeaseGrant(lease_id, outcomes, ttl_s)

    def release(self, lease_id: str) -> tuple[bool, int]:
        """Ends a lease, a locate pin or a reservation -> (whether it was active, keys it held)."""
        with self._lock:
            self._tick()
            hold = self._holds.end(lease_id)
            if hold is None:
                return False, 0
            self._let_go(hold)
            return True, len(hold.items)

    def remove(self, keys: Sequence[bytes], force: bool = False) -> list[KeyOutcome]:
        with self._lock:
            now = self._tick()
            return [self._remove_one(key, now, force) for key in keys]

    def stats(self) -> StoreStats:
        with self._lock:
            self._tick()
            leased = sum(1 for key in self._holds.leased_keys() if key in self._entries)
            return StoreStats(self.backend, len(self._entries), self._bytes, self.byte_budget, leased,
                              self._holds.count(LEASE), StoreCounters(**vars(self._counters)), self.high_watermark,
                              self.low_watermark)

    def expire(self) -> int:
        with self._lock:
            now = self._clock()
            self._end_due_holds(now)
            return self._sweep(now)

    def close(self) -> None:
        if self.arena is not None:
            self.arena.close()

    # -- shared-memory data plane (arena stores only) -------------------------------------------------------------

    def reserve(self, items: Sequence[ReserveItem], ttl_s: float) -> ReservationGrant:
        """Reserves an extent per object for `ttl_s` seconds (see the module docstring)."""
        space = self._require_space()
        with self._lock:
            now = self._tick()
            slots = [self._reserve_one(item.key, item.size, None, item.ttl_s) for item in items]
            pending = [slot for slot in slots if isinstance(slot, Pending)]
            reservation_id = self._holds.add(RESERVATION, pending, now + ttl_s) if pending else ""
        outcomes = [ReserveOutcome(Status.RESERVED, space.file_offset(slot.offset)) if isinstance(slot, Pending)
                    else ReserveOutcome(slot.status, message=slot.message) for slot in slots]
        return ReservationGrant(reservation_id, outcomes, ttl_s)

    def commit(self, reservation_id: str,
               checksums: Sequence[Checksum | None]) -> tuple[list[KeyOutcome], int] | None:
        """Publishes a reservation's objects with their `checksums` (one per reserved object, in reserve order; None:
        an unusable one), with `verify_commits` only those whose arena bytes match -> (per reserved object: STORED,
        CORRUPT, INVALID or TOO_LARGE; payload bytes stored), or None when the reservation is unknown (expired,
        released or committed already). Raises ValueError, keeping the reservation, when the number of checksums is
        wrong."""
        self._require_space()
        with self._lock:
            self._tick()
            reservation = self._holds.get(reservation_id, RESERVATION)
            if reservation is None:
                return None
            if len(checksums) != len(reservation.items):
                raise ValueError(f"{len(checksums)} checksums for {len(reservation.items)} reserved objects")
            self._holds.end(reservation_id)  # the extents are this call's alone now
        pending = reservation.items
        for p, checksum in zip(pending, checksums):
            p.checksum = checksum
        verified = self._verify_reserved(pending)
        with self._lock:
            now = self._tick()
            outcomes = [self._publish(p, now) if ok else self._refuse_corrupt(p) for p, ok in zip(pending, verified)]
        stored = sum(p.size for p, o in zip(pending, outcomes) if o.status == Status.STORED)
        return outcomes, stored

    def locate(self, keys: Sequence[bytes], ttl_s: float) -> LocateGrant:
        """Where present objects lie, pinned for `ttl_s` seconds under one pin id (see the module docstring)."""
        space = self._require_space()
        with self._lock:
            now = self._tick()
            entries = self._read_pinned(keys, now)
            found = [e for e in entries if e is not None]
            self._counters.hits += len(found)
            self._counters.misses += len(keys) - len(found)
            pin_id = self._holds.add(PIN, found, now + ttl_s) if found else ""
        locations = [Location(Status.MISSING) if e is None else
                     Location(Status.FOUND, space.file_offset(e.offset), e.size, e.checksum) for e in entries]
        return LocateGrant(pin_id, locations, ttl_s)

    def _require_space(self) -> ArenaSpace:
        if self._space is None:
            raise RuntimeError("this memory store keeps payloads in the heap: no shared-memory arena")
        return self._space

    def _verify_reserved(self, pending: Sequence[Pending]) -> list[bool]:
        """Per reserved object: a usable checksum (that matches the arena bytes, with `verify_commits`)?"""
        verified = []
        try:
            for p in pending:
                if not self.verify_commits or p.checksum is None:
                    verified.append(p.checksum is not None)
                    continue
                with self._space.view(p.offset, p.size) as payload:
                    verified.append(p.checksum.matches(payload))
        finally:
            if len(verified) < len(pending):
                with self._lock:
                    for p in pending:
                        self._discard(p)
        return verified

    # -- internals (call with the lock held) -------------------------------------------------------------------

    def _tick(self) -> float:
        """Ends due leases, pins and reservations; sweeps expired objects when the sweep interval has passed."""
        now = self._clock()
        self._end_due_holds(now)
        if now - self._last_sweep >= self._sweep_interval_s:
            self._sweep(now)
        return now

    def _read_pinned(self, keys: Sequence[bytes], now: float) -> list[Entry | None]:
        """The visible entries (None: missing), each made most recent and pinned by one more reader."""
        entries = [self._visible(key, now) for key in keys]
        for key, entry in zip(keys, entries):
            if entry is not None:
                self._entries.move_to_end(key)
                entry.readers += 1
        return entries

    def _reserve_one(self, key: bytes, size: int, checksum: Checksum, ttl_s: float | None,
                     data: bytes | None = None) -> Pending | KeyOutcome:
        """Space for one object (arena: an extent, evicting for it if need be), or why not."""
        if size > self.byte_budget:
            return KeyOutcome(Status.TOO_LARGE, f"object of {size} bytes exceeds the byte budget {self.byte_budget}")
        if self._space is None:
            return Pending(key, size, checksum, ttl_s, data=data)
        offset = self._space.allocate(size, self._evictable_bytes, self._evict_least_recent)
        if offset is None:
            return KeyOutcome(Status.TOO_LARGE, "no room: leased, pinned or reserved objects fill the arena")
        return Pending(key, size, checksum, ttl_s, offset=offset)

    def _evictable(self):
        """(key, entry) of the objects eviction may drop (not leased, not being read), least recent first."""
        return ((k, e) for k, e in self._entries.items() if not self._holds.leased(k) and e.readers == 0)

    def _evictable_bytes(self) -> int:
        return sum(self._space.extent_bytes(e.size) for _, e in self._evictable())

    def _evict_least_recent(self) -> bool:
        """Drops the least recently used evictable object -> whether there was one."""
        victim = next(self._evictable(), None)
        if victim is None:
            return False
        self._drop(victim[0])
        self._counters.evictions += 1
        return True

    def _copy_in(self, slots: list, items: Sequence[PutItem]) -> None:
        """Writes reserved payloads into the arena; on failure frees every reserved extent and re-raises."""
        try:
            for slot, item in zip(slots, items):
                if isinstance(slot, Pending):
                    self._space.write(slot.offset, item.data)
        except BaseException:
            with self._lock:
                for slot in slots:
                    if isinstance(slot, Pending):
                        self._discard(slot)
            raise

    def _publish(self, pending: Pending, now: float) -> KeyOutcome:
        """Makes a reserved object visible, replacing the key's old object; then the watermark rule."""
        key, size = pending.key, pending.size
        self._drop(key)
        expires_at = None if pending.ttl_s is None else now + pending.ttl_s
        self._entries[key] = Entry(size, pending.checksum, expires_at, pending.data, pending.offset)
        self._bytes += size
        if expires_at is not None:
            heapq.heappush(self._expiry_heap, (expires_at, key))
        self._evict(protect=key)
        if self._bytes > self.byte_budget:
            self._drop(key)
            return KeyOutcome(Status.TOO_LARGE, "no room: leased objects fill the byte budget")
        self._counters.puts += 1
        return KeyOutcome(Status.STORED)

    def _discard(self, pending: Pending) -> None:
        """Frees a reservation's extent: the object is never published."""
        if self._space is not None:
            self._space.free(pending.offset, pending.size)

    def _refuse_corrupt(self, pending: Pending) -> KeyOutcome:
        self._discard(pending)
        if pending.checksum is None:
            return KeyOutcome(Status.INVALID, "unusable checksum (unknown algorithm or wrong length); nothing stored")
        return KeyOutcome(Status.CORRUPT, "the arena bytes failed their checksum; nothing stored")

    def _evict(self, protect: bytes) -> None:
        """Watermark eviction in LRU order, skipping pinned objects and `protect`."""
        if self._bytes <= self.high_watermark * self.byte_budget:
            return
        target = self.low_watermark * self.byte_budget
        for key, _ in list(self._evictable()):
            if self._bytes <= target:
                break
            if key == protect:
                continue
            self._drop(key)
            self._counters.evictions += 1

    def _visible(self, key: bytes, now: float) -> Entry | None:
        """The entry when present and not expired (a leased entry never expires)."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        if entry.expires_at is not None and now >= entry.expires_at and not self._holds.leased(key):
            self._drop(key)
            self._counters.expirations += 1
            return None
        return entry

    def _payload(self, entry: Entry):
        """The payload's bytes (arena: a copy; called outside the lock with the entry pinned)."""
        if self._space is None:
            return entry.data
        return self._space.read(entry.offset, entry.size)

    def _get_result(self, key: bytes, entry: Entry | None, payload, verified: bool) -> GetOutcome:
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
        return GetOutcome(Status.FOUND, payload, entry.checksum)

    def _remove_one(self, key: bytes, now: float, force: bool) -> KeyOutcome:
        if self._visible(key, now) is None:
            return KeyOutcome(Status.MISSING)
        if self._holds.leased(key) and not force:
            return KeyOutcome(Status.LEASED, "object is leased; pass force to remove it")
        self._drop(key)
        self._counters.removes += 1
        return KeyOutcome(Status.REMOVED)

    def _drop(self, key: bytes) -> None:
        """Takes the key's object out of the index; its extent is freed now, or when its last reader is done."""
        entry = self._entries.pop(key, None)
        if entry is None:
            return
        self._bytes -= entry.size
        entry.dropped = True
        if entry.readers == 0:
            self._free(entry)

    def _unread(self, entry: Entry) -> None:
        entry.readers -= 1
        if entry.readers == 0 and entry.dropped:
            self._free(entry)

    def _free(self, entry: Entry) -> None:
        if self._space is not None:
            self._space.free(entry.offset, entry.size)

    def _sweep(self, now: float) -> int:
        """Drops expired unleased objects; leased ones stay queued until a later sweep."""
        self._last_sweep = now
        dropped, deferred = 0, []
        while self._expiry_heap and self._expiry_heap[0][0] <= now:
            expires_at, key = heapq.heappop(self._expiry_heap)
            entry = self._entries.get(key)
            if entry is None or entry.expires_at != expires_at:
                continue  # stale: removed or replaced since
            if self._holds.leased(key):
                deferred.append((expires_at, key))
                continue
            self._drop(key)
            self._counters.expirations += 1
            dropped += 1
        for item in deferred:
            heapq.heappush(self._expiry_heap, item)
        return dropped

    def _end_due_holds(self, now: float) -> None:
        for hold in self._holds.end_due(now):
            self._let_go(hold)

    def _let_go(self, hold: Hold) -> None:
        """Releases what an ended pin or reservation held (a lease's keys are unpinned by `Holds` itself)."""
        if hold.kind == PIN:
            for entry in hold.items:
                self._unread(entry)
        elif hold.kind == RESERVATION:
            for pending in hold.items:
                self._discard(pending)
