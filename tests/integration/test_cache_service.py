"""The cache service end to end: an in-process grpc.aio server on a free port, the asyncio client, and the memory
backend, a real Redis or a real Redis Cluster (3 masters)."""

import asyncio
import contextlib
import os
import time
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from cache_service.client import CacheClient, PutObject
from cache_service.objects import Status, encode_object_key, object_key
from cache_service.config import CacheServiceConfig
from cache_service.server import SERVICE_NAME, serve
from tests.integration.cache_objects import FP, HANDOFF, KV, MIB, PREFIX, SALT, SNAPSHOT, key, run, statuses
from protos import cache_pb2, cache_pb2_grpc, common_pb2
from tests.fake_clock import FakeClock





@contextlib.asynccontextmanager
async def service(backend: str, clock=time.monotonic, **overrides):
    config = CacheServiceConfig(address="127.0.0.1:0", backend=backend, **overrides)
    server, port = await serve(config, clock=clock)
    client = CacheClient(f"127.0.0.1:{port}", timeout_s=10)
    try:
        yield server, client
    finally:
        await client.close()
        await server.stop(0.5)


@pytest.fixture(params=["memory", "redis", "redis-cluster"])
def backend(request) -> str:
    fixtures = {"redis": "redis_url", "redis-cluster": "redis_cluster_url"}
    return "memory" if request.param == "memory" else request.getfixturevalue(fixtures[request.param])



def test_objects_larger_than_the_message_limit_round_trip(backend):
    big, small = os.urandom(6 * MIB + 123), os.urandom(1000)

    async def body():
        async with service(backend) as (_, client):
            objects = [PutObject(key("big"), big), PutObject(key("small", SNAPSHOT), small),
                       PutObject(key("empty"), b"")]
            assert statuses(await client.put_objects(objects)) == [Status.STORED] * 3
            got = await client.get_objects([key("small", SNAPSHOT), key("nope"), key("big"), key("empty"),
                                            key("big", salt=b"tenant-b")])
            assert statuses(got) == [Status.FOUND, Status.MISSING, Status.FOUND, Status.FOUND, Status.MISSING]
            assert got[0].data == small and got[2].data == big and got[3].data == b""

    run(body())


def test_lookup_returns_the_prefix_hit_length(backend):
    async def body():
        async with service(backend) as (_, client):
            await client.put_objects([PutObject(key(f"b{i}"), b"kv%d" % i) for i in (0, 1, 2, 3, 5)])
            hashes = [f"b{i}".encode() for i in range(8)]
            assert (await client.lookup(FP, SALT, KV, hashes)).prefix_hit_length == 4
            full = await client.lookup(FP, SALT, KV, hashes, include_presence=True)
            assert full.present == [True] * 4 + [False, True, False, False] and not full.error
            assert (await client.lookup(FP, b"tenant-b", KV, hashes)).prefix_hit_length == 0
            assert (await client.lookup(FP, SALT, SNAPSHOT, hashes)).prefix_hit_length == 0
            bad = await client.lookup(FP, SALT, KV, [b"b0", b""])
            assert bad.prefix_hit_length == 0 and "INVALID_ARGUMENT" in bad.error

    run(body())


def test_lease_release_and_remove(backend):
    async def body():
        async with service(backend) as (_, client):
            await client.put_objects([PutObject(key("a"), b"A"), PutObject(key("b"), b"B")])
            lease = await client.lease([key("a"), key("zz")], ttl_s=30)
            assert lease.lease_id and statuses(lease.results) == [Status.FOUND, Status.MISSING]
            assert statuses(await client.remove([key("a"), key("b"), key("zz")])) == \
                [Status.LEASED, Status.REMOVED, Status.MISSING]
            assert (await client.stats()).leased_objects == 1
            assert await client.release(lease.lease_id) is True
            assert await client.release(lease.lease_id) is False
            assert statuses(await client.remove([key("a")])) == [Status.REMOVED]
            assert statuses(await client.get_objects([key("a"), key("b")])) == [Status.MISSING] * 2
            await client.put_objects([PutObject(key("c"), b"C")])
            lease = await client.lease([key("c")])
            assert lease.ttl_s == 30.0
            assert statuses(await client.remove([key("c")], force=True)) == [Status.REMOVED]

    run(body())


def test_stats_count_objects_bytes_hits_and_misses(backend):
    async def body():
        async with service(backend) as (_, client):
            await client.put_objects([PutObject(key("a"), b"x" * 100), PutObject(key("b"), b"y" * 50)])
            await client.get_objects([key("a"), key("b"), key("c")])
            stats = await client.stats()
            assert stats.backend == ("memory" if backend == "memory" else "redis")
            assert (stats.objects, stats.stored_bytes, stats.puts) == (2, 150, 2)
            assert (stats.hits, stats.misses, stats.corrupt_reads) == (2, 1, 0)

    run(body())


HANDOFFS = [PutObject(key("h1", HANDOFF), b"handoff 1"), PutObject(key("h2", HANDOFF), b"handoff 2"),
            PutObject(key("h3", HANDOFF), b"no expiry", ttl_s=0), PutObject(key("block"), b"kv")]


