"""The state manager alone: exact slot ids of running groups, verifications and snapshots, retention, rolling turn
ends, and the exports it hands to its reader at the end of each write (a fake block lookup stands in for the block
manager)."""

from __future__ import annotations

from engine.memory.events import CacheEventSink
from engine.memory.state_manager import StateManager
from engine.memory.state_pool import SnapshotPriority
from tests.unit.engine.test_scheduler import req

P, T, H = SnapshotPriority.PERIODIC, SnapshotPriority.TURN, SnapshotPriority.HINT


def make(num_groups: int = 2, slots_per_request: int = 1, snapshot_slots: int = 2):
    cached: dict[bytes, int] = {}  # the block cache: hash -> block id
    states = StateManager(num_groups, slots_per_request, snapshot_slots, 4, cached.get, CacheEventSink(), 0)
    return states, cached


def exporting(states: StateManager) -> list:
    """Turns exports on with a reader -> the list the reader appends to."""
    read = []
    states.set_export_reader(read.extend)
    states.exporting = True
    return read


def cache_blocks(cached: dict[bytes, int], r) -> None:
    """Registers the request's full blocks as blocks 10, 11, … (what the block manager's commit does)."""
    cached.update({h: 10 + i for i, h in enumerate(r.block_hashes)})


def test_running_groups_and_a_verification_move_the_running_slot_without_copies():
    states, _ = make(num_groups=2, slots_per_request=3)
    a, b = req("a", range(5)), req("b", range(5))
    assert (states.assign(a), states.assign(b)) == (0, 3)
    assert states.verify_slots(a, 3) == (1, 2, 0)  # the last position may write the running slot itself
    assert states.settle(a, 2) == (1, 2) and states.running_slot(a) == 2
    assert states.verify_slots(a, 2) == (0, 1)
    assert states.verify_slots(b, 2) == (4, 5)  # negative control: another group
    states.release(a)
    assert (a.state_group, a.slot_offset) == (None, 0)
    c = req("c", range(5))
    assert states.assign(c) == 0  # the lowest free group
    states.check_integrity([b, c])


def test_snapshots_take_slots_after_the_running_ones_and_retention_keeps_priorities():
    states, cached = make(num_groups=2, snapshot_slots=2)
    a = req("a", range(13))
    cache_blocks(cached, a)
    states.assign(a)
    assert states.take_snapshot(a, 8, 0, T, rolling=False) == [(0, 2)]
    assert states.take_snapshot(a, 8, 0, T, rolling=False) == []  # exists: refreshed, nothing to copy
    assert states.take_snapshot(a, 4, 0, T, rolling=False) == [(0, 3)]
    states.copies_applied()
    assert states.take_snapshot(a, 12, 0, P, rolling=False) == []  # would evict a higher priority
    assert states.take_snapshot(a, 12, 0, H, rolling=False) == [(0, 2)]  # evicts the LRU turn end (8)
    assert states.pool.snapshot_order() == [a.block_hashes[0], a.block_hashes[2]]
    assert states.num_snapshots_taken == 3
    states.check_integrity([a])


def test_an_evicted_written_snapshot_reaches_the_reader_before_the_write_returns():
    states, cached = make(snapshot_slots=1)
    read = exporting(states)
    a = req("a", range(9))
    cache_blocks(cached, a)
    states.assign(a)
    assert states.take_snapshot(a, 4, 0, T, rolling=False) == [(0, 2)]
    assert states.take_snapshot(a, 8, 0, T, rolling=False) == [(0, 2)]  # evicts 4 before its copy: nothing to read
    assert read == []
    states.copies_applied()
    states.note_sent(a.block_hashes[:1])
    b = req("b", range(100, 109))
    cache_blocks(cached, b)
    assert states.take_snapshot(b, 8, 0, T, rolling=False) == [(0, 2)]  # evicts a's 8, written: read out now
    [export] = read
    assert (export.reason, export.block_hash, export.slot, export.num_tokens) == ("evicted", a.block_hashes[1], 2, 8)
    assert export.blocks == ((a.block_hashes[1], 11),)  # block 0 is in the cache service already
    assert states.take_exports() == [] and states.num_exports == 1


def test_without_a_reader_exports_wait_and_a_reset_exports_nothing():
    states, cached = make(snapshot_slots=1)
    states.exporting = True
    a = req("a", range(9))
    cache_blocks(cached, a)
    states.assign(a)
    states.take_snapshot(a, 8, 0, T, rolling=False)
    states.copies_applied()
    with states.not_exporting():
        del cached[a.block_hashes[1]]
        states.block_evicted(a.block_hashes[1])
    assert states.take_exports() == [] and states.pool.num_snapshots == 0
    cached[a.block_hashes[1]] = 11  # recomputed and cached again
    states.take_snapshot(a, 8, 0, T, rolling=False)
    states.copies_applied()
    del cached[a.block_hashes[1]]  # the block manager evicts the snapshot's last block
    states.block_evicted(a.block_hashes[1])
    [export] = states.take_exports()
    assert export.slot == 2 and export.blocks == ((a.block_hashes[0], 10), (a.block_hashes[1], 11))  # 11: its last
    assert states.pool.num_snapshots == 0


def test_a_rolling_turn_end_replaces_the_previous_one_and_a_handoffs_turn_end_is_exported():
    states, cached = make(snapshot_slots=2)
    read = exporting(states)
    a = req("a", range(5))
    a.token_ids.extend(range(50, 58))  # 8 output tokens: output block boundaries at 8 and 12
    a.block_hashes.clear()
    a.hasher.extend(a.block_hashes, a.token_ids)
    cache_blocks(cached, a)
    states.assign(a)
    assert states.take_snapshot(a, 8, 0, T, rolling=True) == [(0, 2)]
    assert states.take_snapshot(a, 12, 0, T, rolling=True) == [(0, 3)]  # 8's slot is freed, then 3 comes first
    assert states.pool.snapshot_order() == [a.block_hashes[2]]
    states.copies_applied()
    states.record_turn_end(a)  # its prompt block is not known to be in the cache service
    assert read == []
    states.note_sent(a.block_hashes[:1])
    states.record_turn_end(a)
    [export] = read
    assert (export.reason, export.slot, export.num_tokens) == ("turn_end", 3, 12)
    assert [h for h, _ in export.blocks] == a.block_hashes[1:3]
    states.release(a)
    states.record_turn_end(a)  # released: no longer its rolling turn end
    assert len(read) == 1
    states.check_integrity([])
