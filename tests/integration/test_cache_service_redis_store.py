"""RedisStore against a real Redis: the stored layout, TTLs and leases, prefixes, corrupt manifests, stats (counted
in Redis)."""

import os
import time

import pytest

from cache_service.objects import Checksum, Status, encode_key
from cache_service.redis_store import RedisStore
from cache_service.store import PutItem
from tests.fake_clock import FakeClock

MIB = 1 << 20


def item(name: bytes, data: bytes, ttl_s: float | None = None) -> PutItem:
    return PutItem(encode_key(b"fp", b"salt", 1, name), data, Checksum.of(data), ttl_s)


@pytest.fixture
def store(redis_url):
    s = RedisStore(redis_url, chunk_bytes=MIB)
    yield s
    s.close()


def names(redis_client, pattern: bytes) -> list[bytes]:
    return sorted(redis_client.scan_iter(match=pattern))


OBJECT_KEYS = b"kdamesh:[ocpl]:*"  # manifests, chunks, pins, leases (not the counter hash kdamesh:stats)


def test_small_objects_are_one_key_large_ones_chunks_plus_a_manifest(store, redis_client):
    small, one, big = item(b"s", b"x" * (16 << 10)), item(b"m", os.urandom(MIB)), item(b"b", os.urandom(2 * MIB + 1))
    assert [o.status for o in store.put_many([small, one, big])] == [Status.STORED] * 3
    assert len(names(redis_client, b"kdamesh:o:*")) == 3
    assert redis_client.strlen(b"kdamesh:o:" + small.key) > 16 << 10  # inline: header + checksum + payload
    chunks = names(redis_client, b"kdamesh:c:*")  # above 16 KiB: chunks of at most 1 MiB, the payload as is
    assert len(chunks) == 4 and sorted(redis_client.strlen(c) for c in chunks) == [1, MIB, MIB, MIB]
    got = store.get_many([small.key, one.key, big.key])
    assert [g.data for g in got] == [small.data, one.data, big.data]


def test_counters_live_in_redis_and_are_shared_by_stores_on_the_prefix(store, redis_url, redis_client):
    other = RedisStore(redis_url)  # e.g. a client on the direct data plane
    try:
        a, b = item(b"a", b"A"), item(b"b", os.urandom(MIB))
        other.put_many([a, b])
        other.get_many([a.key, b.key, b"nope"])
        store.get_many([a.key])
        other.remove([a.key])
        counted = {k.decode(): int(v) for k, v in redis_client.hgetall(b"kdamesh:stats").items()}
        assert counted == {"puts": 2, "hits": 3, "misses": 1, "removes": 1}
        c = store.stats().counters
        assert (c.puts, c.hits, c.misses, c.removes, c.corrupt_reads, c.errors) == (2, 3, 1, 1, 0, 0)
    finally:
        other.close()


def test_counts_made_while_redis_is_down_arrive_when_it_is_back(private_redis):
    store = RedisStore(private_redis.url, connect_timeout_s=0.2)
    try:
        private_redis.stop()
        assert store.get_many([b"k1", b"k2"])[0].status == Status.ERROR
        private_redis.start()
        store.get_many([b"k3"])
        c = store.stats().counters
        assert (c.misses, c.errors, c.hits) == (3, 2, 0)
    finally:
        store.close()


def test_a_store_that_raises_when_unavailable_counts_nothing(closed_port, redis_url):
    from cache_service.store import StoreUnavailableError

    direct = RedisStore(f"redis://127.0.0.1:{closed_port}/0", raise_when_unavailable=True)
    try:
        with pytest.raises(StoreUnavailableError):
            direct.put_many([item(b"a", b"A")])
        with pytest.raises(StoreUnavailableError):
            direct.get_many([b"a"])
        assert direct._pending == dict.fromkeys(direct._pending, 0)
    finally:
        direct.close()


def test_ttls_are_redis_expiries(store, redis_client):
    store.put_many([item(b"h", b"handoff", ttl_s=30), item(b"big", os.urandom(MIB + 1), ttl_s=30),
                    item(b"k", b"forever")])
    ttls = {name: redis_client.pttl(name) for name in names(redis_client, OBJECT_KEYS)}
    forever = [n for n, t in ttls.items() if t == -1]
    assert len(forever) == 1 and all(0 < t <= 30_000 for n, t in ttls.items() if n not in forever)


def test_a_lease_outlives_the_objects_ttl_and_blocks_removal(store, redis_client):
    h = item(b"h", os.urandom(MIB + 10), ttl_s=1)
    store.put_many([h])
    grant = store.lease([h.key], ttl_s=60)
    assert grant.outcomes[0].status == Status.FOUND
    assert all(redis_client.pttl(n) > 30_000 for n in names(redis_client, b"kdamesh:[oc]:*"))
    assert store.remove([h.key])[0].status == Status.LEASED
    assert store.stats().leased_objects == 1 and store.stats().active_leases == 1
    assert store.release(grant.lease_id) == (True, 1)
    assert store.remove([h.key])[0].status == Status.REMOVED
    assert names(redis_client, OBJECT_KEYS) == []


def test_a_lease_pins_until_its_deadline_on_the_stores_clock(redis_url):
    clock = FakeClock(time.time())  # lease deadlines are Unix seconds
    store = RedisStore(redis_url, clock=clock)
    try:
        a, b = item(b"a", b"A"), item(b"b", b"B")
        store.put_many([a, b])
        store.lease([a.key, b.key], ttl_s=5)
        clock.advance(4.9)
        assert [o.status for o in store.remove([a.key])] == [Status.LEASED]
        clock.advance(0.2)  # past the deadline: Redis still holds the pin set (its own expiry), it pins nothing
        assert store.stats().leased_objects == 0
        assert [o.status for o in store.remove([a.key, b.key])] == [Status.REMOVED] * 2
    finally:
        store.close()


def test_prefixes_isolate_stores(redis_url, store):
    other = RedisStore(redis_url, key_prefix=b"other[*]:")
    try:
        it = item(b"a", b"A")
        store.put_many([it])
        assert other.get_many([it.key])[0].status == Status.MISSING
        assert other.stats().objects == 0 and store.stats().objects == 1
    finally:
        other.close()


def test_a_corrupt_manifest_is_corrupt_and_deleted(store, redis_client):
    it = item(b"a", b"payload")
    store.put_many([it])
    redis_client.setrange(b"kdamesh:o:" + it.key, 0, b"JUNK")
    got = store.get_many([it.key])[0]
    assert got.status == Status.CORRUPT and "manifest" in got.message
    assert store.stats().counters.corrupt_reads == 1 and names(redis_client, OBJECT_KEYS) == []


def test_stats_scan_objects_and_bytes(store):
    store.put_many([item(b"a", b"1" * 10), item(b"b", os.urandom(MIB + 5))])
    stats = store.stats()
    assert (stats.backend, stats.objects, stats.stored_bytes, stats.capacity_bytes) == ("redis", 2, MIB + 15, 0)
