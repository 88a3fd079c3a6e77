"""The KV event stream's publishing side (protos/kv_events.proto), shared by every holder of cached prefixes: the
workers (their engine's prefix cache, worker/kv_events.py) and the cache service (what its store holds).

Contract:
- A source is what is mirrored: `await source.start_cache_events()` turns its event recording on and returns the
  listing it starts from (`block_hashes`, `snapshot_hashes`, `block_size`, `snapshots_required`);
  `source.take_cache_events()` -> `(events, lost)` without waiting (`events`: `(kind, hash)` in order, `kind` a
  `KVEventKind` value — the engine's `CacheEventKind` has the same numbers); `source.stats_snapshot()` -> an object
  with `num_running`, `num_waiting`, `kv_usage` (the load every message carries).
- `KVEventPublisher(source, config, fingerprint, any_model=False, loads_remote_prefix=False)` mirrors it:
  `start()` takes the listing, then a task drains the recorded events every `config.poll_interval_s`, numbers them
  (consecutive from 0; `epoch` is random per publisher, so a restart is told apart), applies them to the mirror and
  sends them to every subscriber as one batch; with no events it sends an empty batch (a heartbeat) when the load
  changed or nothing was sent for `config.heartbeat_s`. When the source lost events the publisher lists it again
  and sends every subscriber a fresh snapshot at the current number. The snapshot carries `fingerprint`,
  `any_model` and `loads_remote_prefix` as given.
- `subscribe()` returns a subscription whose first message is a snapshot of the mirror (taken in the same event-loop
  turn the subscription joins, so no event falls between). A subscription more than `config.max_queued_messages`
  behind is ended (`serve_subscription` answers RESOURCE_EXHAUSTED; the gateway resubscribes). `stop()` ends all.
- The cache service's source: `StoreEventLog` records what a store's index stores and drops (`WatchedEntries`, the
  memory store's index: every KV block and KDA snapshot object, by its content hash, whatever model or tenant;
  other kinds are not recorded), bounded like the engine's sink (overflow: everything pending dropped, `lost` once);
  `StoreEventSource(store)` adapts a store with `start_events(log)` to the source contract (no load: zeros).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import struct
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

import grpc

from protos import common_pb2, kv_events_pb2

log = logging.getLogger(__name__)

_END = object()  # queued to end a subscription normally
_BEHIND = object()  # queued when a subscription fell too far behind
_STORED_KINDS = (kv_events_pb2.KV_EVENT_KIND_BLOCK_STORED, kv_events_pb2.KV_EVENT_KIND_SNAPSHOT_STORED)
_BLOCK_KINDS = (kv_events_pb2.KV_EVENT_KIND_BLOCK_STORED, kv_events_pb2.KV_EVENT_KIND_BLOCK_REMOVED)


@dataclass(frozen=True)
class KVEventConfig:
    poll_interval_s: float = 0.02  # how often recorded events are drained and sent (seconds)
    heartbeat_s: float = 0.5  # longest silence on a stream: an empty batch then (seconds)
    max_queued_messages: int = 1024  # a subscriber further behind is ended

    def __post_init__(self):
        if self.poll_interval_s <= 0 or self.heartbeat_s <= 0 or self.max_queued_messages <= 0:
            raise ValueError("poll_interval_s, heartbeat_s and max_queued_messages must be positive")


class SubscriberBehind(Exception):
    pass


class Subscription:
    def __init__(self, first: kv_events_pb2.KVEventMessage, limit: int):
        self.queue: asyncio.Queue = asyncio.Queue()
        self.queue.put_nowait(first)
        self.limit = limit
        self.ended = False

    def put(self, item) -> None:
        if self.ended:
            return
        if item is not _END and self.queue.qsize() >= self.limit:
            item = _BEHIND
        if item is _END or item is _BEHIND:
            self.ended = True
        self.queue.put_nowait(item)

    async def get(self):
        """The next message; None when the subscription ended normally; raises `SubscriberBehind`."""
        item = await self.queue.get()
        if item is _END:
            return None
        if item is _BEHIND:
            raise SubscriberBehind("this KV event subscriber fell too far behind; subscribe again")
        return item


class KVEventPublisher:
    def __init__(self, source, config: KVEventConfig = KVEventConfig(), fingerprint: bytes = b"", *,
                 any_model: bool = False, loads_remote_prefix: bool = False):
        self.source = source
        self.config = config
        self.fingerprint = fingerprint
        self.any_model = any_model
        self.loads_remote_prefix = loads_remote_prefix
        self.epoch = secrets.randbits(63) + 1
        self.sequence = 0  # the number the next event gets
        self.resyncs = 0  # snapshots sent because the source lost events
        self._listing = None
        self._blocks: set[bytes] = set()
        self._snapshots: set[bytes] = set()
        self._subscriptions: set[Subscription] = set()
        self._task: asyncio.Task | None = None
        self._last_sent = time.monotonic()
        self._last_load: kv_events_pb2.WorkerLoad | None = None

    async def start(self) -> None:
        self._reset(await self.source.start_cache_events())
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        for sub in list(self._subscriptions):
            sub.put(_END)
        self._subscriptions.clear()

    def subscribe(self) -> Subscription:
        sub = Subscription(self._snapshot_message(), self.config.max_queued_messages)
        self._subscriptions.add(sub)
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        self._subscriptions.discard(sub)

    # -- the drain loop --------------------------------------------------------------------------------------------

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.config.poll_interval_s)
            try:
                await self.publish_pending()
            except Exception:  # a failed round (source gone) must not end the loop; health reports the source
                log.exception("KV event round failed")

    async def publish_pending(self) -> None:
        """One round of the loop: drain, number, apply, send (or a heartbeat, or a fresh snapshot)."""
        events, lost = self.source.take_cache_events()
        if lost:
            self._reset(await self.source.start_cache_events())
            self.resyncs += 1
            log.warning("KV events were lost; sending subscribers a fresh snapshot")
            self._broadcast(self._snapshot_message())
        elif events:
            first = self.sequence
            for kind, block_hash in events:
                target = self._blocks if kind in _BLOCK_KINDS else self._snapshots
                target.add(block_hash) if kind in _STORED_KINDS else target.discard(block_hash)
            self.sequence += len(events)
            batch = kv_events_pb2.KVEventBatch(events=[kv_events_pb2.KVEvent(kind=int(k), block_hash=h)
                                                       for k, h in events])
            self._broadcast(self._message(first, events=batch))
        elif self._load() != self._last_load or time.monotonic() - self._last_sent >= self.config.heartbeat_s:
            self._broadcast(self._message(self.sequence, events=kv_events_pb2.KVEventBatch()))

    def _reset(self, listing) -> None:
        self._listing = listing
        self._blocks = set(listing.block_hashes)
        self._snapshots = set(listing.snapshot_hashes)

    def _broadcast(self, message: kv_events_pb2.KVEventMessage) -> None:
        self._last_sent = time.monotonic()
        for sub in list(self._subscriptions):
            sub.put(message)
            if sub.ended:
                self._subscriptions.discard(sub)

    def _load(self) -> kv_events_pb2.WorkerLoad:
        stats = self.source.stats_snapshot()
        return kv_events_pb2.WorkerLoad(running=stats.num_running, waiting=stats.num_waiting,
                                        kv_usage=round(stats.kv_usage, 3))

    def _message(self, sequence: int, **body) -> kv_events_pb2.KVEventMessage:
        self._last_load = self._load()
        return kv_events_pb2.KVEventMessage(epoch=self.epoch, sequence=sequence, load=self._last_load, **body)

    def _snapshot_message(self) -> kv_events_pb2.KVEventMessage:
        listing = self._listing
        snapshot = kv_events_pb2.KVCacheSnapshot(
            block_hashes=sorted(self._blocks), snapshot_hashes=sorted(self._snapshots),
            block_size=listing.block_size, fingerprint=self.fingerprint,
            snapshots_required=listing.snapshots_required, any_model=self.any_model,
            loads_remote_prefix=self.loads_remote_prefix)
        return self._message(self.sequence, snapshot=snapshot)


async def serve_subscription(publisher: KVEventPublisher, context):
    """The body of a `Subscribe` call once admitted: the publisher's messages until it ends the subscription."""
    sub = publisher.subscribe()
    try:
        while (message := await sub.get()) is not None:
            yield message
    except SubscriberBehind as exc:
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
    finally:
        publisher.unsubscribe(sub)


