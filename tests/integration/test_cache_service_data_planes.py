"""The direct data planes end to end: an in-process service on a free port, a client on the direct plane and one on
gRPC only, a real Redis. The direct Redis plane writes what the service writes, byte for byte, and is counted; the
shared-memory plane round-trips like gRPC, frees what it does not commit, fails closed on corruption, and a client
that cannot map the service's arena falls back to gRPC."""

import asyncio
import contextlib
import logging
import os
import signal
import time

import grpc
import pytest

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from cache_service import servicer as servicer_module
from cache_service.client import CacheClient, PutObject
from cache_service.config import CacheServiceConfig
from cache_service.holds import PIN, RESERVATION
from cache_service.objects import Checksum, ChecksumAlgorithm, Status, encode_object_key, object_key
from cache_service.server import serve
from tests.integration.cache_objects import FP, HANDOFF, MIB, PREFIX, SALT, key, run, statuses
from protos import cache_pb2, cache_pb2_grpc, common_pb2
from tests.fake_clock import FakeClock






@contextlib.asynccontextmanager
async def service(backend: str, tracer_provider=None, clock=time.monotonic, **overrides):
    """-> (server, client on the direct plane, client on gRPC only)."""
    server, port = await serve(CacheServiceConfig(address="127.0.0.1:0", backend=backend, **overrides),
                               tracer_provider=tracer_provider, clock=clock)
    direct = CacheClient(f"127.0.0.1:{port}", timeout_s=10)
    grpc_only = CacheClient(f"127.0.0.1:{port}", timeout_s=10, data_plane="grpc")
    try:
        yield server, direct, grpc_only
    finally:
        await direct.close()
        await grpc_only.close()
        await server.stop(0.5)


def mixed_objects(tag: str) -> list[PutObject]:
    """Inline, at the inline limit, one chunk, several chunks, empty, with TTLs, an invalid key."""
    bad = object_key(FP, SALT, common_pb2.OBJECT_KIND_UNSPECIFIED, b"x")
    return [PutObject(key(f"{tag}-small"), os.urandom(1000)), PutObject(key(f"{tag}-edge"), os.urandom(16 << 10)),
            PutObject(key(f"{tag}-one"), os.urandom(MIB)), PutObject(key(f"{tag}-big"), os.urandom(3 * MIB + 5)),
            PutObject(key(f"{tag}-empty"), b""), PutObject(key(f"{tag}-h", HANDOFF), b"handoff"),
            PutObject(key(f"{tag}-ttl"), b"ttl", ttl_s=60), PutObject(bad, b"bad")]


def redis_snapshot(redis_client) -> dict[bytes, tuple[bytes, bool]]:
    """Every object key -> (value, has a TTL). Leaves out the counter hash."""
    names = redis_client.scan_iter(match=PREFIX + b"[oc]:*")
    return {n: (redis_client.get(n), redis_client.pttl(n) > 0) for n in names}


# -- Redis ---------------------------------------------------------------------------------------------------------


def test_the_direct_redis_plane_writes_what_the_service_writes(redis_url, redis_client):
    async def body():
        async with service(redis_url) as (_, direct, grpc_only):
            objects = mixed_objects("x")
            via_direct = await direct.put_objects(objects)
            assert direct.data_planes.kind == "redis"
            written = redis_snapshot(redis_client)
            redis_client.flushdb()
            via_grpc = await grpc_only.put_objects(objects)
            assert grpc_only.data_planes.kind == "grpc"
            assert statuses(via_direct) == statuses(via_grpc) == [Status.STORED] * 7 + [Status.INVALID]
            assert redis_snapshot(redis_client) == written and len(written) == 7 + 1 + 4  # chunks: one, big
            keys = [o.key for o in objects]
            for reader in (direct, grpc_only):
                got = await reader.get_objects(keys)
                assert statuses(got) == [Status.FOUND] * 7 + [Status.MISSING]
                assert [g.data for g in got[:7]] == [o.data for o in objects[:7]]

    run(body())


def test_objects_put_directly_are_read_over_grpc_and_back(redis_url):
    async def body():
        async with service(redis_url, max_object_bytes=4 * MIB) as (_, direct, grpc_only):
            a, b = os.urandom(2 * MIB), os.urandom(5000)
            too_big = PutObject(key("huge"), bytes(4 * MIB + 1))
            put = await direct.put_objects([PutObject(key("a"), a), too_big])
            assert statuses(put) == [Status.STORED, Status.TOO_LARGE] and "exceeds the limit" in put[1].message
            assert statuses(await grpc_only.put_objects([PutObject(key("b"), b), too_big])) == \
                [Status.STORED, Status.TOO_LARGE]
            assert [g.data for g in await grpc_only.get_objects([key("a")])] == [a]
            assert [g.data for g in await direct.get_objects([key("b")])] == [b]

    run(body())


