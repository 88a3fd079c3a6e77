"""The worker's KV event stream (protos/kv_events.proto): what its engine's prefix cache stores and evicts.

Contract:
- `KVEventPublisher(engine, config)` mirrors the engine's prefix cache: `start()` turns the engine's event recording
  on and takes the listing it starts from (`AsyncEngine.start_cache_events`, one step-thread command), then a task
  drains the recorded events every `config.poll_interval_s` (`take_cache_events`, no step-thread wait), numbers
  them (consecutive from 0; `epoch` is random per publisher, so a restarted worker is told apart), applies them to
  the mirror and sends them to every subscriber as one batch; with no events it sends an empty batch (a heartbeat)
  when the load changed or nothing was sent for `config.heartbeat_s`. Every message carries the worker's load as of
  the engine's last step (running, waiting, KV usage to 3 decimals). When the
  engine lost events (its sink overflowed) the publisher lists the cache again and sends every subscriber a fresh
  snapshot at the current number.
- `subscribe()` returns a subscription whose first message is a snapshot of the mirror (taken in the same event-loop
  turn the subscription joins, so no event falls between). A subscription more than `config.max_queued_messages`
  behind is ended (RESOURCE_EXHAUSTED for its call; the gateway resubscribes). `stop()` ends every subscription.
- `KVEventServicer` serves `KVEventService.Subscribe` with the role servicer's admission checks (UNAVAILABLE while
  loading or stopping, NOT_FOUND for another model). Servicers are thin: the logic is in the publisher.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from dataclasses import dataclass

import grpc

from engine.memory.events import CacheEventKind
from engine.memory.manager import CacheListing
from protos import kv_events_pb2, kv_events_pb2_grpc

log = logging.getLogger(__name__)

EVENT_KINDS = {CacheEventKind.BLOCK_STORED: kv_events_pb2.KV_EVENT_KIND_BLOCK_STORED,
               CacheEventKind.BLOCK_REMOVED: kv_events_pb2.KV_EVENT_KIND_BLOCK_REMOVED,
               CacheEventKind.SNAPSHOT_STORED: kv_events_pb2.KV_EVENT_KIND_SNAPSHOT_STORED,
               CacheEventKind.SNAPSHOT_REMOVED: kv_events_pb2.KV_EVENT_KIND_SNAPSHOT_REMOVED}
_END = object()  # queued to end a subscription normally
_BEHIND = object()  # queued when a subscription fell too far behind


@dataclass(frozen=True)
class KVEventConfig:
    poll_interval_s: float = 0.02  # how often recorded events are drained and sent (seconds)
    heartbeat_s: float = 0.5  # longest silence on a stream: an empty batch then (seconds)
    max_queued_messages: int = 1024  # a subscriber further behind is ended

    def __post_init__(self):
        if self.poll_interval_s <= 0 or self.heartbeat_s <= 0 or self.max_queued_messages <= 0:
            raise ValueError("poll_interval_s, heartbeat_s and max_queued_messages must be positive")


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


class SubscriberBehind(Exception):
    pass


class KVEventPublisher:
    def __init__(self, engine, config: KVEventConfig = KVEventConfig()):
        self.engine = engine
        self.config = config
        self.epoch = secrets.randbits(63) + 1
        self.sequence = 0  # the number the next event gets
        self.resyncs = 0  # snapshots sent because the engine lost events
        self._listing: CacheListing | None = None
        self._blocks: set[bytes] = set()
        self._snapshots: set[bytes] = set()
        self._subscriptions: set[Subscription] = set()
        self._task: asyncio.Task | None = None
        self._last_sent = time.monotonic()
        self._last_load: kv_events_pb2.WorkerLoad | None = None

    async def start(self) -> None:
        self._reset(await self.engine.start_cache_events())
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
            except Exception:  # a failed round (engine gone) must not end the loop; health reports the engine
                log.exception("KV event round failed")

    async def publish_pending(self) -> None:
        """One round of the loop: drain, number, apply, send (or a heartbeat, or a fresh snapshot)."""
        events, lost = self.engine.take_cache_events()
        if lost:
            self._reset(await self.engine.start_cache_events())
            self.resyncs += 1
            log.warning("the engine lost KV events; sending subscribers a fresh snapshot")
            self._broadcast(self._snapshot_message())
        elif events:
            first = self.sequence
            for kind, block_hash in events:
                self._apply(kind, block_hash)
            self.sequence += len(events)
            batch = kv_events_pb2.KVEventBatch(events=[kv_events_pb2.KVEvent(kind=EVENT_KINDS[k], block_hash=h)
                                                       for k, h in events])
            self._broadcast(self._message(first, events=batch))
        elif self._load() != self._last_load or time.monotonic() - self._last_sent >= self.config.heartbeat_s:
            self._broadcast(self._message(self.sequence, events=kv_events_pb2.KVEventBatch()))

    def _apply(self, kind: CacheEventKind, block_hash: bytes) -> None:
        target = self._blocks if kind in (CacheEventKind.BLOCK_STORED, CacheEventKind.BLOCK_REMOVED) \
            else self._snapshots
        if kind in (CacheEventKind.BLOCK_STORED, CacheEventKind.SNAPSHOT_STORED):
            target.add(block_hash)
        else:
            target.discard(block_hash)

    def _reset(self, listing: CacheListing) -> None:
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
        stats = self.engine.stats_snapshot()
        return kv_events_pb2.WorkerLoad(running=stats.num_running, waiting=stats.num_waiting,
                                        kv_usage=round(stats.kv_usage, 3))

    def _message(self, sequence: int, **body) -> kv_events_pb2.KVEventMessage:
        self._last_load = self._load()
        return kv_events_pb2.KVEventMessage(epoch=self.epoch, sequence=sequence, load=self._last_load, **body)

    def _snapshot_message(self) -> kv_events_pb2.KVEventMessage:
        listing = self._listing
        snapshot = kv_events_pb2.KVCacheSnapshot(
            block_hashes=sorted(self._blocks), snapshot_hashes=sorted(self._snapshots),
            block_size=listing.block_size, fingerprint=self.engine.layout.fingerprint,
            snapshots_required=listing.snapshots_required)
        return self._message(self.sequence, snapshot=snapshot)


class KVEventServicer(kv_events_pb2_grpc.KVEventServiceServicer):
    """`Subscribe` over the role servicer's admission checks; `publisher` is set once the model is loaded."""

    def __init__(self, role_servicer):
        self.role_servicer = role_servicer
        self.publisher: KVEventPublisher | None = None

    async def Subscribe(self, request: kv_events_pb2.KVSubscribeRequest, context):
        await self.role_servicer.checked_worker(request.model, context)
        publisher = self.publisher
        if publisher is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the KV event stream is not started yet")
        sub = publisher.subscribe()
        try:
            while (message := await sub.get()) is not None:
                yield message
        except SubscriberBehind as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        finally:
            publisher.unsubscribe(sub)
