"""The gateway's subscription to one worker's KV event stream (protos/kv_events.proto), feeding its router's index.

Contract:
- `KVEventSubscriber(address, channel, router, model, config).start()` runs until `stop()`: it calls `Subscribe`,
  hands every message to `router.apply_kv_event(address, …)` and reads the next one within `config.stale_after_s`
  (the worker heartbeats every 0.5 s by default). It resubscribes — whose first message is a fresh snapshot —
  at once when the router answers `RESYNC` (a gap or a new epoch) or when `resync()` is called (a request showed
  the index wrong: `Router.observe`), and after `config.retry_s` (doubling up to `config.max_retry_s`) when the
  stream fails, ends, or stays silent past its deadline; each of those first empties the worker's index
  (`Router.clear_index`): a worker the gateway cannot hear counts as holding nothing.
- A source that answers UNIMPLEMENTED (a cache service whose backend publishes no events) is not asked again
  (`unsupported`); its index stays empty.
- The `router` is a `gateway.routing.Router` (a worker) or a `CacheServiceView` (the cache service).
- Counters: `subscriptions` (calls made), `resyncs` (resubscriptions for a gap, an epoch change or a wrong belief),
  `failures` (streams that failed, ended or went silent).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import grpc

from gateway.prefix_index import RESYNC
from protos import kv_events_pb2, kv_events_pb2_grpc

log = logging.getLogger(__name__)
STOP_TIMEOUT_S = 5.0  # the longest `stop` waits for the subscription task to end


@dataclass(frozen=True)
class SubscriberConfig:
    stale_after_s: float = 3.0  # longest wait for the next message (seconds); then the stream counts as dead
    retry_s: float = 0.2  # first wait before resubscribing after a failure (seconds), doubled up to max_retry_s
    max_retry_s: float = 2.0

    def __post_init__(self):
        if min(self.stale_after_s, self.retry_s, self.max_retry_s) <= 0 or self.max_retry_s < self.retry_s:
            raise ValueError("stale_after_s, retry_s and max_retry_s must be positive, max_retry_s >= retry_s")


class KVEventSubscriber:
    def __init__(self, address: str, channel: grpc.aio.Channel, router, model: str = "",
                 config: SubscriberConfig = SubscriberConfig()):
        self.address = address
        self.router = router
        self.model = model
        self.config = config
        self._stub = kv_events_pb2_grpc.KVEventServiceStub(channel)
        self._task: asyncio.Task | None = None
        self._call = None
        self._resync_wanted = False
        self._stopping = False
        self.subscriptions = 0
        self.resyncs = 0
        self.failures = 0
        self.unsupported = False

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        """Ends the subscription (bounded: `STOP_TIMEOUT_S`). The flag keeps `_run` from looping again when
        grpc turns the cancellation into an `AioRpcError(CANCELLED)` instead of raising CancelledError."""
        self._stopping = True
        if self._task is not None:
            self._task.cancel()
            await asyncio.wait([self._task], timeout=STOP_TIMEOUT_S)
            self._task = None

    def resync(self) -> None:
        """Resubscribes now (the index was found wrong); a no-op when no stream is open."""
        if self._call is not None:
            self._resync_wanted = True
            self._call.cancel()

    async def _run(self) -> None:
        delay = self.config.retry_s
        while not self._stopping:
            healthy = await self._follow()
            if self._stopping or self.unsupported:
                return
            if healthy:
                delay = self.config.retry_s
                continue
            self.failures += 1
            await asyncio.sleep(delay)
            delay = min(2 * delay, self.config.max_retry_s)

    async def _follow(self) -> bool:
        """One subscription -> True when it ended for a resync (resubscribe at once), False when it failed."""
        self.subscriptions += 1
        self._resync_wanted = False
        call = self._call = self._stub.Subscribe(kv_events_pb2.KVSubscribeRequest(model=self.model))
        try:
            while True:
                message = await asyncio.wait_for(call.read(), self.config.stale_after_s)
                if message is grpc.aio.EOF:
                    log.info("KV event stream of %s ended", self.address)
                    break
                if self.router.apply_kv_event(self.address, message) == RESYNC:
                    self.resyncs += 1
                    log.info("KV events of %s: gap or new epoch; resubscribing", self.address)
                    return True
        except asyncio.CancelledError:
            if not self._resync_wanted:
                raise
            self.resyncs += 1
            return True
        except asyncio.TimeoutError:
            log.warning("KV event stream of %s silent for %.1f s; treating its cache as empty", self.address,
                        self.config.stale_after_s)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.CANCELLED and self._resync_wanted:
                self.resyncs += 1
                return True
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                self.unsupported = True
                log.warning("%s publishes no KV events (%s); it counts as holding nothing", self.address,
                            exc.details())
            log.debug("KV event stream of %s failed: %s %s", self.address, exc.code().name, exc.details())
        finally:
            self._call = None
            call.cancel()
            self.router.clear_index(self.address)
        return False