def test_the_service_stats_count_direct_traffic(redis_url, redis_client):
    async def body():
        async with service(redis_url, handoff_ttl_s=30) as (_, direct, grpc_only):
            await direct.put_objects([PutObject(key("a"), os.urandom(MIB)), PutObject(key("h", HANDOFF), b"h")])
            await direct.get_objects([key("a"), key("h", HANDOFF), key("nope")])
            assert statuses(await grpc_only.remove([key("a")])) == [Status.REMOVED]
            stats = await grpc_only.stats()
            assert (stats.puts, stats.hits, stats.misses, stats.removes, stats.errors) == (2, 2, 1, 1, 0)
            ttl = redis_client.pttl(PREFIX + b"o:" + encode_object_key(key("h", HANDOFF)))
            assert 25_000 < ttl <= 30_000  # the service's HANDOFF default, applied by the direct client

    run(body())


def _flip_byte(redis_client, name: bytes, offset: int) -> None:
    value = redis_client.getrange(name, offset, offset)
    redis_client.setrange(name, offset, bytes([value[0] ^ 0xFF]))


def test_a_corrupt_byte_in_redis_is_corrupt_on_the_direct_plane_counted_and_removed(redis_url, redis_client):
    async def body():
        async with service(redis_url) as (_, direct, grpc_only):
            await direct.put_objects([PutObject(key("small"), os.urandom(1000)),
                                      PutObject(key("big"), os.urandom(2 * MIB)), PutObject(key("ok"), b"fine")])
            _flip_byte(redis_client, PREFIX + b"o:" + encode_object_key(key("small")), 500)
            _flip_byte(redis_client, next(redis_client.scan_iter(match=PREFIX + b"c:*")), 12345)
            got = await direct.get_objects([key("small"), key("big"), key("ok")])
            assert statuses(got) == [Status.CORRUPT, Status.CORRUPT, Status.FOUND]
            stats = await grpc_only.stats()
            assert (stats.corrupt_reads, stats.misses, stats.hits, stats.objects) == (2, 2, 1, 1)
            assert not list(redis_client.scan_iter(match=PREFIX + b"c:*"))

    run(body())


def test_redis_down_gives_error_per_key_within_the_deadline(private_redis):
    async def body():
        async with service(private_redis.url) as (_, direct, _grpc):
            assert statuses(await direct.put_objects([PutObject(key("a"), os.urandom(MIB))])) == [Status.STORED]
            private_redis.stop()
            started = time.monotonic()
            got = await direct.get_objects([key("a"), key("b")], timeout_s=3)
            put = await direct.put_objects([PutObject(key("c"), b"c")], timeout_s=3)
            assert statuses(got) == [Status.ERROR] * 2 and statuses(put) == [Status.ERROR]
            assert "redis unavailable" in got[0].message and time.monotonic() - started < 3

    run(body())


def test_a_hung_redis_gives_error_per_key_at_the_deadline(private_redis):
    async def body():
        async with service(private_redis.url) as (_, direct, _grpc):
            assert statuses(await direct.put_objects([PutObject(key("a"), b"A")])) == [Status.STORED]
            private_redis.proc.send_signal(signal.SIGSTOP)  # accepts connections, never answers
            try:
                started = time.monotonic()
                got = await direct.get_objects([key("a")], timeout_s=1)
                assert statuses(got) == [Status.ERROR] and "DEADLINE_EXCEEDED" in got[0].message
                assert time.monotonic() - started < 1.5
            finally:
                private_redis.proc.send_signal(signal.SIGCONT)

    run(body())


def test_a_client_that_cannot_reach_redis_uses_grpc_and_says_so_once(redis_url, closed_port, monkeypatch, caplog):
    def unreachable(store, config):
        answer = describe(store, config)
        answer.redis.url = f"redis://127.0.0.1:{closed_port}/0"  # reachable by the service, not by this client
        return answer

    describe = servicer_module.describe_data_plane
    monkeypatch.setattr(servicer_module, "describe_data_plane", unreachable)

    async def body():
        async with service(redis_url) as (_, direct, grpc_only):
            with caplog.at_level(logging.WARNING, logger="cache_service.data_plane"):
                assert statuses(await direct.put_objects([PutObject(key("a"), b"A")])) == [Status.STORED]
                assert [g.data for g in await direct.get_objects([key("a")])] == [b"A"]
            assert len([r for r in caplog.records if "using gRPC" in r.getMessage()]) == 1
            assert (await grpc_only.stats()).puts == 1

    run(body())


# -- shared memory -------------------------------------------------------------------------------------------------


