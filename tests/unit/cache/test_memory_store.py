"""MemoryStore: watermark eviction in LRU order skipping leases, TTL expiry, checksums on read, per-key statuses."""

import dataclasses

import pytest

from cache_service.memory_store import MemoryStore
from cache_service.objects import Checksum, ChecksumAlgorithm, Status
from cache_service.store import PutItem


def item(name: str, size: int = 100, ttl_s: float | None = None) -> PutItem:
    data = (name.encode() * size)[:size]
    return PutItem(name.encode(), data, Checksum.of(data), ttl_s)


def keys(*names: str) -> list[bytes]:
    return [n.encode() for n in names]


def stored(store: MemoryStore) -> list[str]:
    return sorted(k.decode() for k in store._entries)


@pytest.fixture
def store(clock):
    # 1000-byte budget: eviction above 900 bytes, down to 800.
    return MemoryStore(byte_budget=1000, high_watermark=0.9, low_watermark=0.8, clock=clock)


def fill(store: MemoryStore, names: str = "abcdefghi") -> None:
    outcomes = store.put_many([item(n) for n in names])
    assert [o.status for o in outcomes] == [Status.STORED] * len(names)


def test_round_trip_and_per_key_statuses(store):
    fill(store, "ab")
    outcomes = store.get_many(keys("a", "zz", "b"))
    assert [o.status for o in outcomes] == [Status.FOUND, Status.MISSING, Status.FOUND]
    assert outcomes[0].data == b"a" * 100 and outcomes[0].checksum == Checksum.of(b"a" * 100)
    stats = store.stats()
    assert (stats.objects, stats.stored_bytes, stats.counters.hits, stats.counters.misses) == (2, 200, 2, 1)


def test_no_eviction_at_the_high_watermark(store):
    fill(store)  # 900 bytes == high watermark: not above it
    assert store.stats().counters.evictions == 0 and len(stored(store)) == 9


def test_eviction_in_lru_order_down_to_the_low_watermark(store):
    fill(store)  # LRU order a b c d e f g h i
    store.get_many(keys("a", "c"))  # now b d e f g h i a c
    fill(store, "j")  # 1000 > 900: evict b (900), d (800) and stop at the low watermark
    assert stored(store) == list("acefghij")
    stats = store.stats()
    assert (stats.stored_bytes, stats.counters.evictions) == (800, 2)


def test_lookup_does_not_refresh_recency(store):
    fill(store)
    store.lookup(keys("a", "b"))
    fill(store, "j")
    assert stored(store) == list("cdefghij")


def test_eviction_skips_leased_objects(store):
    fill(store)
    grant = store.lease(keys("a", "b", "nope"), ttl_s=60)
    assert [o.status for o in grant.outcomes] == [Status.FOUND, Status.FOUND, Status.MISSING] and grant.lease_id
    fill(store, "j")
    assert stored(store) == list("abefghij")  # c and d went instead of the leased a and b
    assert store.stats().leased_objects == 2
    assert store.release(grant.lease_id) == (True, 2)
    store.put_many([item("k", 200)])  # 1000 bytes: a and b are the least recent and unpinned now
    assert stored(store) == list("efghijk")


def test_lease_ends_on_its_own(store, clock):
    fill(store)
    store.lease(keys("a"), ttl_s=10)
    clock.advance(10)
    fill(store, "j")
    assert "a" not in stored(store)
    assert store.stats().active_leases == 0


def test_too_large_and_no_room(store):
    assert store.put_many([item("x", 1001)])[0].status == Status.TOO_LARGE
    fill(store)
    store.lease(keys(*"abcdefghi"), ttl_s=60)
    outcome = store.put_many([item("y", 200)])[0]
    assert outcome.status == Status.TOO_LARGE and "leased" in outcome.message
    assert stored(store) == list("abcdefghi") and store.stats().stored_bytes == 900


def test_handoff_ttl_expiry_with_a_fake_clock(store, clock):
    store.put_many([item("handoff", ttl_s=30), item("block")])
    clock.advance(29.9)
    assert store.get_many(keys("handoff"))[0].status == Status.FOUND
    clock.advance(0.1)
    assert store.get_many(keys("handoff", "block"))[0].status == Status.MISSING
    assert store.lookup(keys("handoff")).prefix_hit_length == 0
    stats = store.stats()
    assert (stats.objects, stats.counters.expirations) == (1, 1)


