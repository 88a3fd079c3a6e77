"""The KDA state pool: fixed slots for running requests and for prefix-cache snapshots.

Contract:
- Slot ids index `CacheTensors.conv/recurrent`. Running slots come in groups of `slots_per_request` consecutive
  slots (`1 + num_speculative_tokens`): group g owns slots `g*spr … g*spr + spr - 1`, its first slot holds the
  request's state; the others are scratch for draft positions. Groups are handed out lowest id first.
- Snapshot slots follow the running slots. Each holds the KDA state after a block-aligned prefix and is keyed by
  the hash of the prefix's last block. Snapshots are never owned by a request (a hit copies the snapshot into the
  request's running slot before the step that uses it), so all of them are evictable.
- Retention: every snapshot has a `SnapshotPriority` (hints and junctions over prompt and turn ends over periodic
  ones). When no slot is free, `put_snapshot(hash, priority)` evicts the least recently used snapshot of the lowest
  priority present, but never one of a higher priority than the new snapshot's (then nothing is stored: None).
  `on_evict(hash, slot)` is called for such a victim before its slot is handed out again (its contents are still
  intact then, so the caller can read them out). Putting a hash that exists refreshes it and keeps the higher of the
  two priorities. `get_snapshot` marks a snapshot as used.
- `events` (engine/memory/events.py) records every snapshot stored and removed (evicted or dropped), when on.
- A snapshot whose last block leaves the block pool's cache is dropped (`drop_snapshot`, wired to the block pool's
  eviction by the cache manager), so a snapshot always belongs to a prefix whose last block is known to the cache.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Callable

from engine.memory.events import CacheEventKind, CacheEventSink


class SnapshotPriority(enum.IntEnum):
    """Retention class of a snapshot: a higher one is evicted only after every lower one."""

    PERIODIC = 0  # every snapshot_interval tokens
    TURN = 1  # the ends of a prompt, and of a finished turn (prompt + output)
    HINT = 2  # structure hints from the caller and junctions (where prompts branch)


class NoFreeSlotsError(RuntimeError):
    """No running slot group is free (the scheduler never admits more than `max_num_seqs` requests)."""


class StatePool:
    def __init__(self, num_groups: int, slots_per_request: int, num_snapshot_slots: int,
                 on_evict: Callable[[bytes, int], None] | None = None, events: CacheEventSink | None = None):
        self.num_groups = num_groups
        self.slots_per_request = slots_per_request
        self.num_running_slots = num_groups * slots_per_request
        self.num_snapshot_slots = num_snapshot_slots
        self._free_groups = list(range(num_groups))  # kept sorted: lowest first
        self._owned_groups: set[int] = set()
        self._free_snapshot_slots = list(range(self.num_running_slots, self.num_running_slots + num_snapshot_slots))
        self._snapshots: dict[bytes, tuple[int, SnapshotPriority]] = {}  # hash -> (slot, priority)
        self._lru = [OrderedDict() for _ in SnapshotPriority]  # per priority: hashes, least recently used first
        self._on_evict = on_evict
        self.events = events if events is not None else CacheEventSink()
        self.num_snapshot_evictions = 0

    @property
    def num_slots(self) -> int:
        return self.num_running_slots + self.num_snapshot_slots

    @property
    def num_free_groups(self) -> int:
        return len(self._free_groups)

    @property
    def num_snapshots(self) -> int:
        return len(self._snapshots)

    # -- running groups --------------------------------------------------------------------------------------

    def allocate_group(self) -> int:
        if not self._free_groups:
            raise NoFreeSlotsError("no free running state slot")
        group = self._free_groups.pop(0)
        self._owned_groups.add(group)
        return group

    def free_group(self, group: int) -> None:
        self._owned_groups.remove(group)
        self._free_groups.append(group)
        self._free_groups.sort()

    def group_slots(self, group: int) -> range:
        start = group * self.slots_per_request
        return range(start, start + self.slots_per_request)

    def running_slot(self, group: int) -> int:
        return group * self.slots_per_request

    # -- snapshots -------------------------------------------------------------------------------------------

    def has_snapshot(self, block_hash: bytes) -> bool:
        return block_hash in self._snapshots

    def snapshot_priority(self, block_hash: bytes) -> SnapshotPriority | None:
        entry = self._snapshots.get(block_hash)
        return None if entry is None else entry[1]

    def get_snapshot(self, block_hash: bytes) -> int | None:
        """The snapshot's slot (marked most recently used), or None."""
        entry = self._snapshots.get(block_hash)
        if entry is None:
            return None
        self._lru[entry[1]].move_to_end(block_hash)
        return entry[0]

    def put_snapshot(self, block_hash: bytes, priority: SnapshotPriority = SnapshotPriority.PERIODIC) -> int | None:
        """A slot to write the snapshot for `block_hash` into; None when it exists already (refreshed, priority
        raised) or no slot can be had without evicting a snapshot of a higher priority."""
        entry = self._snapshots.get(block_hash)
        if entry is not None:
            slot, old = entry
            del self._lru[old][block_hash]
            self._link(block_hash, slot, max(old, priority))
            return None
        if not self._free_snapshot_slots:
            victim = next((h for level in self._lru[: priority + 1] for h in level), None)
            if victim is None:
                return None
            slot = self._unlink(victim)
            self.num_snapshot_evictions += 1
            if self._on_evict is not None:
                self._on_evict(victim, slot)
            self._free_snapshot_slots.append(slot)
        slot = self._free_snapshot_slots.pop(0)
        self._link(block_hash, slot, SnapshotPriority(priority))
        self.events.record(CacheEventKind.SNAPSHOT_STORED, block_hash)
        return slot

    def drop_snapshot(self, block_hash: bytes) -> int | None:
        """Forgets a snapshot (no `on_evict`); returns the slot it held (now free), or None."""
        if block_hash not in self._snapshots:
            return None
        slot = self._unlink(block_hash)
        self._free_snapshot_slots.append(slot)
        return slot

    def _link(self, block_hash: bytes, slot: int, priority: SnapshotPriority) -> None:
        self._snapshots[block_hash] = (slot, priority)
        self._lru[priority][block_hash] = None

    def _unlink(self, block_hash: bytes) -> int:
        slot, priority = self._snapshots.pop(block_hash)
        del self._lru[priority][block_hash]
        self.events.record(CacheEventKind.SNAPSHOT_REMOVED, block_hash)
        return slot

    def snapshot_hashes(self) -> list[bytes]:
        return list(self._snapshots)

    def snapshot_order(self) -> list[bytes]:
        """Snapshot hashes, next to be evicted first (lowest priority first, least recently used first)."""
        return [h for level in self._lru for h in level]

    def check_integrity(self, owned_groups: list[int] | None = None) -> None:
        free = set(self._free_groups)
        assert len(free) == len(self._free_groups), "a running group is free twice"
        assert not (free & self._owned_groups), "a running group is both free and owned"
        assert free | self._owned_groups == set(range(self.num_groups)), "a running group is lost"
        if owned_groups is not None:
            assert len(owned_groups) == len(set(owned_groups)), "two requests share a running group"
            assert set(owned_groups) == self._owned_groups, "owned running groups do not match the requests"
        snap_free, snap_used = set(self._free_snapshot_slots), [slot for slot, _ in self._snapshots.values()]
        for h, (_, priority) in self._snapshots.items():
            assert h in self._lru[priority], "a snapshot is missing from its priority's LRU order"
        assert sum(map(len, self._lru)) == len(self._snapshots), "the LRU order holds a snapshot that is gone"
        assert len(snap_free) == len(self._free_snapshot_slots), "a snapshot slot is free twice"
        assert len(set(snap_used)) == len(snap_used), "two snapshots share a slot"
        assert not (snap_free & set(snap_used)), "a snapshot slot is both free and used"
        expected = set(range(self.num_running_slots, self.num_slots))
        assert snap_free | set(snap_used) == expected, "a snapshot slot is lost or out of range"
