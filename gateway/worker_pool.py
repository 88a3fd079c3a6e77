"""The gateway's worker pools: channels, membership, health, KV-event subscriptions and what each worker reports.

Contract:
- `WorkerPool(decode_addresses, prefill_addresses, ...)` opens one channel per worker (`decoders`, `prefillers`:
  address -> `WorkerChannel`) and one `gateway.routing.Router` per pool (`decode_router`, `prefill_router`: None
  without prefill workers); with `cache_address`, a `CacheServiceView` shared by both routers follows the cache
  service's KV event stream. The request orchestration over these pools is `gateway.mesh_client.MeshClient`.
- KV events: `start_kv_events()` subscribes to every worker's stream (gateway/kv_events.py; idempotent);
  `stop_kv_events()` ends them; `resync(source)` resubscribes one source whose index proved wrong.
- Membership: `set_worker_addresses(role, addresses)` replaces a pool's workers (service discovery,
  gateway/discovery.py); see `Router.set_addresses`.
- Health: `check_health()` asks every worker's gRPC health service once and marks it healthy or unhealthy in its
  router (an unhealthy worker gets no new requests until it passes again); `run_health_checks(interval_s)` does that
  until cancelled (the gateway runs it as a background task). `on_health_change(address, healthy)` is called on
  every transition. Busy is not dead (`health_verdict`): SERVING is healthy; NOT_SERVING (its engine failed, or
  it drains) and no connection (UNAVAILABLE, or a deadline on a channel that is not connected) are unhealthy at
  once; a deadline on a connected channel is a busy worker, which keeps its standing until it has not answered
  SERVING for `RouterConfig.busy_grace_s` (a worker stepping a long batch stays in the pool; one that never answers
  again leaves it). `busy` counts the late answers of each worker.
- Worker facts (protos/worker.proto `WorkerInfoService.Info`): `refresh_info()` asks every worker whose facts are
  not known (a new, or newly healthy, worker; bounded by `timeout_s`, a worker that does not answer stays unknown);
  `check_health` calls it after each round, `set_worker_addresses` after adding workers. `info` maps address ->
  `WorkerInfo` of the current members that answered (a worker that turns unhealthy or leaves its pool is
  forgotten: it may come back another engine).
  `max_model_len()` is the smallest `max_model_len` over them, or None while none has answered: the context length
  the whole pool serves, whichever worker a request reaches.
- Telemetry: the worker channels carry `telemetry.rpc.client_interceptors()`: every call sends the caller's current
  trace context (`traceparent`) and request id (`x-request-id`), so the workers' spans join the request's trace.
- Security: with `mesh_token`, every call carries it (`x-kdamesh-mesh-token`, `telemetry.mesh_auth`); workers
  started with the token reject calls without it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.kv_events import KVEventSubscriber, SubscriberConfig
from gateway.routing import CacheServiceView, Router, RouterConfig, parse_worker_list
from protos import decode_pb2_grpc, prefill_pb2_grpc, worker_pb2, worker_pb2_grpc
from telemetry import mesh_auth
from telemetry.rpc import client_interceptors

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 16 << 20
# A worker removed from its pool (service discovery) keeps its channel this long for the calls it still serves (s).
RETIRED_CHANNEL_GRACE_S = 600.0
ROLE_STUBS = {"decode": decode_pb2_grpc.DecodeServiceStub, "prefill": prefill_pb2_grpc.PrefillServiceStub}


SERVING, NOT_SERVING, LATE, UNREACHABLE = "serving", "not_serving", "late", "unreachable"  # health answers


def health_verdict(answer: str, healthy: bool, since_serving_s: float, busy_grace_s: float) -> bool:
    """Whether a worker counts as healthy after one health `answer` (see the module docstring): `healthy` is its
    standing before, `since_serving_s` how long ago it last answered SERVING."""
    if answer == SERVING:
        return True
    if answer == LATE:
        return healthy and since_serving_s <= busy_grace_s
    return False


class WorkerChannel:
    """One worker's channel with its role's stub, its health stub and its info stub."""

    def __init__(self, address: str, stub_type, mesh_token: str | None = None):
        self.address = address
        options = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                   ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)]
        self.channel = grpc.aio.insecure_channel(
            address, options=options,
            interceptors=[*client_interceptors(), *mesh_auth.client_interceptors(mesh_token)])
        self.stub = stub_type(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)
        self.info = worker_pb2_grpc.WorkerInfoServiceStub(self.channel)


class WorkerPool:
    def __init__(self, decode_addresses: Sequence[str], prefill_addresses: Sequence[str] = (), *,
                 router_config: RouterConfig = RouterConfig(), on_health_change=None,
                 mesh_token: str | None = None, model: str = "",
                 subscriber_config: SubscriberConfig | None = None, cache_address: str | None = None):
        if not decode_addresses:
            raise ValueError("the mesh needs at least one decode worker")
        self.decoders = {a: WorkerChannel(a, ROLE_STUBS["decode"], mesh_token) for a in decode_addresses}
        self.prefillers = {a: WorkerChannel(a, ROLE_STUBS["prefill"], mesh_token) for a in prefill_addresses}
        self.cache_address = cache_address
        self.cache_view = CacheServiceView(router_config.stale_after_s) if cache_address else None
        self.cache_channel = WorkerChannel(cache_address, lambda channel: None, mesh_token) if cache_address else None
        self.decode_router = Router(list(self.decoders), router_config, cache_view=self.cache_view)
        self.prefill_router = Router(list(self.prefillers), router_config, cache_view=self.cache_view) \
            if self.prefillers else None
        self.on_health_change = on_health_change  # (address, healthy) on every transition
        self.info: dict[str, worker_pb2.WorkerInfo] = {}  # address -> what the worker reported (see the docstring)
        self._router_config = router_config
        self._mesh_token = mesh_token
        self._retired: list[WorkerChannel] = []  # removed by `set_worker_addresses`; channels closing
        self._retiring: set[asyncio.Task] = set()
        self.model = model  # the served model name the event subscriptions and info calls ask for ("": any)
        self.subscriber_config = subscriber_config or SubscriberConfig(stale_after_s=router_config.stale_after_s)
        self.subscribers: dict[str, KVEventSubscriber] = {}
        self._events_started = False
        self._serving_at: dict[str, float] = {}  # address -> when it last answered SERVING (time.monotonic())
        self.busy: dict[str, int] = {}  # address -> health answers that came late on a connected channel

    def _members(self) -> dict[str, WorkerChannel]:
        return {**self.decoders, **self.prefillers}

    def router_of(self, address: str) -> Router | None:
        return self.decode_router if address in self.decoders else self.prefill_router

    # -- KV events ----------------------------------------------------------------------------------------------

    def start_kv_events(self) -> None:
        """Subscribes to every worker's KV event stream (call on the event loop; idempotent). Until then every
        worker's index is empty: routing by load alone."""
        self._events_started = True
        for address, worker in self._members().items():
            self._subscribe(address, worker)
        if self.cache_channel is not None and self.cache_address not in self.subscribers:
            subscriber = KVEventSubscriber(self.cache_address, self.cache_channel.channel, self.cache_view, "",
                                           self.subscriber_config)
            self.subscribers[self.cache_address] = subscriber
            subscriber.start()

    async def stop_kv_events(self) -> None:
        self._events_started = False
        subscribers, self.subscribers = list(self.subscribers.values()), {}
        await asyncio.gather(*(s.stop() for s in subscribers))

    def _subscribe(self, address: str, worker: WorkerChannel) -> None:
        if address in self.subscribers:
            return
        subscriber = KVEventSubscriber(address, worker.channel, self.router_of(address), self.model,
                                       self.subscriber_config)
        self.subscribers[address] = subscriber
        subscriber.start()

    def resync(self, source: str) -> None:
        """Resubscribes `source`'s KV events (a worker's address or the cache service's) now."""
        subscriber = self.subscribers.get(source)
        if subscriber is not None:
            subscriber.resync()

    async def close(self) -> None:
        await self.stop_kv_events()
        for task in list(self._retiring):
            task.cancel()
        cache = [self.cache_channel] if self.cache_channel is not None else []
        for w in [*self._members().values(), *self._retired, *cache]:
            await w.channel.close()

    # -- membership ---------------------------------------------------------------------------------------------

    async def set_worker_addresses(self, role: str, addresses: Sequence[str]) -> tuple[tuple[str, ...], ...]:
        """Replaces the worker set of a pool (`role` "decode" or "prefill"): what service discovery calls after each
        resolution. New workers get a channel and join the pool's router (empty index, healthy); removed workers
        leave the router at once and their channel closes once their calls in flight end (at most
        `RETIRED_CHANNEL_GRACE_S`). The decode pool may not become empty (`ValueError`: keep the last resolution);
        an empty prefill pool sends every request down the colocated path. Returns `(added, removed)`."""
        if role not in ROLE_STUBS:
            raise ValueError(f"role must be 'decode' or 'prefill', got {role!r}")
        wanted = parse_worker_list(list(addresses))
        if role == "decode" and not wanted:
            raise ValueError("the decode pool needs at least one worker address")
        workers = self.decoders if role == "decode" else self.prefillers
        router = self.decode_router if role == "decode" else self.prefill_router
        if router is None:  # the first prefill workers of a gateway that started without any
            if not wanted:
                return (), ()
            router = self.prefill_router = Router(wanted, self._router_config, cache_view=self.cache_view)
            added, removed = wanted, ()
        else:
            added, removed = router.set_addresses(wanted)
        for address in added:
            workers[address] = WorkerChannel(address, ROLE_STUBS[role], self._mesh_token)
            if self._events_started:
                self._subscribe(address, workers[address])
        for address in removed:
            subscriber = self.subscribers.pop(address, None)
            if subscriber is not None:
                await subscriber.stop()
            self.info.pop(address, None)
            self._serving_at.pop(address, None)
            self._retire(workers.pop(address))
        if added:
            await self.refresh_info()  # a new worker's limit counts before the next health round
        return added, removed

    def _retire(self, worker: WorkerChannel) -> None:
        self._retired.append(worker)
        task = asyncio.get_running_loop().create_task(worker.channel.close(grace=RETIRED_CHANNEL_GRACE_S))
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)

    # -- health -------------------------------------------------------------------------------------------------

    async def health(self, timeout_s: float = 1.0) -> dict[str, bool]:
        """address -> whether the worker reports SERVING."""
        return {address: answer == SERVING for address, answer in (await self._answers(timeout_s)).items()}

    async def _answers(self, timeout_s: float) -> dict[str, str]:
        """address -> its health answer (`SERVING`, `NOT_SERVING`, `LATE`, `UNREACHABLE`)."""
        async def check(w: WorkerChannel) -> str:
            try:
                r = await w.health.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout_s)
            except grpc.aio.AioRpcError as exc:
                connected = w.channel.get_state() == grpc.ChannelConnectivity.READY
                return LATE if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED and connected else UNREACHABLE
            return SERVING if r.status == health_pb2.HealthCheckResponse.SERVING else NOT_SERVING

        workers = list(self._members().values())
        answers = await asyncio.gather(*(check(w) for w in workers))
        return {w.address: answer for w, answer in zip(workers, answers)}

    async def check_health(self, timeout_s: float = 1.0) -> dict[str, bool]:
        """Asks every worker once and updates the routers, then the facts of workers not known yet; returns
        address -> healthy."""
        results = {}
        for address, answer in (await self._answers(timeout_s)).items():
            router = self.router_of(address)
            if address not in self._members():
                continue  # removed from its pool while being checked
            results[address] = ok = self._verdict(address, answer, router.is_healthy(address))
            if router.is_healthy(address) == ok:
                continue
            if ok:
                router.mark_healthy(address)
                log.info("mesh worker %s is healthy again", address)
            else:
                router.mark_unhealthy(address)
                self.info.pop(address, None)
                log.warning("mesh worker %s failed its health check (%s); routing around it", address, answer)
            if self.on_health_change is not None:
                self.on_health_change(address, ok)
        await self.refresh_info(timeout_s)
        return results

    def since_serving(self, address: str) -> float | None:
        """Seconds since `address` last answered its health check SERVING; None before it ever did."""
        at = self._serving_at.get(address)
        return None if at is None else time.monotonic() - at

    def _verdict(self, address: str, answer: str, healthy: bool) -> bool:
        now = time.monotonic()
        self._serving_at.setdefault(address, now)  # a worker never SERVING counts from its first check
        if answer == SERVING:
            self._serving_at[address] = now
        elif answer == LATE:
            self.busy[address] = self.busy.get(address, 0) + 1
            log.info("mesh worker %s answered its health check late (busy); it stays in the pool", address)
        since = now - self._serving_at.get(address, now)
        return health_verdict(answer, healthy, since, self._router_config.busy_grace_s)

    async def run_health_checks(self, interval_s: float, timeout_s: float = 1.0) -> None:
        """`check_health` every `interval_s` seconds until cancelled."""
        while True:
            try:
                await self.check_health(timeout_s)
            except Exception:  # a health round must never kill the loop
                log.exception("health check round failed")
            await asyncio.sleep(interval_s)

    # -- worker facts -------------------------------------------------------------------------------------------

    async def refresh_info(self, timeout_s: float = 1.0) -> None:
        """Asks every healthy member whose facts are unknown for its `WorkerInfo` (see the module docstring)."""
        async def ask(w: WorkerChannel) -> worker_pb2.WorkerInfo | None:
            try:
                return await w.info.Info(worker_pb2.WorkerInfoRequest(model=self.model), timeout=timeout_s)
            except grpc.aio.AioRpcError as exc:
                log.debug("worker %s did not report its facts: %s", w.address, exc.code().name)
                return None

        members = self._members()
        unknown = [w for a, w in members.items() if a not in self.info and self.router_of(a).is_healthy(a)]
        for w, info in zip(unknown, await asyncio.gather(*(ask(w) for w in unknown))):
            if info is not None and w.address in self._members():
                self.info[w.address] = info
                log.info("mesh worker %s (%s): max_model_len %d, block size %d, speculation %s, TP %d%s", w.address,
                         info.role, info.max_model_len, info.block_size,
                         f"{info.speculative_method} k={info.num_speculative_tokens}"
                         if info.speculative_method else "off", info.tensor_parallel_size,
                         ", EP" if info.expert_parallel else "")

    def max_model_len(self) -> int | None:
        """The smallest context length the pools' workers reported (tokens); None while none has."""
        return min((info.max_model_len for info in self.info.values()), default=None)
