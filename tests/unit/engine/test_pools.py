"""KV block pool and KDA state pool: exact block ids, eviction order, snapshot LRU, integrity checks."""

from __future__ import annotations

import pytest

from engine.memory.block_pool import KVBlockPool, NoFreeBlocksError
from engine.memory.state_pool import NoFreeSlotsError, StatePool


def h(i: int) -> bytes:
    return bytes([i]) * 32


def test_allocation_order_is_the_free_queue():
    pool = KVBlockPool(6)
    assert pool.allocate(2) == [0, 1]
    assert pool.allocate(3) == [2, 3, 4]
    assert pool.free_queue() == [5]
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(2)
    pool.check_integrity(owners=[[0, 1], [2, 3, 4]])


def test_free_puts_cached_blocks_at_the_tail_tail_first_and_uncached_at_the_head():
    pool = KVBlockPool(6)
    a = pool.allocate(3)  # [0, 1, 2]: a request with two full cached blocks and a partial one
    pool.cache(0, h(0))
    pool.cache(1, h(1))
    pool.free(reversed(a))  # the engine frees a request's blocks tail first
    # uncached block 2 goes to the head (reused first); cached 1 (the tail of the prefix) is evicted before 0
    assert pool.free_queue() == [2, 3, 4, 5, 1, 0]
    pool.check_integrity(owners=[])


def test_eviction_takes_lru_cached_blocks_last_and_reports_hashes():
    evicted = []
    pool = KVBlockPool(4, on_evict=evicted.append)
    first = pool.allocate(2)
    pool.cache(first[0], h(10))
    pool.cache(first[1], h(11))
    pool.free(reversed(first))
    assert pool.free_queue() == [2, 3, 1, 0]
    assert pool.allocate(2) == [2, 3] and evicted == []  # free uncached blocks go first
    assert pool.allocate(1) == [1] and evicted == [h(11)]  # then the LRU cached one (the prefix tail)
    assert pool.get_cached(h(11)) is None and pool.get_cached(h(10)) == 0
    assert pool.num_evictions == 1
    pool.check_integrity(owners=[[2, 3], [1]])


def test_touch_revives_a_cached_free_block_and_shares_it():
    pool = KVBlockPool(4)
    [b] = pool.allocate(1)
    pool.cache(b, h(1))
    pool.free([b])
    assert pool.free_queue() == [1, 2, 3, 0]
    pool.touch([b])  # prefix hit by request A
    pool.touch([b])  # and by request B
    assert pool.ref_cnt[b] == 2 and 0 not in pool.free_queue()
    pool.check_integrity(owners=[[0], [0]])
    pool.free([b])
    assert 0 not in pool.free_queue()
    pool.free([b])
    assert pool.free_queue() == [1, 2, 3, 0]  # back at the tail, still cached
    assert pool.get_cached(h(1)) == 0


def test_cache_keeps_the_first_block_for_a_hash():
    pool = KVBlockPool(3)
    a, b = pool.allocate(2)
    assert pool.cache(a, h(5))
    assert not pool.cache(b, h(5))  # a duplicate computation: not indexed
    assert pool.get_cached(h(5)) == a and pool.block_hash[b] is None
    pool.free([b, a])
    assert pool.free_queue() == [1, 2, 0]


def test_integrity_catches_inconsistencies():
    pool = KVBlockPool(3)
    pool.allocate(1)
    with pytest.raises(AssertionError):
        pool.check_integrity(owners=[])  # block 0 has a reference nobody holds
    pool.ref_cnt[1] = 1  # owned and free at once
    with pytest.raises(AssertionError):
        pool.check_integrity()
    with pytest.raises(RuntimeError):
        KVBlockPool(2).free([0])


def test_evict_all_forgets_free_cached_blocks_only():
    pool = KVBlockPool(3)
    a, b = pool.allocate(2)
    pool.cache(a, h(1))
    pool.cache(b, h(2))
    pool.free([b])
    assert pool.evict_all() == 1
    assert pool.get_cached(h(2)) is None and pool.get_cached(h(1)) == a


def test_state_pool_groups_and_layout_for_speculative_slots():
    pool = StatePool(num_groups=3, slots_per_request=3, num_snapshot_slots=2)
    assert pool.num_slots == 11
    g0, g1 = pool.allocate_group(), pool.allocate_group()
    assert (g0, g1) == (0, 1)
    assert list(pool.group_slots(g1)) == [3, 4, 5] and pool.running_slot(g1) == 3
    pool.free_group(g0)
    assert pool.allocate_group() == 0  # lowest first
    pool.allocate_group()
    with pytest.raises(NoFreeSlotsError):
        pool.allocate_group()
    pool.check_integrity(owned_groups=[0, 1, 2])


def test_snapshot_slots_lru():
    pool = StatePool(num_groups=1, slots_per_request=1, num_snapshot_slots=2)
    assert pool.put_snapshot(h(1)) == 1
    assert pool.put_snapshot(h(2)) == 2
    assert pool.put_snapshot(h(1)) is None  # exists: refreshed, nothing to write
    assert pool.snapshot_order() == [h(2), h(1)]
    assert pool.put_snapshot(h(3)) == 2  # evicts h(2), the least recently used
    assert pool.snapshot_order() == [h(1), h(3)] and pool.num_snapshot_evictions == 1
    assert pool.get_snapshot(h(1)) == 1
    assert pool.snapshot_order() == [h(3), h(1)]
    pool.drop_snapshot(h(3))
    assert not pool.has_snapshot(h(3)) and pool.num_snapshots == 1
    pool.check_integrity(owned_groups=[])
    assert StatePool(1, 1, 0).put_snapshot(h(1)) is None  # no snapshot slots at all


def test_state_pool_integrity_catches_double_free():
    pool = StatePool(num_groups=2, slots_per_request=1, num_snapshot_slots=1)
    g = pool.allocate_group()
    with pytest.raises(AssertionError):
        pool.check_integrity(owned_groups=[])
    pool.free_group(g)
    pool._free_groups.append(g)  # corrupt: free twice
    with pytest.raises(AssertionError):
        pool.check_integrity()
