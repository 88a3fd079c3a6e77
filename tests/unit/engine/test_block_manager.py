"""The block manager alone: exact block ids per request through admission, growth, commit, truncation, freeing and
import reservations, and the evictions it reports."""

from __future__ import annotations

import pytest

from engine.memory.block_manager import BlockManager
from engine.memory.events import CacheEventKind, CacheEventSink
from tests.unit.engine.test_scheduler import req


def make(num_blocks: int = 8, caching: bool = True) -> tuple[BlockManager, list[bytes]]:
    evicted: list[bytes] = []
    return BlockManager(num_blocks, 4, caching, CacheEventSink(), on_evict=evicted.append), evicted


def computed(blocks: BlockManager, rid: str, tokens) -> object:
    """A new request admitted without a hit whose tokens are all computed and committed."""
    r = req(rid, tokens)
    blocks.admit(r, [])
    run(blocks, r, r.num_tokens)
    return r


def run(blocks: BlockManager, r, num_tokens: int) -> None:
    """Grows `r` to `num_tokens` computed tokens and commits them (the engine's part of a step)."""
    assert blocks.allocate(r, num_tokens - r.num_computed_tokens)
    r.num_computed_tokens = num_tokens
    blocks.commit(r)


def test_blocks_follow_the_free_queue_and_a_hit_shares_the_committed_ones():
    blocks, evicted = make()
    blocks.pool.events.restart()
    a = computed(blocks, "a", range(10))  # two full blocks and a partial one
    assert a.block_ids == [0, 1, 2]
    assert [blocks.get_cached(h) for h in a.block_hashes] == [0, 1]
    assert blocks.cached_prefix(req("same", range(10)).block_hashes) == 2
    assert blocks.cached_prefix(req("other", range(1, 11)).block_hashes) == 0  # negative control
    blocks.free(a)
    assert blocks.pool.free_queue() == [2, 3, 4, 5, 6, 7, 1, 0]  # uncached tail first, cached tail before head

    b = req("b", range(10))
    blocks.admit(b, [0, 1])
    b.num_computed_tokens = 8
    run(blocks, b, 10)
    assert b.block_ids == [0, 1, 2]
    stored = [h for kind, h in blocks.pool.events.drain()[0] if kind is CacheEventKind.BLOCK_STORED]
    assert stored == a.block_hashes  # the hit's blocks are not registered twice
    assert evicted == []
    blocks.check_integrity([b])


def test_allocation_short_of_blocks_changes_nothing_and_admission_counts_revived_blocks():
    blocks, evicted = make(num_blocks=4)
    a = computed(blocks, "a", range(8))
    blocks.free(a)
    assert blocks.pool.free_queue() == [2, 3, 1, 0]
    assert blocks.can_admit([0, 1], 16)  # 2 more blocks: the 2 free uncached ones
    assert not blocks.can_admit([0, 1], 17)  # 3 more: reviving 0 and 1 leaves only 2
    c = req("c", range(50, 70))
    blocks.admit(c, [])
    assert not blocks.allocate(c, 17) and c.block_ids == []
    assert blocks.allocate(c, 16) and c.block_ids == [2, 3, 1, 0]
    assert evicted == [a.block_hashes[1], a.block_hashes[0]]  # the prefix tail goes first
    blocks.check_integrity([c])


def test_truncate_returns_a_verifications_rejected_blocks_to_the_head():
    blocks, _ = make()
    r = req("r", range(5))
    blocks.admit(r, [])
    assert blocks.allocate(r, 9) and r.block_ids == [0, 1, 2]  # 5 known tokens + 4 drafts
    r.num_computed_tokens = 6  # one draft kept
    blocks.truncate(r)
    assert r.block_ids == [0, 1] and blocks.pool.free_queue()[0] == 2
    blocks.check_integrity([r])


def test_reservations_register_only_new_hashes_and_stop_at_the_free_blocks():
    blocks, evicted = make(num_blocks=3)
    a = computed(blocks, "a", range(4))
    new = [bytes([i]) * 32 for i in range(3)]
    reserved = blocks.reserve([new[0], a.block_hashes[0], new[0], new[1], new[2]])
    assert reserved == [(new[0], 1), (new[1], 2)]  # a's hash is cached, a duplicate counts once, 2 blocks free
    blocks.release([1, 2])
    assert blocks.pool.free_queue() == [2, 1] and blocks.get_cached(new[1]) == 2
    blocks.free(a)
    assert blocks.reserve([new[2]]) == [(new[2], 2)] and evicted == [new[1]]
    blocks.pool.check_integrity(owners=[[2]])  # the importer holds block 2 until it releases it


def test_prefix_caching_off_caches_nothing_and_integrity_catches_a_short_table():
    blocks, _ = make(caching=False)
    r = req("r", range(8))
    blocks.admit(r, [])
    assert blocks.allocate(r, 8)
    assert blocks.cached_prefix(r.block_hashes) == 0
    r.num_computed_tokens = 8
    blocks.check_integrity([r])
    r.num_computed_tokens = 9
    with pytest.raises(AssertionError, match="2 blocks for 9 computed tokens"):
        blocks.check_integrity([r])