def test_expire_sweeps_unclaimed_objects(store, clock):
    store.put_many([item("h1", ttl_s=30), item("h2", ttl_s=60), item("block")])
    clock.advance(31)
    assert store.expire() == 1
    assert stored(store) == ["block", "h2"]
    clock.advance(30)
    assert store.expire() == 1 and stored(store) == ["block"]


def test_calls_sweep_expired_objects_without_expire(store, clock):
    store.put_many([item("h1", ttl_s=30)])
    clock.advance(31)
    store.lookup(keys("other"))  # any call sweeps once the sweep interval has passed
    assert stored(store) == []


def test_a_lease_holds_off_expiry(store, clock):
    store.put_many([item("handoff", ttl_s=30)])
    grant = store.lease(keys("handoff"), ttl_s=60)
    clock.advance(45)
    assert store.expire() == 0
    assert store.get_many(keys("handoff"))[0].status == Status.FOUND
    store.release(grant.lease_id)
    assert store.expire() == 1


def test_corrupt_read_is_detected_counted_and_removed(store):
    fill(store, "ab")
    entry = store._entries[b"a"]
    flipped = bytes([entry.data[0] ^ 0x01]) + entry.data[1:]
    store._entries[b"a"] = dataclasses.replace(entry, data=flipped)  # a bit flip in memory
    outcomes = store.get_many(keys("a", "b"))
    assert [o.status for o in outcomes] == [Status.CORRUPT, Status.FOUND] and outcomes[0].data is None
    stats = store.stats()
    assert (stats.counters.corrupt_reads, stats.counters.misses, stats.objects, stats.stored_bytes) == (1, 1, 1, 100)
    assert store.get_many(keys("a"))[0].status == Status.MISSING


def test_put_with_a_wrong_checksum_stores_nothing(store):
    good = item("a")
    bad = PutItem(b"bad", good.data, Checksum.of(b"something else"))
    assert [o.status for o in store.put_many([bad, good])] == [Status.CORRUPT, Status.STORED]
    assert stored(store) == ["a"]


def test_sha256_checksums(store):
    data = b"state" * 10
    assert store.put_many([PutItem(b"s", data, Checksum.of(data, ChecksumAlgorithm.SHA256))])[0].status == \
        Status.STORED
    assert store.get_many([b"s"])[0].data == data


def test_lookup_prefix_length_and_presence(store):
    fill(store, "0124")
    chain = keys(*"012345")
    assert store.lookup(chain).prefix_hit_length == 3
    assert store.lookup(chain).present == []
    full = store.lookup(chain, include_presence=True)
    assert full.prefix_hit_length == 3 and full.present == [True, True, True, False, True, False]
    assert store.lookup(keys("9", "0")).prefix_hit_length == 0
    assert store.lookup([]).prefix_hit_length == 0


def test_remove_statuses(store):
    fill(store, "abc")
    grant = store.lease(keys("a"), ttl_s=60)
    outcomes = store.remove(keys("a", "b", "zz"))
    assert [o.status for o in outcomes] == [Status.LEASED, Status.REMOVED, Status.MISSING]
    assert store.remove(keys("a"), force=True)[0].status == Status.REMOVED
    assert stored(store) == ["c"] and store.stats().counters.removes == 2
    assert store.release(grant.lease_id) == (True, 1)
    assert store.release(grant.lease_id) == (False, 0)
    assert store.release("unknown") == (False, 0)


def test_replacing_a_key_keeps_the_byte_count_right(store):
    store.put_many([item("a", 100)])
    store.put_many([item("a", 300)])
    stats = store.stats()
    assert (stats.objects, stats.stored_bytes) == (1, 300)


def test_lease_of_nothing_has_no_id(store):
    grant = store.lease(keys("zz"), ttl_s=5)
    assert grant.lease_id == "" and grant.outcomes[0].status == Status.MISSING
    assert store.stats().active_leases == 0


@pytest.mark.parametrize("budget, high, low", [(0, 0.9, 0.8), (100, 0.8, 0.9), (100, 1.1, 0.8), (100, 0.9, 0)])
def test_bad_configuration_raises(budget, high, low):
    with pytest.raises(ValueError):
        MemoryStore(budget, high, low)
