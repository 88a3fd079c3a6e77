"""The Redis store and the cache service on a real Redis Cluster (3 masters, tests/redis_cluster.py): hash-tagged
keys (an object's manifest, chunks and pins in one slot: no CROSSSLOT), objects spread over every master, puts,
gets and handoffs over gRPC and the direct Redis plane, corruption detection, a lost chunk. The node restart is in
tests/faults/test_redis_cluster_faults.py. The backend-parametrised tests of test_cache_service.py run here too."""

import asyncio
import contextlib
import os
import time

import pytest
import redis
from redis.crc import key_slot

from cache_service.client import CacheClient, PutObject
from cache_service.config import CacheServiceConfig
from cache_service.objects import Checksum, Status, encode_key, encode_object_key
from cache_service.redis_layout import RedisKeys, hash_tag
from cache_service.redis_store import RedisStore
from cache_service.server import serve
from cache_service.store import PutItem
from tests.integration.cache_objects import FP, HANDOFF, KV, MIB, PREFIX, SALT, key, statuses
from tests.integration.cache_objects import run as run_bounded






@contextlib.asynccontextmanager
async def service(backend: str, **overrides):
    """-> (client on the direct plane, client on gRPC only)."""
    server, port = await serve(CacheServiceConfig(address="127.0.0.1:0", backend=backend, **overrides))
    direct = CacheClient(f"127.0.0.1:{port}", timeout_s=10)
    grpc_only = CacheClient(f"127.0.0.1:{port}", timeout_s=10, data_plane="grpc")
    try:
        yield direct, grpc_only
    finally:
        await direct.close()
        await grpc_only.close()
        await server.stop(0.5)


def test_an_objects_keys_share_one_slot_and_objects_spread_over_every_master(redis_cluster):
    store = RedisStore(redis_cluster.url, chunk_bytes=1 << 16, inline_bytes=1024)
    try:
        items = [PutItem(encode_key(FP, SALT, KV, b"k%d" % i), data, Checksum.of(data), 30 if i % 3 == 0 else None)
                 for i, data in enumerate(os.urandom(200_000 if i % 2 else 500) for i in range(24))]
        assert statuses(store.put_many(items)) == [Status.STORED] * 24  # MSET of chunks + manifest: one slot
        grant = store.lease([it.key for it in items[:6]], ttl_s=30)
        assert statuses(grant.outcomes) == [Status.FOUND] * 6
        names = redis_cluster.names(PREFIX + b"[ocp]:*")
        for it in items:
            tag = hash_tag(it.key)
            mine = [(port, n) for port, n in names if tag in n]
            assert len({port for port, _ in mine}) == 1 and len({key_slot(n) for _, n in mine}) == 1
            assert len(mine) == (1 if len(it.data) <= 1024 else 1 + 4) + (1 if it in items[:6] else 0)
        assert {port for port, _ in names} == set(redis_cluster.ports)  # every master holds objects
        assert [g.data for g in store.get_many([it.key for it in items])] == [it.data for it in items]
        assert store.stats().objects == 24 and store.stats().leased_objects == 6
        assert store.release(grant.lease_id) == (True, 6)
        assert statuses(store.remove([it.key for it in items])) == [Status.REMOVED] * 24
        assert redis_cluster.names(PREFIX + b"[ocpl]:*") == []
    finally:
        store.close()


def test_the_direct_plane_on_a_cluster_reads_and_writes_what_the_service_does(redis_cluster):
    objects = [PutObject(key("small"), os.urandom(1000)), PutObject(key("big"), os.urandom(3 * MIB + 5)),
               PutObject(key("empty"), b""), PutObject(key("h", HANDOFF), b"handoff")]

    async def body():
        async with service(redis_cluster.url) as (direct, grpc_only):
            assert statuses(await direct.put_objects(objects[:2])) == [Status.STORED] * 2
            assert direct.data_planes.kind == "redis"  # the cluster URL is the direct plane's too
            assert statuses(await grpc_only.put_objects(objects[2:])) == [Status.STORED] * 2
            for reader in (direct, grpc_only):
                got = await reader.get_objects([o.key for o in objects])
                assert [g.data for g in got] == [o.data for o in objects]
            stats = await grpc_only.stats()
            assert (stats.puts, stats.hits, stats.misses, stats.errors) == (4, 8, 0, 0)

    run(body())