def test_the_shm_plane_round_trips_like_grpc_and_paths_read_each_other():
    async def body():
        async with service("memory", byte_budget=64 * MIB) as (server, direct, grpc_only):
            objects = mixed_objects("s")
            via_shm = await direct.put_objects(objects)
            assert direct.data_planes.kind == "shm"
            via_grpc = await grpc_only.put_objects(mixed_objects("g"))
            assert statuses(via_shm) == statuses(via_grpc) == [Status.STORED] * 7 + [Status.INVALID]
            keys = [o.key for o in objects]
            for reader in (direct, grpc_only):
                got = await reader.get_objects(keys)
                assert statuses(got) == [Status.FOUND] * 7 + [Status.MISSING]
                assert [g.data for g in got[:7]] == [o.data for o in objects[:7]]
            stats = await grpc_only.stats()
            assert (stats.puts, stats.hits, stats.misses) == (14, 14, 0)  # invalid keys never reach the store
            await asyncio.sleep(0.2)  # Locate pins are released in the background
            assert not server.store._holds.count(PIN) and not server.store._holds.count(RESERVATION)

    run(body())


def test_shm_calls_have_spans_and_count_their_bytes():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))

    async def body():
        async with service("memory", byte_budget=64 * MIB, tracer_provider=provider) as (server, direct, _grpc):
            await direct.put_objects([PutObject(key("a"), os.urandom(MIB))])
            await direct.get_objects([key("a"), key("nope")])
            return server.metrics.transfer_bytes

    transfer = run(body())
    finished = exporter.get_finished_spans()
    by_id = {s.context.span_id: s for s in finished}
    (put,) = [s for s in finished if s.name == "cache.put"]
    gets = [s for s in finished if s.name == "cache.get"]  # the client spreads the keys over up to two calls
    assert by_id[put.parent.span_id].name == "kdamesh.v1.CacheService/Commit"
    assert put.attributes["kdamesh.bytes"] == MIB and put.attributes["kdamesh.cache.data_plane"] == "shm"
    assert {by_id[g.parent.span_id].name for g in gets} == {"kdamesh.v1.CacheService/Locate"}
    assert sum(g.attributes["kdamesh.bytes"] for g in gets) == MIB
    assert sum(g.attributes["kdamesh.keys"] for g in gets) == 2
    assert transfer.labels("put")._value.get() == MIB and transfer.labels("get")._value.get() == MIB


def test_an_uncommitted_reservation_expires_and_frees_its_extent():
    clock = FakeClock()

    async def body():
        async with service("memory", clock=clock, byte_budget=64 * MIB) as (server, direct, _grpc):
            stub = cache_pb2_grpc.CacheServiceStub(direct._channel)
            reply = await stub.Reserve(cache_pb2.ReserveRequest(
                ttl_ms=100, objects=[cache_pb2.ReserveObject(key=key("r"), size_bytes=MIB)]), timeout=5)
            assert reply.results[0].status == Status.RESERVED and reply.reservation_id
            clock.advance(0.2)  # a client that crashed before Commit
            commit = await stub.Commit(cache_pb2.CommitRequest(reservation_id=reply.reservation_id,
                                                               checksums=[Checksum.of(b"").to_proto()]), timeout=5)
            assert not commit.found and not server.store._holds.count(RESERVATION)
            assert statuses(await direct.put_objects([PutObject(key("a"), os.urandom(MIB))])) == [Status.STORED]
            located = await stub.Locate(cache_pb2.LocateRequest(keys=[key("a")], pin_ttl_ms=100), timeout=5)
            assert located.locations[0].offset == reply.results[0].offset  # the freed extent, first fit

    run(body())


def test_a_corrupted_arena_byte_is_corrupt_on_read_counted_and_removed():
    async def body():
        async with service("memory", byte_budget=64 * MIB) as (server, direct, grpc_only):
            await direct.put_objects([PutObject(key("a"), os.urandom(MIB)), PutObject(key("b"), b"fine")])
            arena = server.store.arena
            offset = arena.data_offset + server.store._entries[encode_object_key(key("a"))].offset
            arena.write(offset + 777, bytes([arena.read(offset + 777, 1)[0] ^ 0xFF]))
            got = await direct.get_objects([key("a"), key("b")])
            assert statuses(got) == [Status.CORRUPT, Status.FOUND] and got[1].data == b"fine"
            stats = await grpc_only.stats()
            assert (stats.corrupt_reads, stats.objects) == (1, 1)
            assert statuses(await direct.get_objects([key("a")])) == [Status.MISSING]

    run(body())