# -- the cache service as a source ---------------------------------------------------------------------------------

_OBJECT_EVENTS = {common_pb2.OBJECT_KIND_KV_BLOCK: (kv_events_pb2.KV_EVENT_KIND_BLOCK_STORED,
                                                    kv_events_pb2.KV_EVENT_KIND_BLOCK_REMOVED),
                  common_pb2.OBJECT_KIND_STATE_SNAPSHOT: (kv_events_pb2.KV_EVENT_KIND_SNAPSHOT_STORED,
                                                          kv_events_pb2.KV_EVENT_KIND_SNAPSHOT_REMOVED)}
DEFAULT_LOG_CAPACITY = 1 << 18


def object_event(key: bytes, stored: bool) -> tuple[int, bytes] | None:
    """A store key (`objects.encode_key`) -> its event `(kind, content hash)`, None for kinds not streamed."""
    kinds = _OBJECT_EVENTS.get(key[1]) if len(key) > 1 else None
    if kinds is None:
        return None
    fp_end = 4 + struct.unpack_from(">H", key, 2)[0]
    hash_start = fp_end + 2 + struct.unpack_from(">H", key, fp_end)[0]
    return kinds[0 if stored else 1], key[hash_start:]


class StoreEventLog:
    """Thread-safe, bounded record of a store's object events (fed under the store's lock)."""

    def __init__(self, capacity: int = DEFAULT_LOG_CAPACITY):
        self.capacity = capacity
        self._events: list[tuple[int, bytes]] = []
        self._lost = False
        self._lock = threading.Lock()

    def record(self, key: bytes, stored: bool) -> None:
        event = object_event(key, stored)
        if event is None:
            return
        with self._lock:
            if len(self._events) >= self.capacity:
                self._events.clear()
                self._lost = True
            self._events.append(event)

    def restart(self) -> None:
        with self._lock:
            self._events.clear()
            self._lost = False

    def drain(self) -> tuple[list[tuple[int, bytes]], bool]:
        with self._lock:
            events, self._events = self._events, []
            lost, self._lost = self._lost, False
        return events, lost


