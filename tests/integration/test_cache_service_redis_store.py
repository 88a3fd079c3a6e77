"""RedisStore against a real Redis: the stored layout, TTLs and leases, prefixes, corrupt manifests, stats."""

import os

import pytest

from cache_service.objects import Checksum, Status, encode_key
from cache_service.redis_store import RedisStore
from cache_service.store import PutItem

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


def test_small_objects_are_one_key_large_ones_chunks_plus_a_manifest(store, redis_client):
    small, big = item(b"s", b"x" * MIB), item(b"b", os.urandom(2 * MIB + 1))
    assert [o.status for o in store.put_many([small, big])] == [Status.STORED] * 2
    assert len(names(redis_client, b"kdamesh:o:*")) == 2
    chunks = names(redis_client, b"kdamesh:c:*")
    assert len(chunks) == 3 and sorted(redis_client.strlen(c) for c in chunks) == [1, MIB, MIB]
    got = store.get_many([small.key, big.key])
    assert [g.data for g in got] == [small.data, big.data]


def test_ttls_are_redis_expiries(store, redis_client):
    store.put_many([item(b"h", b"handoff", ttl_s=30), item(b"big", os.urandom(MIB + 1), ttl_s=30),
                    item(b"k", b"forever")])
    ttls = {name: redis_client.pttl(name) for name in names(redis_client, b"kdamesh:*")}
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
    assert names(redis_client, b"kdamesh:*") == []


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
    assert store.stats().counters.corrupt_reads == 1 and names(redis_client, b"kdamesh:*") == []


def test_stats_scan_objects_and_bytes(store):
    store.put_many([item(b"a", b"1" * 10), item(b"b", os.urandom(MIB + 5))])
    stats = store.stats()
    assert (stats.backend, stats.objects, stats.stored_bytes, stats.capacity_bytes) == ("redis", 2, MIB + 15, 0)