def test_a_client_whose_mapping_holds_another_token_uses_grpc(monkeypatch, caplog):
    def elsewhere(store, config):
        answer = describe(store, config)
        answer.shm.token = bytes(16)  # as a client on another host, whose /dev/shm holds something else, sees it
        return answer

    describe = servicer_module.describe_data_plane
    monkeypatch.setattr(servicer_module, "describe_data_plane", elsewhere)

    async def body():
        async with service("memory", byte_budget=64 * MIB) as (server, direct, _grpc):
            with caplog.at_level(logging.INFO, logger="cache_service.data_plane"):
                assert statuses(await direct.put_objects([PutObject(key("a"), b"A")])) == [Status.STORED]
                assert [g.data for g in await direct.get_objects([key("a")])] == [b"A"]
            assert direct.data_planes.kind == "grpc"
            assert any("token mismatch" in r.getMessage() for r in caplog.records)

    run(body())


def test_a_changed_arena_is_noticed_and_rediscovered():
    async def body():
        async with service("memory", byte_budget=64 * MIB) as (_, direct, _grpc):
            await direct.put_objects([PutObject(key("a"), b"A")])
            plane = await direct.data_planes.plane(asyncio.get_running_loop().time() + 5)
            plane.arena.token = bytes(16)  # as after a service restart: the service answers with another token
            assert statuses(await direct.put_objects([PutObject(key("b"), b"B")])) == [Status.STORED]  # over gRPC
            assert direct.data_planes.kind == "unknown"
            assert [g.data for g in await direct.get_objects([key("a"), key("b")])] == [b"A", b"B"]
            assert direct.data_planes.kind == "shm"  # asked again, mapped again

    run(body())


@pytest.mark.parametrize("overrides, reason", [({"memory_arena": "heap"}, "no direct data plane"),
                                               ({"data_plane": False}, "disabled")])
def test_without_an_arena_there_is_only_grpc(overrides, reason):
    async def body():
        async with service("memory", byte_budget=64 * MIB, **overrides) as (_, direct, _grpc):
            stub = cache_pb2_grpc.CacheServiceStub(direct._channel)
            answer = await stub.DataPlane(cache_pb2.DataPlaneRequest(), timeout=5)
            assert answer.WhichOneof("plane") == "grpc" and reason in answer.grpc.reason
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Locate(cache_pb2.LocateRequest(keys=[key("a")]), timeout=5)
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert statuses(await direct.put_objects([PutObject(key("a"), b"A")])) == [Status.STORED]
            assert direct.data_planes.kind == "grpc"

    run(body())


def test_data_plane_describes_each_plane(redis_url):
    async def body():
        async with service(redis_url, redis_key_prefix="p:", handoff_ttl_s=12) as (_, direct, _grpc):
            answer = await cache_pb2_grpc.CacheServiceStub(direct._channel).DataPlane(cache_pb2.DataPlaneRequest())
            r = answer.redis
            assert (r.url, r.key_prefix, r.chunk_bytes, r.inline_bytes) == (redis_url, b"p:", MIB, 16 << 10)
            assert (r.socket_timeout_ms, r.connect_timeout_ms, answer.handoff_ttl_ms) == (2000, 500, 12000)
        async with service("memory", byte_budget=64 * MIB) as (server, direct, _grpc):
            answer = await cache_pb2_grpc.CacheServiceStub(direct._channel).DataPlane(cache_pb2.DataPlaneRequest())
            s, arena = answer.shm, server.store.arena
            assert (s.path, s.size_bytes, s.token) == (str(arena.path), 64 * MIB + 4096, arena.token)
            assert s.token_offset == 64
            assert answer.max_object_bytes == 1 << 30 and os.path.exists(s.path)
        assert not os.path.exists(s.path)  # unlinked at stop

    run(body())


def test_commit_needs_one_checksum_per_reserved_object():
    async def body():
        async with service("memory", byte_budget=64 * MIB) as (_, direct, _grpc):
            stub = cache_pb2_grpc.CacheServiceStub(direct._channel)
            reply = await stub.Reserve(cache_pb2.ReserveRequest(ttl_ms=5000, objects=[
                cache_pb2.ReserveObject(key=key("a"), size_bytes=3),
                cache_pb2.ReserveObject(key=object_key(FP, SALT, 0, b"x"), size_bytes=3)]), timeout=5)
            assert statuses(reply.results) == [Status.RESERVED, Status.INVALID]
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Commit(cache_pb2.CommitRequest(reservation_id=reply.reservation_id), timeout=5)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            bad = cache_pb2.Checksum(algorithm=ChecksumAlgorithm.XXH3_64, value=b"1234")  # 4 bytes: unusable
            commit = await stub.Commit(cache_pb2.CommitRequest(reservation_id=reply.reservation_id,
                                                               checksums=[bad]), timeout=5)
            assert commit.found and statuses(commit.results) == [Status.INVALID]

    run(body())
