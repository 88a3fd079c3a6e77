"""The KDA state pool: fixed slots for running requests and for prefix-cache snapshots.

Contract:
- Slot ids index `CacheTensors.conv/recurrent`. Running slots come in groups of `slots_per_request` consecutive
  slots (`1 + num_speculative_tokens`): group g owns slots `g*spr … g*spr + spr - 1`, its first slot holds the
  request's state; the others are scratch for draft positions. Groups are handed out lowest id first.
- Snapshot slots follow the running slots. Each holds the KDA state after a block-aligned prefix and is keyed by
  the hash of the prefix's last block. Snapshots are never owned by a request (a hit copies the snapshot into the
  request's running slot before the step that uses it), so all of them are evictable; `put_snapshot` evicts the
  least recently used when no slot is free. `get_snapshot` marks a snapshot as used.
- A snapshot whose last block leaves the block pool's cache is dropped (`drop_snapshot`, wired to the block pool's
  eviction), so a snapshot always belongs to a prefix whose last block is known to the cache.
"""

from __future__ import annotations

from collections import OrderedDict


class NoFreeSlotsError(RuntimeError):
    """No running slot group is free (the scheduler never admits more than `max_num_seqs` requests)."""


class StatePool:
    def __init__(self, num_groups: int, slots_per_request: int, num_snapshot_slots: int):
        self.num_groups = num_groups
        self.slots_per_request = slots_per_request
        self.num_running_slots = num_groups * slots_per_request
        self.num_snapshot_slots = num_snapshot_slots
        self._free_groups = list(range(num_groups))  # kept sorted: lowest first
        self._owned_groups: set[int] = set()
        self._free_snapshot_slots = list(range(self.num_running_slots, self.num_running_slots + num_snapshot_slots))
        self._snapshots: OrderedDict[bytes, int] = OrderedDict()  # hash -> slot, least recently used first
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

    def get_snapshot(self, block_hash: bytes) -> int | None:
        """The snapshot's slot (marked most recently used), or None."""
        slot = self._snapshots.get(block_hash)
        if slot is not None:
            self._snapshots.move_to_end(block_hash)
        return slot

    def put_snapshot(self, block_hash: bytes) -> int | None:
        """A slot to write the snapshot for `block_hash` into; None when it exists already or there are no slots."""
        if block_hash in self._snapshots:
            self._snapshots.move_to_end(block_hash)
            return None
        if not self._free_snapshot_slots:
            if not self._snapshots:
                return None
            _, slot = self._snapshots.popitem(last=False)
            self.num_snapshot_evictions += 1
            self._free_snapshot_slots.append(slot)
        slot = self._free_snapshot_slots.pop(0)
        self._snapshots[block_hash] = slot
        return slot

    def drop_snapshot(self, block_hash: bytes) -> None:
        slot = self._snapshots.pop(block_hash, None)
        if slot is not None:
            self._free_snapshot_slots.append(slot)

    def snapshot_order(self) -> list[bytes]:
        """Snapshot hashes, next to be evicted first."""
        return list(self._snapshots)

    def check_integrity(self, owned_groups: list[int] | None = None) -> None:
        free = set(self._free_groups)
        assert len(free) == len(self._free_groups), "a running group is free twice"
        assert not (free & self._owned_groups), "a running group is both free and owned"
        assert free | self._owned_groups == set(range(self.num_groups)), "a running group is lost"
        if owned_groups is not None:
            assert len(owned_groups) == len(set(owned_groups)), "two requests share a running group"
            assert set(owned_groups) == self._owned_groups, "owned running groups do not match the requests"
        snap_free, snap_used = set(self._free_snapshot_slots), list(self._snapshots.values())
        assert len(snap_free) == len(self._free_snapshot_slots), "a snapshot slot is free twice"
        assert len(set(snap_used)) == len(snap_used), "two snapshots share a slot"
        assert not (snap_free & set(snap_used)), "a snapshot slot is both free and used"
        expected = set(range(self.num_running_slots, self.num_slots))
        assert snap_free | set(snap_used) == expected, "a snapshot slot is lost or out of range"
