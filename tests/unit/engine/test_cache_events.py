"""The prefix cache's event sink (engine/memory/events.py): stores and evictions of blocks and snapshots recorded in
order once turned on, nothing before; overflow drops and reports `lost`; the listing `start_events` returns plus
the events after it reproduce the cache exactly."""

from __future__ import annotations

from engine.config import CachePlan
from engine.memory.block_pool import KVBlockPool
from engine.memory.events import CacheEventKind as K
from engine.memory.events import CacheEventSink
from engine.memory.manager import CacheManager
from engine.memory.state_pool import SnapshotPriority, StatePool


PLAN = CachePlan(block_size=4, num_blocks=4, slots_per_request=1, num_running_slots=2, num_snapshot_slots=2,
                 snapshot_interval=8, max_model_len=64, bytes_per_token=1, bytes_per_state=1)


def test_block_pool_records_stores_and_evictions_in_order():
    sink = CacheEventSink()
    pool = KVBlockPool(2, events=sink)
    pool.cache(pool.allocate(1)[0], b"x")  # not recording yet
    sink.restart()
    b = pool.allocate(1)[0]
    pool.cache(b, b"a")
    pool.free([b])
    pool.free([0])
    pool.allocate(2)  # takes both free blocks: both hashes are evicted
    events, lost = sink.drain()
    assert not lost
    assert events[0] == (K.BLOCK_STORED, b"a")
    assert sorted(events[1:]) == sorted([(K.BLOCK_REMOVED, b"a"), (K.BLOCK_REMOVED, b"x")])
    assert sink.drain() == ([], False)


def test_state_pool_records_snapshots_but_not_refreshes():
    sink = CacheEventSink()
    sink.restart()
    pool = StatePool(1, 1, 1, events=sink)
    pool.put_snapshot(b"s1", SnapshotPriority.PERIODIC)
    pool.put_snapshot(b"s1", SnapshotPriority.TURN)  # a refresh: nothing new
    pool.put_snapshot(b"s2", SnapshotPriority.TURN)  # evicts s1 for the only slot
    pool.drop_snapshot(b"s2")
    assert sink.drain()[0] == [(K.SNAPSHOT_STORED, b"s1"), (K.SNAPSHOT_REMOVED, b"s1"), (K.SNAPSHOT_STORED, b"s2"),
                               (K.SNAPSHOT_REMOVED, b"s2")]


def test_overflow_drops_and_reports_lost_once():
    sink = CacheEventSink(capacity=3)
    sink.restart()
    for i in range(5):
        sink.record(K.BLOCK_STORED, bytes([i]))
    events, lost = sink.drain()
    assert lost and events == [(K.BLOCK_STORED, b"\x03"), (K.BLOCK_STORED, b"\x04")]
    assert sink.drain() == ([], False)


def test_listing_plus_events_mirror_the_cache():
    manager = CacheManager(PLAN, has_kda=True)
    pool = manager.block_pool
    pool.cache(pool.allocate(1)[0], b"before")
    listing = manager.start_events()
    assert listing.block_hashes == [b"before"] and listing.snapshot_hashes == []
    blocks = set(listing.block_hashes)
    for i in range(pool.num_blocks + 3):  # more blocks than the pool: evictions follow
        b = pool.allocate(1)[0]
        pool.cache(b, bytes([i]) * 4)
        pool.free([b])
    for kind, h in manager.events.drain()[0]:
        blocks.add(h) if kind == K.BLOCK_STORED else blocks.discard(h)
    assert blocks == set(pool.cached_hashes())
