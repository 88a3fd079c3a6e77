"""The cache service's KV event stream (cache_service/kv_stream.py, server.py): the memory store reports every KV
block and KDA snapshot object it gains or loses (stored, evicted, removed, expired), other kinds not; the service
streams them on the workers' contract (snapshot first, `any_model`, then batches); a backend that cannot see its
own evictions answers UNIMPLEMENTED."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from cache_service.config import CacheServiceConfig
from cache_service.kv_stream import StoreEventLog, StoreEventSource, object_event
from cache_service.memory_store import MemoryStore
from cache_service.objects import Checksum, encode_key
from cache_service.server import StoreEventServicer, serve
from cache_service.store import PutItem
from protos import common_pb2, kv_events_pb2, kv_events_pb2_grpc

KV, SNAP, HANDOFF = (common_pb2.OBJECT_KIND_KV_BLOCK, common_pb2.OBJECT_KIND_STATE_SNAPSHOT,
                     common_pb2.OBJECT_KIND_HANDOFF)
BLOCK_STORED, BLOCK_REMOVED = kv_events_pb2.KV_EVENT_KIND_BLOCK_STORED, kv_events_pb2.KV_EVENT_KIND_BLOCK_REMOVED
SNAP_STORED = kv_events_pb2.KV_EVENT_KIND_SNAPSHOT_STORED


def h(i: int) -> bytes:
    return bytes([i]) * 32


def put(store: MemoryStore, kind: int, i: int, size: int = 100, ttl_s: float | None = None, salt: bytes = b"t1"):
    data = bytes([i]) * size
    key = encode_key(b"fp", salt, kind, h(i))
    return store.put_many([PutItem(key, data, Checksum.of(data), ttl_s)])[0].status


def test_object_event_reads_the_content_hash_of_block_and_snapshot_keys_only():
    assert object_event(encode_key(b"fingerprint", b"salt", KV, h(1)), True) == (BLOCK_STORED, h(1))
    assert object_event(encode_key(b"", b"", SNAP, h(2)), False) == (kv_events_pb2.KV_EVENT_KIND_SNAPSHOT_REMOVED,
                                                                     h(2))
    assert object_event(encode_key(b"fp", b"salt", HANDOFF, h(3)), True) is None
    assert object_event(encode_key(b"fp", b"salt", KV, h(4)), True) != (BLOCK_STORED, h(1))  # negative control


def test_memory_store_reports_what_it_gains_and_loses(clock):
    store = MemoryStore(byte_budget=1000, high_watermark=0.9, low_watermark=0.8, clock=clock)
    assert put(store, KV, 1) == put(store, HANDOFF, 9, ttl_s=5) == put(store, SNAP, 2)
    log = StoreEventLog()
    assert len(store.start_events(log)) == 3  # what it held before recording began is the listing
    put(store, KV, 3)
    store.remove([encode_key(b"fp", b"t1", SNAP, h(2))])
    clock.now += 10
    store.expire()  # the handoff expires: not streamed
    for i in range(4, 12):  # past the watermark: the least recent objects are evicted
        put(store, KV, i)
    events, lost = log.drain()
    assert not lost
    assert events[:2] == [(BLOCK_STORED, h(3)), (kv_events_pb2.KV_EVENT_KIND_SNAPSHOT_REMOVED, h(2))]
    evicted = {e for k, e in events if k == BLOCK_REMOVED}
    assert h(1) in evicted and h(3) in evicted
    held = {e for k, e in events if k == BLOCK_STORED} - evicted
    assert held == {bytes(k[-32:]) for k in store._entries}  # the events replay to exactly what it holds


def test_an_overflowing_log_reports_lost_once():
    log = StoreEventLog(capacity=2)
    for i in range(3):
        log.record(encode_key(b"fp", b"s", KV, h(i)), True)
    assert log.drain() == ([(BLOCK_STORED, h(2))], True)
    assert log.drain() == ([], False)


def test_the_service_streams_its_blocks_and_snapshots(clock):
    async def main():
        server, port = await serve(CacheServiceConfig(address="127.0.0.1:0", memory_arena="heap"))
        put(server.store, KV, 1)
        await asyncio.sleep(0.2)  # drained into the publisher's mirror (every 20 ms)
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        try:
            call = kv_events_pb2_grpc.KVEventServiceStub(channel).Subscribe(kv_events_pb2.KVSubscribeRequest())
            first = await asyncio.wait_for(call.read(), 5)
            snap = first.snapshot
            assert snap.any_model and not snap.loads_remote_prefix and snap.block_size == 0
            assert list(snap.block_hashes) == [h(1)] and not snap.snapshot_hashes
            put(server.store, SNAP, 1, salt=b"another tenant")  # every tenant's objects
            while True:
                message = await asyncio.wait_for(call.read(), 5)
                if message.events.events:
                    break
            assert message.sequence == first.sequence
            assert [(e.kind, e.block_hash) for e in message.events.events] == [(SNAP_STORED, h(1))]
            call.cancel()
        finally:
            await channel.close()
            await server.stop(0)
    asyncio.run(main())


class _Context:
    async def abort(self, code, details):
        raise grpc.aio.AbortError(f"{code.name}: {details}")


def test_a_backend_without_events_answers_unimplemented():
    class RedisLike:
        backend = "redis"

    async def main():
        servicer = StoreEventServicer(RedisLike())
        await servicer.start()
        assert servicer.publisher is None and not StoreEventSource.supported(RedisLike())
        with pytest.raises(grpc.aio.AbortError, match="UNIMPLEMENTED: the redis backend publishes no KV events"):
            async for _ in servicer.Subscribe(kv_events_pb2.KVSubscribeRequest(), _Context()):
                pass
    asyncio.run(main())
