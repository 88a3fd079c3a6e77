"""MemoryStore with a shared-memory arena: exact extents, eviction when the arena is full (LRU order, pinned and
reserved objects never evicted), reservations (commit verifies, expiry frees), locate pins, corruption on read."""

import pytest

from cache_service.memory_store import MemoryStore
from cache_service.objects import Checksum, ChecksumAlgorithm, Status
from cache_service.shm_arena import HEADER_BYTES, SharedArena
from cache_service.store import PutItem, ReserveItem

K = 4096
XXH3 = ChecksumAlgorithm.XXH3_64


def payload(name: str, size: int) -> bytes:
    return (name.encode() * size)[:size]


def item(name: str, size: int = K, ttl_s: float | None = None) -> PutItem:
    data = payload(name, size)
    return PutItem(name.encode(), data, Checksum.of(data, XXH3), ttl_s)


def put(store: MemoryStore, *items: PutItem) -> list[Status]:
    return [o.status for o in store.put_many(items)]


def pages(store: MemoryStore) -> dict[str, int]:
    """Stored object -> first page of its extent in the data area."""
    return {k.decode(): e.offset // K for k, e in store._entries.items()}


@pytest.fixture
def arena(tmp_path):
    a = SharedArena.create(8 * K, tmp_path, populate=False, grow_step_bytes=K)  # 8 pages, backed page by page
    yield a
    a.close()


@pytest.fixture
def store(arena, clock):
    # No watermark eviction (1.0 / 1.0): only a full arena evicts.
    return MemoryStore(byte_budget=8 * K, high_watermark=1.0, low_watermark=1.0, clock=clock, arena=arena)


def fill(store: MemoryStore, names: str = "abcdefgh") -> None:
    assert put(store, *[item(n) for n in names]) == [Status.STORED] * len(names)


def test_objects_get_first_fit_extents_and_round_trip(store, arena):
    assert put(store, item("a", 1), item("b", K + 1), item("c", K), item("z", 0)) == [Status.STORED] * 4
    assert pages(store) == {"a": 0, "b": 1, "c": 3, "z": 0}  # z: zero bytes take no space
    got = store.get_many([b"b", b"z", b"nope"])
    assert [g.status for g in got] == [Status.FOUND, Status.FOUND, Status.MISSING]
    assert got[0].data == payload("b", K + 1) and got[1].data == b""
    assert arena.read(HEADER_BYTES + K, 3) == b"bbb"  # the payload sits in the arena file
    assert arena.backed == 4 * K  # backed as far as used


def test_a_full_arena_evicts_in_lru_order_until_an_extent_fits(store):
    fill(store)  # a..h on pages 0..7
    store.get_many([b"a"])  # LRU order: b c d e f g h a
    assert put(store, item("i", 2 * K)) == [Status.STORED]  # b frees 1 page, c the next: pages 1-2
    assert pages(store) == {"a": 0, "d": 3, "e": 4, "f": 5, "g": 6, "h": 7, "i": 1}
    assert put(store, item("j", 3 * K)) == [Status.STORED]  # d, e, f: the 3 pages 3-5
    assert pages(store) == {"a": 0, "g": 6, "h": 7, "i": 1, "j": 3}
    assert store.stats().counters.evictions == 5


def test_pinned_and_reserved_objects_are_never_evicted(store, arena):
    fill(store)
    lease = store.lease([b"a"], ttl_s=60)
    pin = store.locate([b"b"], ttl_s=60)
    grant = store.reserve([ReserveItem(b"r", K)], ttl_s=60)  # evicts c, the least recent unpinned object
    assert grant.outcomes[0].status == Status.RESERVED and grant.outcomes[0].offset == HEADER_BYTES + 2 * K
    assert put(store, item("x", 5 * K)) == [Status.STORED]  # d..h go; a, b and r stay
    assert pages(store) == {"a": 0, "b": 1, "x": 3}
    refused = store.put_many([item("y", 6 * K)])[0]  # only x (5 pages) could go
    assert refused.status == Status.TOO_LARGE and "no room" in refused.message
    assert pages(store) == {"a": 0, "b": 1, "x": 3}  # nothing was evicted for a put that cannot fit
    arena.write(HEADER_BYTES + 2 * K, payload("r", K))
    outcomes, stored = store.commit(grant.reservation_id, [Checksum.of(payload("r", K), XXH3)])
    assert [o.status for o in outcomes] == [Status.STORED] and stored == K
    store.release(lease.lease_id)
    store.release(pin.pin_id)
    assert put(store, item("y", K)) == [Status.STORED]  # the arena is full; a is the least recent now
    assert pages(store) == {"b": 1, "r": 2, "x": 3, "y": 0}


def test_an_uncommitted_reservation_expires_and_frees_its_extent(store, clock):
    grant = store.reserve([ReserveItem(b"r", 2 * K), ReserveItem(b"big", 9 * K)], ttl_s=5)
    assert [o.status for o in grant.outcomes] == [Status.RESERVED, Status.TOO_LARGE]
    assert store._space.free_extents() == []  # backed: 2 pages, both reserved
    clock.now += 5
    assert store.stats().objects == 0  # any call ends due reservations
    assert store._space.free_extents() == [(0, 2 * K)]
    assert store.commit(grant.reservation_id, [Checksum.of(b"", XXH3)]) is None
    assert put(store, item("a")) == [Status.STORED] and pages(store) == {"a": 0}


def test_commit_verifies_every_object_over_the_arena_bytes(store, arena):
    store.verify_commits = True
    grant = store.reserve([ReserveItem(b"good", K), ReserveItem(b"bad", K), ReserveItem(b"odd", K)], ttl_s=60)
    offsets = [o.offset for o in grant.outcomes]
    arena.write(offsets[0], payload("good", K))
    arena.write(offsets[1], payload("bad", K - 1) + b"!")  # a torn or wrong write
    checksums = [Checksum.of(payload("good", K), XXH3), Checksum.of(payload("bad", K), XXH3), None]
    with pytest.raises(ValueError):
        store.commit(grant.reservation_id, checksums[:2])  # wrong count: refused, the reservation stays
    outcomes, stored = store.commit(grant.reservation_id, checksums)
    assert [o.status for o in outcomes] == [Status.STORED, Status.CORRUPT, Status.INVALID] and stored == K
    assert store.get_many([b"good"])[0].data == payload("good", K)
    assert store._space.free_extents() == [(K, 2 * K)]  # the refused objects' extents are free again
    assert store.commit(grant.reservation_id, checksums) is None  # committed once


def test_by_default_commit_trusts_the_writer_and_the_first_read_fails_closed(store, arena):
    grant = store.reserve([ReserveItem(b"good", K), ReserveItem(b"bad", K), ReserveItem(b"odd", K)], ttl_s=60)
    offsets = [o.offset for o in grant.outcomes]
    arena.write(offsets[0], payload("good", K))
    arena.write(offsets[1], payload("bad", K - 1) + b"!")  # a torn or wrong write
    checksums = [Checksum.of(payload("good", K), XXH3), Checksum.of(payload("bad", K), XXH3), None]
    outcomes, stored = store.commit(grant.reservation_id, checksums)
    assert [o.status for o in outcomes] == [Status.STORED, Status.STORED, Status.INVALID] and stored == 2 * K
    got = store.get_many([b"bad", b"good"])
    assert [g.status for g in got] == [Status.CORRUPT, Status.FOUND] and got[1].data == payload("good", K)
    stats = store.stats()
    assert stats.counters.corrupt_reads == 1 and stats.objects == 1  # counted and removed
    assert store.lookup([b"bad"]).prefix_hit_length == 0


def test_a_located_object_keeps_its_bytes_until_released(store, arena):
    put(store, item("a"))
    grant = store.locate([b"a", b"zz"], ttl_s=60)
    loc = grant.locations[0]
    assert (loc.status, loc.offset, loc.size) == (Status.FOUND, HEADER_BYTES, K)
    assert grant.locations[1].status == Status.MISSING
    assert put(store, PutItem(b"a", payload("A", K), Checksum.of(payload("A", K), XXH3))) == [Status.STORED]
    assert pages(store) == {"a": 1}  # replaced: the new object went elsewhere
    assert store.remove([b"a"])[0].status == Status.REMOVED
    assert arena.read(loc.offset, K) == payload("a", K)  # the located bytes are untouched
    assert put(store, item("b")) == [Status.STORED] and pages(store) == {"b": 1}
    assert store.release(grant.pin_id) == (True, 1)
    assert put(store, item("c")) == [Status.STORED] and pages(store) == {"b": 1, "c": 0}
    stats = store.stats().counters
    assert (stats.hits, stats.misses) == (1, 1)  # locate counts like a get


def test_a_corrupted_arena_byte_is_corrupt_on_read_counted_and_removed(store, arena):
    put(store, item("a"), item("b"))
    arena.write(HEADER_BYTES + 10, b"\xff")
    got = store.get_many([b"a", b"b"])
    assert [g.status for g in got] == [Status.CORRUPT, Status.FOUND]
    stats = store.stats()
    assert (stats.counters.corrupt_reads, stats.objects) == (1, 1)
    assert store._space.free_extents() == [(0, K)]


def test_watermark_eviction_applies_as_on_the_heap(arena, clock):
    store = MemoryStore(byte_budget=8 * K, high_watermark=0.5, low_watermark=0.25, clock=clock, arena=arena)
    fill(store, "abcd")  # 50%: not above the high watermark
    assert put(store, item("e")) == [Status.STORED]  # 62.5%: evict a, b, c down to 25%
    assert sorted(pages(store)) == ["d", "e"] and store.stats().counters.evictions == 3


def test_release_ends_leases_pins_and_reservations(store):
    put(store, item("a"))
    lease, pin = store.lease([b"a"], ttl_s=60), store.locate([b"a"], ttl_s=60)
    reservation = store.reserve([ReserveItem(b"r", K)], ttl_s=60)
    for hold_id in (lease.lease_id, pin.pin_id, reservation.reservation_id):
        assert store.release(hold_id) == (True, 1)
        assert store.release(hold_id) == (False, 0)
    assert store._space.free_extents() == [(K, K)] and store._entries[b"a"].readers == 0


def test_a_heap_store_has_no_arena_calls():
    with pytest.raises(RuntimeError):
        MemoryStore(1000).locate([b"a"], ttl_s=1)