class WatchedEntries(OrderedDict):
    """An object index that tells a `StoreEventLog` about every key set (stored) and popped (dropped)."""

    log: StoreEventLog | None = None

    def watch(self, event_log: StoreEventLog) -> list[bytes]:
        """Starts recording into `event_log` (with nothing pending) -> the keys held now (under the store's lock)."""
        event_log.restart()
        self.log = event_log
        return list(self)

    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        if self.log is not None:
            self.log.record(key, True)

    def pop(self, key, *default):
        had = key in self
        value = super().pop(key, *default)
        if had and self.log is not None:
            self.log.record(key, False)
        return value


@dataclass(frozen=True)
class StoreListing:
    block_hashes: list[bytes]
    snapshot_hashes: list[bytes]
    block_size: int = 0  # any model: unset
    snapshots_required: bool = False


@dataclass(frozen=True)
class _NoLoad:
    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0


class StoreEventSource:
    """A store that can watch its index (`start_events(log) -> keys`) as a `KVEventPublisher` source."""

    def __init__(self, store):
        self.store = store
        self.log = StoreEventLog()

    @staticmethod
    def supported(store) -> bool:
        return callable(getattr(store, "start_events", None))

    async def start_cache_events(self) -> StoreListing:
        keys = self.store.start_events(self.log)
        events = [e for e in (object_event(k, True) for k in keys) if e is not None]
        return StoreListing([h for k, h in events if k == kv_events_pb2.KV_EVENT_KIND_BLOCK_STORED],
                            [h for k, h in events if k == kv_events_pb2.KV_EVENT_KIND_SNAPSHOT_STORED])

    def take_cache_events(self) -> tuple[list[tuple[int, bytes]], bool]:
        return self.log.drain()

    def stats_snapshot(self) -> _NoLoad:
        return _NoLoad()