def test_handoffs_expire_on_the_cluster_and_leases_hold_them(redis_cluster):
    handoffs = [PutObject(key("h1", HANDOFF), b"handoff 1"), PutObject(key("h2", HANDOFF), os.urandom(2 * MIB)),
                PutObject(key("block"), b"kv")]

    async def body():
        async with service(redis_cluster.url, handoff_ttl_s=1.0) as (direct, _):
            await direct.put_objects(handoffs)
            lease = await direct.lease([key("h2", HANDOFF)], ttl_s=5)
            node = {port: redis_cluster.node(port) for port in redis_cluster.ports}
            ttls = {n: node[port].pttl(n) for port, n in redis_cluster.names(PREFIX + b"[oc]:*")}
            assert len(ttls) == 3 + 2 and sorted(ttls.values())[0] == -1  # the KV block: no expiry
            assert sum(1 for t in ttls.values() if 0 < t <= 1000) == 1 and sum(1 for t in ttls.values() if t > 1000) == 3
            deadline = time.monotonic() + 10
            while statuses(await direct.get_objects([key("h1", HANDOFF)])) != [Status.MISSING]:
                assert time.monotonic() < deadline, "the unclaimed handoff never expired"
                await asyncio.sleep(0.05)
            got = await direct.get_objects([o.key for o in handoffs])
            assert statuses(got) == [Status.MISSING, Status.FOUND, Status.FOUND] and got[1].data == handoffs[1].data
            assert lease.lease_id

    run(body())


def test_without_hash_tags_an_objects_mset_is_crossslot(redis_cluster):
    """The negative control of the tags: the single-Redis names of one object land in different slots, and the
    cluster refuses their MSET."""
    k, data = encode_key(FP, SALT, KV, b"x"), os.urandom(100)
    untagged, tagged = RedisKeys(PREFIX), RedisKeys(PREFIX, tagged=True)
    plain = [untagged.manifest(k), untagged.chunk(k, Checksum.of(data), 0)]
    assert key_slot(plain[0]) != key_slot(plain[1])
    assert key_slot(tagged.manifest(k)) == key_slot(tagged.chunk(k, Checksum.of(data), 0)) == key_slot(tagged.pins(k))
    with pytest.raises(redis.ResponseError, match="hash to the same slot"):  # CROSSSLOT
        redis_cluster.node(redis_cluster.ports[0]).mset(dict.fromkeys(plain, data))


def _flip_byte(client, name: bytes, offset: int) -> None:
    value = client.getrange(name, offset, offset)
    client.setrange(name, offset, bytes([value[0] ^ 0xFF]))


def test_a_flipped_byte_on_a_cluster_node_is_corrupt_counted_and_deleted(redis_cluster):
    async def body():
        async with service(redis_cluster.url) as (direct, grpc_only):
            await grpc_only.put_objects([PutObject(key("small"), os.urandom(1000)),
                                         PutObject(key("big"), os.urandom(3 * MIB)), PutObject(key("ok"), b"fine")])
            small = PREFIX + b"o:" + hash_tag(encode_object_key(key("small"))) + encode_object_key(key("small"))
            [(port, _)] = [(p, n) for p, n in redis_cluster.names(PREFIX + b"o:*") if n == small]
            _flip_byte(redis_cluster.node(port), small, 500)  # the inline payload
            port, chunk = redis_cluster.names(PREFIX + b"c:*")[1]
            _flip_byte(redis_cluster.node(port), chunk, 12345)  # one chunk of the chunked object
            got = await direct.get_objects([key("small"), key("big"), key("ok")])  # read on the direct plane
            assert statuses(got) == [Status.CORRUPT, Status.CORRUPT, Status.FOUND]
            stats = await grpc_only.stats()
            assert (stats.corrupt_reads, stats.misses, stats.hits) == (2, 2, 1)
            assert statuses(await grpc_only.get_objects([key("small"), key("big")])) == [Status.MISSING] * 2
            assert redis_cluster.names(PREFIX + b"c:*") == []  # the corrupt object's chunks are gone

    run(body())


def test_a_lost_chunk_on_a_cluster_is_a_miss_and_the_manifest_goes(redis_cluster):
    async def body():
        async with service(redis_cluster.url) as (_, grpc_only):
            await grpc_only.put_objects([PutObject(key("big"), os.urandom(2 * MIB + 1))])
            port, chunk = redis_cluster.names(PREFIX + b"c:*")[0]
            redis_cluster.node(port).delete(chunk)
            assert statuses(await grpc_only.get_objects([key("big")])) == [Status.MISSING]
            assert redis_cluster.names(PREFIX + b"o:*") == []

    run(body())


def run(coro, timeout_s: float = 60):
    """A cluster test body: a longer bound than a single Redis's (slot maps are read on the first call)."""
    return run_bounded(coro, timeout_s)