def test_unclaimed_handoffs_expire_and_leases_hold_them():
    """The memory backend on a fake clock: the service's handoff TTL passes without sleeping."""
    clock = FakeClock()

    async def body():
        async with service("memory", clock=clock, handoff_ttl_s=0.3) as (_, client):
            await client.put_objects(HANDOFFS)
            lease = await client.lease([key("h2", HANDOFF)], ttl_s=5)
            clock.advance(0.6)
            got = await client.get_objects([o.key for o in HANDOFFS])
            assert statuses(got) == [Status.MISSING, Status.FOUND, Status.FOUND, Status.FOUND]
            assert lease.lease_id

    run(body())


def test_unclaimed_handoffs_expire_in_redis_and_leases_hold_them(redis_url, redis_client):
    """Redis expires keys on its own clock: the TTLs the service set are read back (PTTL, no race with time), then
    the expiry itself is awaited."""
    async def body():
        async with service(redis_url, handoff_ttl_s=1.0) as (_, client):
            await client.put_objects(HANDOFFS)
            lease = await client.lease([key("h2", HANDOFF)], ttl_s=5)
            ttl_ms = [redis_client.pttl(PREFIX + b"o:" + encode_object_key(o.key)) for o in HANDOFFS]
            assert 0 < ttl_ms[0] <= 1000 and ttl_ms[1] > 1000 and ttl_ms[2:] == [-1, -1]  # -1: no expiry
            deadline = time.monotonic() + 10
            while statuses(await client.get_objects([key("h1", HANDOFF)])) != [Status.MISSING]:
                assert time.monotonic() < deadline, "the unclaimed handoff never expired"
                await asyncio.sleep(0.05)
            got = await client.get_objects([o.key for o in HANDOFFS])
            assert statuses(got) == [Status.MISSING, Status.FOUND, Status.FOUND, Status.FOUND]
            assert lease.lease_id

    run(body())


def test_invalid_keys_get_per_key_statuses(backend):
    async def body():
        async with service(backend) as (_, client):
            bad = object_key(FP, SALT, common_pb2.OBJECT_KIND_UNSPECIFIED, b"x")
            results = await client.put_objects([PutObject(bad, b"1"), PutObject(key("ok"), b"2")])
            assert statuses(results) == [Status.INVALID, Status.STORED]
            assert statuses(await client.get_objects([bad, key("ok")])) == [Status.MISSING, Status.FOUND]
            assert statuses(await client.remove([bad])) == [Status.INVALID]

    run(body())


def test_deadlines_end_calls_with_error_statuses(backend):
    async def body():
        async with service(backend) as (_, client):
            await client.put_objects([PutObject(key("big"), os.urandom(6 * MIB))])
            got = await client.get_objects([key("big")], timeout_s=0.0005)
            assert statuses(got) == [Status.ERROR] and "DEADLINE_EXCEEDED" in got[0].message

    run(body())


def test_a_broken_put_stream_is_refused_and_leaves_nothing(backend):
    async def body():
        async with service(backend) as (server, client):
            stub = cache_pb2_grpc.CacheServiceStub(client._channel)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.BatchPut(iter([cache_pb2.PutChunk(data=b"stray bytes")]))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            header = cache_pb2.ObjectHeader(key=key("half"), size_bytes=10)
            header.checksum.algorithm, header.checksum.value = cache_pb2.CHECKSUM_ALGORITHM_CRC32, b"\0" * 4
            response = await stub.BatchPut(iter([cache_pb2.PutChunk(header=header, data=b"12345")]))
            assert [r.status for r in response.results] == [cache_pb2.KEY_STATUS_INVALID]
            assert statuses(await client.get_objects([key("half")])) == [Status.MISSING]

    run(body())


def test_health_serving_and_reflection():
    async def body():
        async with service("memory") as (server, client):
            health = health_pb2_grpc.HealthStub(client._channel)
            for name in ("", SERVICE_NAME):
                reply = await health.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
            reflect = reflection_pb2_grpc.ServerReflectionStub(client._channel)
            names = set()
            async for reply in reflect.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(
                    list_services="")]), timeout=5):
                names |= {s.name for s in reply.list_services_response.service}
            assert {SERVICE_NAME, "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= names
            await server.health.enter_graceful_shutdown()
            reply = await health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING

    run(body())


def test_metrics_endpoint_and_transfer_counters():
    async def body():
        async with service("memory", metrics_port=0) as (server, client):
            await client.put_objects([PutObject(key("a"), b"z" * 4096)])
            await client.get_objects([key("a")])
            url = f"http://127.0.0.1:{server.metrics_port}/metrics"
            text = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=5).read().decode())
            assert 'kdamesh_cache_transfer_bytes_total{direction="put"} 4096.0' in text
            assert 'kdamesh_cache_transfer_bytes_total{direction="get"} 4096.0' in text
            assert "kdamesh_cache_objects 1.0" in text and "kdamesh_cache_hits_total 1.0" in text

    run(body())


def test_an_unreachable_service_gives_error_statuses_not_exceptions(closed_port):
    async def body():
        async with CacheClient(f"127.0.0.1:{closed_port}", timeout_s=1) as client:
            started = time.monotonic()
            assert statuses(await client.put_objects([PutObject(key("a"), b"1")])) == [Status.ERROR]
            got = await client.get_objects([key("a"), key("b")])
            assert statuses(got) == [Status.ERROR] * 2 and "UNAVAILABLE" in got[0].message
            assert statuses((await client.lease([key("a")])).results) == [Status.ERROR]
            assert statuses(await client.remove([key("a")])) == [Status.ERROR]
            assert (await client.lookup(FP, SALT, KV, [b"a"])).error
            assert await client.release("x") is False
            assert time.monotonic() - started < 8

    run(body())


# -- Redis specifics ------------------------------------------------------------------------------------------------


def _flip_byte(redis_client, name: bytes, offset: int) -> None:
    value = redis_client.getrange(name, offset, offset)
    redis_client.setrange(name, offset, bytes([value[0] ^ 0xFF]))


def test_a_flipped_byte_in_redis_is_corrupt_counted_and_a_miss(redis_url, redis_client):
    small, big = os.urandom(1000), os.urandom(3 * MIB)

    async def body():
        async with service(redis_url) as (_, client):
            await client.put_objects([PutObject(key("small"), small), PutObject(key("big"), big),
                                      PutObject(key("ok"), b"fine")])
            _flip_byte(redis_client, PREFIX + b"o:" + encode_object_key(key("small")), 500)  # inline payload
            chunk = sorted(redis_client.scan_iter(match=PREFIX + b"c:*"))[1]
            _flip_byte(redis_client, chunk, 12345)  # one chunk of the chunked object
            got = await client.get_objects([key("small"), key("big"), key("ok")])
            assert statuses(got) == [Status.CORRUPT, Status.CORRUPT, Status.FOUND]
            stats = await client.stats()
            assert (stats.corrupt_reads, stats.misses, stats.hits) == (2, 2, 1)
            assert statuses(await client.get_objects([key("small"), key("big")])) == [Status.MISSING] * 2
            assert (await client.lookup(FP, SALT, KV, [b"small"])).prefix_hit_length == 0
            assert not list(redis_client.scan_iter(match=PREFIX + b"c:*"))  # the corrupt object's chunks are gone

    run(body())


def test_flushdb_turns_objects_into_misses(redis_url, redis_client):
    async def body():
        async with service(redis_url) as (_, client):
            await client.put_objects([PutObject(key("a"), b"A"), PutObject(key("big"), os.urandom(2 * MIB))])
            redis_client.flushdb()
            assert statuses(await client.get_objects([key("a"), key("big")])) == [Status.MISSING] * 2
            assert (await client.lookup(FP, SALT, KV, [b"a"])).prefix_hit_length == 0
            assert statuses(await client.put_objects([PutObject(key("a"), b"A")])) == [Status.STORED]
            assert (await client.get_objects([key("a")]))[0].data == b"A"

    run(body())


def test_a_lost_chunk_is_a_miss(redis_url, redis_client):
    async def body():
        async with service(redis_url) as (_, client):
            await client.put_objects([PutObject(key("big"), os.urandom(2 * MIB + 1))])
            redis_client.delete(sorted(redis_client.scan_iter(match=PREFIX + b"c:*"))[0])
            assert statuses(await client.get_objects([key("big")])) == [Status.MISSING]
            assert (await client.lookup(FP, SALT, KV, [b"big"])).prefix_hit_length == 0

    run(body())


def test_redis_down_gives_error_statuses_quickly(closed_port):
    async def body():
        async with service(f"redis://127.0.0.1:{closed_port}/0") as (_, client):
            started = time.monotonic()
            results = await client.put_objects([PutObject(key("a"), b"1"), PutObject(key("b"), os.urandom(2 * MIB))])
            assert statuses(results) == [Status.ERROR] * 2 and "redis unavailable" in results[0].message
            assert statuses(await client.get_objects([key("a"), key("b")])) == [Status.ERROR] * 2
            assert statuses((await client.lease([key("a")])).results) == [Status.ERROR]
            assert statuses(await client.remove([key("a")])) == [Status.ERROR]
            assert "UNAVAILABLE" in (await client.lookup(FP, SALT, KV, [b"a"])).error
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await client.stats()
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert time.monotonic() - started < 5

    run(body())


def test_the_service_survives_a_redis_restart(private_redis):
    async def body():
        async with service(private_redis.url) as (_, client):
            assert statuses(await client.put_objects([PutObject(key("a"), b"A")])) == [Status.STORED]
            private_redis.stop()
            assert statuses(await client.get_objects([key("a")])) == [Status.ERROR]
            private_redis.start()  # same port, empty
            assert statuses(await client.get_objects([key("a")])) == [Status.MISSING]
            assert statuses(await client.put_objects([PutObject(key("a"), b"A")])) == [Status.STORED]
            assert (await client.get_objects([key("a")]))[0].data == b"A"

    run(body())
