"""The cache service's gRPC server (`grpc.aio`): a thin servicer over a `Store`, plus health and reflection.

Contract:
- `serve(config)` starts a server on `config.address` (port 0: a free port) and returns `(CacheServer, port)`. Health
  (`grpc.health.v1.Health`) reports SERVING for "" and `kdamesh.v1.CacheService` once it is started; reflection lists
  the cache, health and reflection services. `CacheServer.stop(grace)` reports NOT_SERVING first, lets calls in
  flight finish for `grace` seconds, then closes the store.
- The servicer only parses, calls the store (in a thread pool, so the event loop never blocks on Redis or checksums)
  and maps results; per-key outcomes are statuses, never RPC errors. RPC errors: INVALID_ARGUMENT for a BatchPut
  stream that breaks framing (data outside an object, more data than announced), for a Lookup with an unusable
  kind or hash and for a Commit whose checksums do not match its reservation in number; FAILED_PRECONDITION for
  Reserve, Commit and Locate without an arena; UNAVAILABLE when a call without per-key results (Lookup, Release,
  Stats) cannot reach the backend.
  Deadlines and client cancellation cancel the handler (gRPC does); a store call already running in the thread pool
  finishes within the backend's socket timeouts and its result is dropped.
- Messages stay below `max_message_bytes` (default 4 MiB): payloads stream in `chunk_bytes` pieces (default 1 MiB).
- BatchPut stores objects as they complete, in batches of about `put_batch_bytes` with at most two batches in
  flight, so receiving overlaps storing; BatchGet reads `get_window_keys` keys ahead of what it streams.
- HANDOFF objects without an explicit TTL get `handoff_ttl_s` (30 s); other kinds default to no expiry.
- Data planes: `DataPlane` tells clients how they may move payloads without this hop (`describe_data_plane`): the
  Redis backend offers its URL and layout; the memory backend with its shared-memory arena (`memory_arena="shm"`,
  the default) offers the arena, which `Reserve` / `Commit` (put) and `Locate` / `Release` (get) serve; otherwise
  (or with `data_plane=False`) gRPC only. Reservations and Locate pins last as asked, at most `max_hold_s`. An arena
  that cannot be created (no such directory) leaves the service on heap memory, logged; an arena whose tmpfs fills
  up stops growing and evicts instead (see `memory_store`). Shm-plane bytes count in the transfer metrics at Commit
  and Locate; direct Redis traffic shows only in the store's counters.
- Telemetry (telemetry/): every call gets a SERVER span continuing the caller's W3C `traceparent`, with child spans
  `cache.put`, `cache.get` and `cache.lookup` (attributes: bytes, keys, blocks, hit blocks, backend, `error.type` when
  a key failed or the call was refused); the caller's `x-request-id` is bound for the call's log lines; calls are
  counted by status in `kdamesh_cache_requests_total` and logged at DEBUG on `kdamesh.rpc`.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import re
import signal
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2
from opentelemetry.trace import Tracer, TracerProvider
from prometheus_client import CollectorRegistry, start_http_server

from cache_service.malloc_tuning import tune_malloc
from cache_service.memory_store import MemoryStore, ReserveItem
from cache_service.metrics import CacheMetrics
from cache_service.objects import (Checksum, Refused, Status, admit_object, encode_key, encode_object_key,
                                   handoff_default_ttl)
from cache_service.redis_store import DEFAULT_INLINE_BYTES, RedisStore
from cache_service.shm_arena import SharedArena
from cache_service.store import GetOutcome, KeyOutcome, PutItem, Store, StoreUnavailableError
from protos import cache_pb2, cache_pb2_grpc, common_pb2
from telemetry.grpc_server import start_grpc_server
from telemetry import tracing
from telemetry.metrics import RpcMetrics
from telemetry.rpc import server_interceptors

log = logging.getLogger(__name__)

SERVICE_NAME = cache_pb2.DESCRIPTOR.services_by_name["CacheService"].full_name
MESSAGE_OVERHEAD_BYTES = 64 << 10  # room for a chunk's non-payload fields under the message limit


@dataclass(frozen=True)
class CacheServiceConfig:
    # host:port to listen on; port 0 picks a free port.
    address: str = "127.0.0.1:50053"
    # "memory" or a Redis URL "redis://host:port/db" (also rediss://, unix://).
    backend: str = "memory"
    # Memory backend: payload bytes kept before eviction (bytes), and the eviction watermarks (fractions of it).
    byte_budget: int = 1 << 30
    high_watermark: float = 0.9
    low_watermark: float = 0.8
    # Default TTL of HANDOFF objects put without one (seconds); default lease duration (seconds).
    handoff_ttl_s: float = 30.0
    lease_ttl_s: float = 30.0
    # Payload bytes per streamed message, and the gRPC message limit both ways (bytes).
    chunk_bytes: int = 1 << 20
    max_message_bytes: int = 4 << 20
    # Largest object accepted (bytes).
    max_object_bytes: int = 1 << 30
    # Redis backend: key prefix, chunk size of stored values (bytes), payloads stored inside their manifest up to
    # this size (bytes), socket timeouts (seconds).
    redis_key_prefix: str = "kdamesh:"
    redis_chunk_bytes: int = 1 << 20
    redis_inline_bytes: int = DEFAULT_INLINE_BYTES
    redis_socket_timeout_s: float = 2.0
    redis_connect_timeout_s: float = 0.5
    # Offer clients a direct data plane (DataPlane RPC): the Redis backend's URL, the memory backend's arena.
    data_plane: bool = True
    # Memory backend: "shm" keeps payloads in a shared-memory arena of byte_budget bytes in shm_dir (its memory is
    # reserved at start; local clients copy in and out directly), prefaulted in this process with shm_populate;
    # "heap" keeps them in this process's memory (gRPC only).
    memory_arena: str = "shm"
    shm_dir: str = "/dev/shm"
    shm_populate: bool = True
    # Commit re-verifies each payload over the arena before publishing it (reads verify either way; see memory_store).
    verify_commits: bool = False
    # Longest Reserve reservation / Locate pin granted (seconds).
    max_hold_s: float = 60.0
    # Threads running store calls; BatchPut batch size (bytes); BatchGet read-ahead (keys).
    store_threads: int = 8
    put_batch_bytes: int = 8 << 20
    get_window_keys: int = 16
    # Serve Prometheus /metrics on this port (0: a free port); None: no HTTP endpoint.
    metrics_port: int | None = None

    def __post_init__(self):
        if self.backend != "memory" and not re.match(r"^(rediss?|unix)://", self.backend):
            raise ValueError(f"backend must be 'memory' or a redis:// URL, got {self.backend!r}")
        if self.chunk_bytes <= 0 or self.chunk_bytes + MESSAGE_OVERHEAD_BYTES > self.max_message_bytes:
            raise ValueError(f"chunk_bytes {self.chunk_bytes} must be > 0 and leave {MESSAGE_OVERHEAD_BYTES} bytes "
                             f"under max_message_bytes {self.max_message_bytes}")
        if not 0 < self.low_watermark <= self.high_watermark <= 1:
            raise ValueError("need 0 < low_watermark <= high_watermark <= 1")
        if self.handoff_ttl_s <= 0 or self.lease_ttl_s <= 0 or self.max_hold_s <= 0:
            raise ValueError("handoff_ttl_s, lease_ttl_s and max_hold_s must be > 0")
        if self.memory_arena not in ("shm", "heap"):
            raise ValueError(f"memory_arena must be 'shm' or 'heap', got {self.memory_arena!r}")


def make_store(config: CacheServiceConfig) -> Store:
    if config.backend == "memory":
        arena = _make_arena(config) if config.memory_arena == "shm" else None
        return MemoryStore(config.byte_budget, config.high_watermark, config.low_watermark, arena=arena,
                           verify_commits=config.verify_commits)
    return RedisStore(config.backend, chunk_bytes=config.redis_chunk_bytes, inline_bytes=config.redis_inline_bytes,
                      key_prefix=config.redis_key_prefix.encode(), socket_timeout_s=config.redis_socket_timeout_s,
                      connect_timeout_s=config.redis_connect_timeout_s)


def _make_arena(config: CacheServiceConfig) -> SharedArena | None:
    try:
        return SharedArena.create(config.byte_budget, config.shm_dir, populate=config.shm_populate)
    except OSError as exc:
        log.warning("no shared-memory arena of %d bytes in %s (%s): payloads stay in the heap, gRPC only",
                    config.byte_budget, config.shm_dir, exc)
        return None


def describe_data_plane(store: Store, config: CacheServiceConfig) -> cache_pb2.DataPlaneResponse:
    """The DataPlane answer for this store and configuration."""
    response = cache_pb2.DataPlaneResponse(max_object_bytes=config.max_object_bytes,
                                           handoff_ttl_ms=int(config.handoff_ttl_s * 1000))
    if not config.data_plane:
        response.grpc.reason = "direct data planes are disabled by configuration"
    elif isinstance(store, RedisStore):
        response.redis.CopyFrom(cache_pb2.RedisDataPlane(
            url=store.url, key_prefix=store.key_prefix, chunk_bytes=store.chunk_bytes,
            inline_bytes=store.inline_bytes, socket_timeout_ms=int(store.socket_timeout_s * 1000),
            connect_timeout_ms=int(store.connect_timeout_s * 1000)))
    elif isinstance(store, MemoryStore) and store.arena is not None:
        arena = store.arena
        response.shm.CopyFrom(cache_pb2.ShmDataPlane(path=str(arena.path), size_bytes=arena.size, token=arena.token,
                                                     token_offset=arena.token_offset))
    else:
        response.grpc.reason = f"the {store.backend} store here has no direct data plane"
    return response


# -- BatchPut framing (pure) ------------------------------------------------------------------------------------


class ProtocolError(ValueError):
    """A BatchPut stream whose framing cannot be followed."""


@dataclass(frozen=True)
class Admitted:
    """What the store needs of an object a client announced."""

    item_key: bytes
    checksum: Checksum | None  # None for a ReserveObject (its checksum comes with Commit)
    ttl_s: float | None


def admit(header: cache_pb2.ObjectHeader | cache_pb2.ReserveObject, max_object_bytes: int,
          default_ttl_s: Callable[[int], float | None]) -> Admitted | KeyOutcome:
    """An announced object's store key, checksum and TTL, or its refusal (INVALID key or checksum, TOO_LARGE)."""
    try:
        checksum = Checksum.from_proto(header.checksum) if isinstance(header, cache_pb2.ObjectHeader) else None
        item_key, ttl_s = admit_object(header.key, header.size_bytes,
                                       header.ttl_ms if header.HasField("ttl_ms") else None, max_object_bytes,
                                       default_ttl_s)
    except Refused as exc:
        return KeyOutcome(exc.status, exc.message)
    except ValueError as exc:  # an unusable checksum
        return KeyOutcome(Status.INVALID, str(exc))
    return Admitted(item_key, checksum, ttl_s)


@dataclass(frozen=True)
class Completed:
    """An object whose chunks all arrived: an item to store, or an outcome decided without the store."""

    key: common_pb2.ObjectKey
    item: PutItem | None = None
    outcome: KeyOutcome | None = None


@dataclass
class _Incoming:
    key: common_pb2.ObjectKey
    size: int
    item_key: bytes = b""
    checksum: Checksum | None = None
    ttl_s: float | None = None
    refusal: KeyOutcome | None = None  # set: the object is refused; its data is drained and dropped
    parts: list[bytes] = field(default_factory=list)
    received: int = 0


class PutAssembler:
    """Turns a BatchPut chunk stream into whole objects. `feed` each chunk, then `finish` at the end."""

    def __init__(self, max_object_bytes: int, default_ttl_s: Callable[[int], float | None]):
        self._max_object_bytes = max_object_bytes
        self._default_ttl_s = default_ttl_s
        self._current: _Incoming | None = None
        self.bytes_received = 0

    def feed(self, chunk: cache_pb2.PutChunk) -> list[Completed]:
        done = []
        if chunk.HasField("header"):
            if self._current is not None:
                done.append(self._abandon("the next object started"))
            self._current = self._start(chunk.header)
        elif self._current is None:
            raise ProtocolError("a data chunk arrived outside an object (no header before it)")
        current, data = self._current, chunk.data  # each read of chunk.data copies: read it once
        if data:
            if current.received + len(data) > current.size:
                raise ProtocolError(f"object announced {current.size} bytes and sent more")
            current.received += len(data)
            self.bytes_received += len(data)
            if current.refusal is None:
                current.parts.append(data)
        if current.received == current.size:
            done.append(self._complete(current))
            self._current = None
        return done

    def finish(self) -> list[Completed]:
        return [self._abandon("the stream ended")] if self._current is not None else []

    def _start(self, header: cache_pb2.ObjectHeader) -> _Incoming:
        incoming = _Incoming(header.key, header.size_bytes)
        admitted = admit(header, self._max_object_bytes, self._default_ttl_s)
        if isinstance(admitted, KeyOutcome):
            incoming.refusal = admitted
        else:
            incoming.item_key, incoming.checksum, incoming.ttl_s = admitted.item_key, admitted.checksum, admitted.ttl_s
        return incoming

    def _complete(self, incoming: _Incoming) -> Completed:
        if incoming.refusal is not None:
            return Completed(incoming.key, outcome=incoming.refusal)
        data = incoming.parts[0] if len(incoming.parts) == 1 else b"".join(incoming.parts)
        return Completed(incoming.key, PutItem(incoming.item_key, data, incoming.checksum, incoming.ttl_s))

    def _abandon(self, why: str) -> Completed:
        current, self._current = self._current, None
        return Completed(current.key, outcome=KeyOutcome(
            Status.INVALID, f"{why} after {current.received} of {current.size} bytes; nothing stored"))


# -- the servicer ------------------------------------------------------------------------------------------------


@dataclass
class _PutBatch:
    items: list[PutItem] = field(default_factory=list)
    nbytes: int = 0
    future: asyncio.Future | None = None


class _BatchWriter:
    """Sends completed objects to the store in batches, keeping at most `max_inflight` batches in flight."""

    def __init__(self, put_many: Callable[[list[PutItem]], asyncio.Future], batch_bytes: int, max_inflight: int = 2):
        self._put_many = put_many
        self._batch_bytes = batch_bytes
        self._max_inflight = max_inflight
        self._slots: list[tuple[common_pb2.ObjectKey, KeyOutcome | tuple[_PutBatch, int]]] = []
        self._batch = _PutBatch()
        self._inflight: deque[asyncio.Future] = deque()

    async def add(self, done: Completed) -> None:
        if done.outcome is not None:
            self._slots.append((done.key, done.outcome))
            return
        self._slots.append((done.key, (self._batch, len(self._batch.items))))
        self._batch.items.append(done.item)
        self._batch.nbytes += len(done.item.data)
        if self._batch.nbytes >= self._batch_bytes:
            await self._flush()

    async def results(self) -> list[tuple[common_pb2.ObjectKey, KeyOutcome]]:
        await self._flush()
        await asyncio.gather(*self._inflight)
        return [(key, slot if isinstance(slot, KeyOutcome) else slot[0].future.result()[slot[1]])
                for key, slot in self._slots]

    async def _flush(self) -> None:
        if not self._batch.items:
            return
        while len(self._inflight) >= self._max_inflight:
            await self._inflight.popleft()
        self._batch.future = self._put_many(self._batch.items)
        self._inflight.append(self._batch.future)
        self._batch = _PutBatch()


def _key_result(key: common_pb2.ObjectKey, outcome: KeyOutcome) -> cache_pb2.KeyResult:
    return cache_pb2.KeyResult(key=key, status=int(outcome.status), message=outcome.message)


def _get_chunks(index: int, outcome: GetOutcome, chunk_bytes: int) -> Iterator[cache_pb2.GetChunk]:
    """The messages answering one key, built one at a time (a large object is never copied whole)."""
    if outcome.status != Status.FOUND:
        yield cache_pb2.GetChunk(index=index, status=int(outcome.status), message=outcome.message)
        return
    data = outcome.data
    yield cache_pb2.GetChunk(index=index, status=int(Status.FOUND), size_bytes=len(data),
                             checksum=outcome.checksum.to_proto(), data=data[:chunk_bytes])
    for offset in range(chunk_bytes, len(data), chunk_bytes):
        yield cache_pb2.GetChunk(index=index, data=data[offset:offset + chunk_bytes])


def _count_blocks(keys) -> int:
    return sum(1 for k in keys if k.kind == common_pb2.OBJECT_KIND_KV_BLOCK)


def _failed(statuses, failures: tuple[Status, ...]) -> str | None:
    """The `error.type` of a batch: the first failing key status's name, or None."""
    return next((s.name for s in statuses if s in failures), None)


class CacheServicer(cache_pb2_grpc.CacheServiceServicer):
    def __init__(self, store: Store, config: CacheServiceConfig, metrics: CacheMetrics, executor: ThreadPoolExecutor,
                 tracer: Tracer | None = None):
        self._store = store
        self._config = config
        self._metrics = metrics
        self._executor = executor
        self._tracer = tracer if tracer is not None else tracing.get_tracer("kdamesh.cache")

    def _run(self, fn: Callable, *args) -> asyncio.Future:
        return asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def _default_ttl_s(self, kind: int) -> float | None:
        return handoff_default_ttl(self._config.handoff_ttl_s)(kind)

    async def BatchPut(self, request_iterator: AsyncIterator[cache_pb2.PutChunk],
                       context) -> cache_pb2.BatchPutResponse:
        started = time.perf_counter()
        assembler = PutAssembler(self._config.max_object_bytes, self._default_ttl_s)
        writer = _BatchWriter(lambda items: self._run(self._store.put_many, items), self._config.put_batch_bytes)
        with tracing.child_span(self._tracer, "cache.put", {tracing.BACKEND: self._store.backend}) as span:
            try:
                async for chunk in request_iterator:
                    for done in assembler.feed(chunk):
                        await writer.add(done)
                for done in assembler.finish():
                    await writer.add(done)
            except ProtocolError as exc:
                await writer.results()  # objects completed before the error stay stored
                tracing.mark_error(span, "INVALID_ARGUMENT", str(exc))
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            results = await writer.results()
            elapsed = time.perf_counter() - started
            statuses = [outcome.status for _, outcome in results]
            self._metrics.transfer("put", assembler.bytes_received, elapsed)
            self._metrics.key_results("BatchPut", statuses)
            self._metrics.rpc_seconds.labels("BatchPut").observe(elapsed)
            tracing.set_attributes(span, {tracing.BYTES: assembler.bytes_received, tracing.KEYS: len(results),
                                          tracing.BLOCKS: _count_blocks(k for k, _ in results)})
            failure = _failed(statuses, (Status.ERROR, Status.CORRUPT, Status.TOO_LARGE, Status.INVALID))
            if failure is not None:
                tracing.mark_error(span, failure, "some objects were not stored")
        return cache_pb2.BatchPutResponse(results=[_key_result(k, o) for k, o in results],
                                          bytes_received=assembler.bytes_received)

    async def BatchGet(self, request: cache_pb2.BatchGetRequest, context) -> AsyncIterator[cache_pb2.GetChunk]:
        started, sent, statuses = time.perf_counter(), 0, []
        keys = list(request.keys)
        step = self._config.get_window_keys
        windows = [range(i, min(i + step, len(keys))) for i in range(0, len(keys), step)]
        pending = asyncio.ensure_future(self._fetch([keys[i] for i in windows[0]])) if windows else None
        with tracing.child_span(self._tracer, "cache.get", {tracing.BACKEND: self._store.backend,
                                                            tracing.KEYS: len(keys),
                                                            tracing.BLOCKS: _count_blocks(keys)}) as span:
            try:
                for w, window in enumerate(windows):
                    outcomes = await pending
                    pending = None
                    if w + 1 < len(windows):  # read the next window while this one streams
                        pending = asyncio.ensure_future(self._fetch([keys[i] for i in windows[w + 1]]))
                    for index, outcome in zip(window, outcomes):
                        statuses.append(outcome.status)
                        sent += len(outcome.data or b"")
                        for chunk in _get_chunks(index, outcome, self._config.chunk_bytes):
                            yield chunk
            finally:
                if pending is not None:
                    pending.cancel()
                tracing.set_attributes(span, {tracing.BYTES: sent, "kdamesh.keys_found": statuses.count(Status.FOUND)})
            failure = _failed(statuses, (Status.ERROR, Status.CORRUPT))  # a MISSING key is a miss, not a failure
            if failure is not None:
                tracing.mark_error(span, failure, "some objects could not be read")
        elapsed = time.perf_counter() - started
        self._metrics.transfer("get", sent, elapsed)
        self._metrics.key_results("BatchGet", statuses)
        self._metrics.rpc_seconds.labels("BatchGet").observe(elapsed)

    async def _fetch(self, keys: Sequence[common_pb2.ObjectKey]) -> list[GetOutcome]:
        encoded = [_try_encode(key) for key in keys]
        valid = [k for k in encoded if isinstance(k, bytes)]
        found = iter(await self._run(self._store.get_many, valid) if valid else [])
        return [next(found) if isinstance(k, bytes) else GetOutcome(Status.MISSING, message=k) for k in encoded]

    async def Lookup(self, request: cache_pb2.LookupRequest, context) -> cache_pb2.LookupResponse:
        attributes = {tracing.BACKEND: self._store.backend, tracing.KEYS: len(request.content_hashes),
                      "kdamesh.cache.kind": common_pb2.ObjectKind.Name(request.kind)
                      if request.kind in common_pb2.ObjectKind.values() else str(request.kind)}
        with self._metrics.rpc_seconds.labels("Lookup").time(), \
                tracing.child_span(self._tracer, "cache.lookup", attributes) as span:
            try:
                keys = [encode_key(request.model_fingerprint, request.tenant_salt, request.kind, content_hash)
                        for content_hash in request.content_hashes]
            except ValueError as exc:
                tracing.mark_error(span, "INVALID_ARGUMENT", str(exc))
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"invalid Lookup: {exc}")
            try:
                outcome = await self._run(self._store.lookup, keys, request.include_presence)
            except StoreUnavailableError as exc:
                tracing.mark_error(span, type(exc).__name__, str(exc))
                await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
            span.set_attribute(tracing.HIT_BLOCKS, outcome.prefix_hit_length)
            if request.include_presence:
                span.set_attribute("kdamesh.keys_present", sum(outcome.present))
            return cache_pb2.LookupResponse(prefix_hit_length=outcome.prefix_hit_length, present=outcome.present)

    async def Lease(self, request: cache_pb2.LeaseRequest, context) -> cache_pb2.LeaseResponse:
        with self._metrics.rpc_seconds.labels("Lease").time():
            ttl_s = request.ttl_ms / 1000 if request.ttl_ms else self._config.lease_ttl_s

            def lease(keys: list[bytes]) -> tuple[str, list[KeyOutcome]]:
                grant = self._store.lease(keys, ttl_s)
                return grant.lease_id, grant.outcomes

            lease_id, outcomes = await self._per_key(request.keys, lease)
            self._metrics.key_results("Lease", [o.status for o in outcomes])
            return cache_pb2.LeaseResponse(lease_id=lease_id, ttl_ms=int(ttl_s * 1000),
                                           results=[_key_result(k, o) for k, o in zip(request.keys, outcomes)])

    async def Release(self, request: cache_pb2.ReleaseRequest, context) -> cache_pb2.ReleaseResponse:
        with self._metrics.rpc_seconds.labels("Release").time():
            try:
                found, n = await self._run(self._store.release, request.lease_id)
            except StoreUnavailableError as exc:
                await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
            return cache_pb2.ReleaseResponse(found=found, released_keys=n)

    async def Remove(self, request: cache_pb2.RemoveRequest, context) -> cache_pb2.RemoveResponse:
        with self._metrics.rpc_seconds.labels("Remove").time():
            _, outcomes = await self._per_key(request.keys, lambda ks: ("", self._store.remove(ks, request.force)))
            self._metrics.key_results("Remove", [o.status for o in outcomes])
            return cache_pb2.RemoveResponse(results=[_key_result(k, o) for k, o in zip(request.keys, outcomes)])

    async def Stats(self, request: cache_pb2.StatsRequest, context) -> cache_pb2.StatsResponse:
        try:
            stats = await self._run(self._store.stats)
        except StoreUnavailableError as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        counters = vars(stats.counters)
        return cache_pb2.StatsResponse(
            backend=stats.backend, objects=stats.objects, stored_bytes=stats.stored_bytes,
            capacity_bytes=stats.capacity_bytes, leased_objects=stats.leased_objects,
            active_leases=stats.active_leases, high_watermark=stats.high_watermark,
            low_watermark=stats.low_watermark, **counters)

    async def DataPlane(self, request: cache_pb2.DataPlaneRequest, context) -> cache_pb2.DataPlaneResponse:
        return describe_data_plane(self._store, self._config)

    async def Reserve(self, request: cache_pb2.ReserveRequest, context) -> cache_pb2.ReserveResponse:
        arena = await self._arena_or_abort(context)
        started = time.perf_counter()
        admitted = [admit(o, self._config.max_object_bytes, self._default_ttl_s) for o in request.objects]
        items = [ReserveItem(a.item_key, o.size_bytes, a.ttl_s)
                 for a, o in zip(admitted, request.objects) if isinstance(a, Admitted)]
        grant = await self._run(self._store.reserve, items, self._hold_s(request.ttl_ms)) if items else None
        granted = iter(grant.outcomes if grant else [])
        results = []
        for a in admitted:
            outcome = next(granted) if isinstance(a, Admitted) else a
            results.append(cache_pb2.ReserveResult(status=int(outcome.status), message=outcome.message,
                                                   offset=getattr(outcome, "offset", 0)))
        self._metrics.key_results("Reserve", [Status(r.status) for r in results])
        self._metrics.rpc_seconds.labels("Reserve").observe(time.perf_counter() - started)
        return cache_pb2.ReserveResponse(reservation_id=grant.reservation_id if grant else "",
                                         ttl_ms=int(grant.ttl_s * 1000) if grant else 0, results=results,
                                         arena_token=arena.token)

    async def Commit(self, request: cache_pb2.CommitRequest, context) -> cache_pb2.CommitResponse:
        await self._arena_or_abort(context)
        started = time.perf_counter()
        with tracing.child_span(self._tracer, "cache.put", {tracing.BACKEND: self._store.backend,
                                                            "kdamesh.cache.data_plane": "shm"}) as span:
            checksums = [_try_checksum(c) for c in request.checksums]
            try:
                committed = await self._run(self._store.commit, request.reservation_id, checksums)
            except ValueError as exc:
                tracing.mark_error(span, "INVALID_ARGUMENT", str(exc))
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            if committed is None:
                tracing.mark_error(span, "NOT_FOUND", "unknown or expired reservation")
                return cache_pb2.CommitResponse(found=False)
            outcomes, stored = committed
            statuses = [o.status for o in outcomes]
            failure = _failed(statuses, (Status.CORRUPT, Status.TOO_LARGE, Status.INVALID))
            if failure is not None:
                tracing.mark_error(span, failure, "some objects were not stored")
            tracing.set_attributes(span, {tracing.KEYS: len(outcomes), tracing.BYTES: stored})
        elapsed = time.perf_counter() - started
        self._metrics.transfer("put", stored, elapsed)  # the client's copy is not timed here
        self._metrics.key_results("Commit", statuses)
        self._metrics.rpc_seconds.labels("Commit").observe(elapsed)
        return cache_pb2.CommitResponse(found=True, bytes_stored=stored, results=[
            cache_pb2.KeyResult(status=int(o.status), message=o.message) for o in outcomes])

    async def Locate(self, request: cache_pb2.LocateRequest, context) -> cache_pb2.LocateResponse:
        arena = await self._arena_or_abort(context)
        started = time.perf_counter()
        keys = list(request.keys)
        attributes = {tracing.BACKEND: self._store.backend, tracing.KEYS: len(keys),
                      tracing.BLOCKS: _count_blocks(keys), "kdamesh.cache.data_plane": "shm"}
        with tracing.child_span(self._tracer, "cache.get", attributes) as span:
            encoded = [_try_encode(key) for key in keys]
            valid = [k for k in encoded if isinstance(k, bytes)]
            grant = await self._run(self._store.locate, valid, self._hold_s(request.pin_ttl_ms)) if valid else None
            found = iter(grant.locations if grant else [])
            locations = [_location(next(found)) if isinstance(k, bytes) else
                         cache_pb2.Location(status=int(Status.MISSING), message=k) for k in encoded]
            nbytes = sum(loc.size_bytes for loc in locations)
            span.set_attribute(tracing.BYTES, nbytes)
        elapsed = time.perf_counter() - started
        self._metrics.transfer("get", nbytes, elapsed)  # the client copies them out after this
        self._metrics.key_results("Locate", [Status(loc.status) for loc in locations])
        self._metrics.rpc_seconds.labels("Locate").observe(elapsed)
        return cache_pb2.LocateResponse(pin_id=grant.pin_id if grant else "",
                                        ttl_ms=int(grant.ttl_s * 1000) if grant else 0, locations=locations,
                                        arena_token=arena.token)

    async def _arena_or_abort(self, context) -> SharedArena:
        arena = getattr(self._store, "arena", None)
        if arena is None or not self._config.data_plane:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "this cache service has no shared-memory data plane (see DataPlane)")
        return arena

    def _hold_s(self, ttl_ms: int) -> float:
        """A reservation's or pin's lifetime (seconds): as asked, at most max_hold_s, max_hold_s when unset."""
        return min(ttl_ms / 1000, self._config.max_hold_s) if ttl_ms else self._config.max_hold_s

    async def _per_key(self, keys: Sequence[common_pb2.ObjectKey],
                       call: Callable[[list[bytes]], tuple[str, list[KeyOutcome]]]) -> tuple[str, list[KeyOutcome]]:
        """Runs `call` on the valid keys; invalid keys answer INVALID. -> (lease id or "", per-key outcomes)."""
        encoded = [_try_encode(key) for key in keys]
        valid = [k for k in encoded if isinstance(k, bytes)]
        tag, outcomes = await self._run(call, valid) if valid else ("", [])
        it = iter(outcomes)
        return tag, [next(it) if isinstance(k, bytes) else KeyOutcome(Status.INVALID, k) for k in encoded]


def _try_checksum(msg: cache_pb2.Checksum) -> Checksum | None:
    """The checksum, or None when it is unusable (unknown algorithm, wrong length)."""
    try:
        return Checksum.from_proto(msg)
    except ValueError:
        return None


def _location(loc) -> cache_pb2.Location:
    if loc.status != Status.FOUND:
        return cache_pb2.Location(status=int(loc.status))
    return cache_pb2.Location(status=int(loc.status), offset=loc.offset, size_bytes=loc.size,
                              checksum=loc.checksum.to_proto())


def _try_encode(key: common_pb2.ObjectKey) -> bytes | str:
    """The store key, or why the key is invalid."""
    try:
        return encode_object_key(key)
    except ValueError as exc:
        return f"invalid key: {exc}"


# -- server lifecycle --------------------------------------------------------------------------------------------


class CacheServer:
    """A running cache service: the gRPC server plus what it owns (store, thread pool, metrics endpoint)."""

    def __init__(self, grpc_server: grpc.aio.Server, port: int, store: Store, health_servicer,
                 metrics: CacheMetrics, executor: ThreadPoolExecutor, metrics_http=None):
        self.grpc_server = grpc_server
        self.port = port
        self.store = store
        self.health = health_servicer
        self.metrics = metrics
        self._executor = executor
        self._metrics_http = metrics_http

    @property
    def metrics_port(self) -> int | None:
        return None if self._metrics_http is None else self._metrics_http[0].server_port

    async def stop(self, grace: float | None = 5.0) -> None:
        """NOT_SERVING, then stop accepting calls and give those in flight `grace` seconds, then close the store."""
        await self.health.enter_graceful_shutdown()
        await self.grpc_server.stop(grace)
        self._executor.shutdown(wait=False, cancel_futures=True)
        self.store.close()
        if self._metrics_http is not None:
            self._metrics_http[0].shutdown()
            self._metrics_http[0].server_close()

    async def wait_for_termination(self) -> None:
        await self.grpc_server.wait_for_termination()


async def serve(config: CacheServiceConfig, *, store: Store | None = None, registry: CollectorRegistry | None = None,
                tracer_provider: TracerProvider | None = None) -> tuple[CacheServer, int]:
    """Starts the service -> (server, bound port). `store` overrides the backend (tests inject fake clocks);
    `tracer_provider` None: OpenTelemetry's global provider."""
    store = store if store is not None else make_store(config)
    metrics = CacheMetrics(registry)
    metrics.watch(store)
    executor = ThreadPoolExecutor(max_workers=config.store_threads, thread_name_prefix="cache-store")
    interceptors = server_interceptors("cache", tracer_provider=tracer_provider,
                                       metrics=RpcMetrics(metrics.registry, "cache", with_latency=False),
                                       access_log_level=logging.DEBUG)
    tracer = tracing.get_tracer("kdamesh.cache", tracer_provider)
    servicer = CacheServicer(store, config, metrics, executor, tracer)
    server, port, health_servicer = await start_grpc_server(
        config.address, SERVICE_NAME, lambda s: cache_pb2_grpc.add_CacheServiceServicer_to_server(servicer, s),
        config.max_message_bytes, interceptors)
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    metrics_http = None
    if config.metrics_port is not None:
        host = config.address.rsplit(":", 1)[0].strip("[]") or "0.0.0.0"
        metrics_http = start_http_server(config.metrics_port, addr=host, registry=metrics.registry)
    log.info("cache service on port %d, backend %s", port, store.backend)
    return CacheServer(server, port, store, health_servicer, metrics, executor, metrics_http), port


# -- command line --------------------------------------------------------------------------------------------------


def parse_bytes(text: str) -> int:
    """'1073741824', '512MiB', '1GiB', '64KiB', '2GB' -> bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*", text, re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"not a byte size: {text!r}")
    unit = (m.group(2) or "B").upper()
    scale = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
             "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40}[unit]
    return int(float(m.group(1)) * scale)


def build_parser() -> argparse.ArgumentParser:
    d = CacheServiceConfig()
    p = argparse.ArgumentParser(prog="kdamesh serve --role cache", description="The kdamesh cache service.")
    p.add_argument("--address", default=d.address, help="host:port to listen on (port 0: a free port)")
    p.add_argument("--cache-backend", "--backend", dest="backend", default=d.backend,
                   help="'memory' or redis://host:port/db")
    p.add_argument("--byte-budget", type=parse_bytes, default=d.byte_budget, help="memory backend budget, e.g. 4GiB")
    p.add_argument("--high-watermark", type=float, default=d.high_watermark)
    p.add_argument("--low-watermark", type=float, default=d.low_watermark)
    p.add_argument("--handoff-ttl-s", type=float, default=d.handoff_ttl_s)
    p.add_argument("--lease-ttl-s", type=float, default=d.lease_ttl_s)
    p.add_argument("--chunk-bytes", type=parse_bytes, default=d.chunk_bytes)
    p.add_argument("--max-message-bytes", type=parse_bytes, default=d.max_message_bytes)
    p.add_argument("--max-object-bytes", type=parse_bytes, default=d.max_object_bytes)
    p.add_argument("--redis-key-prefix", default=d.redis_key_prefix)
    p.add_argument("--redis-inline-bytes", type=parse_bytes, default=d.redis_inline_bytes,
                   help="Redis backend: payloads up to this size are stored inside their manifest")
    p.add_argument("--memory-arena", choices=("shm", "heap"), default=d.memory_arena,
                   help="memory backend: payloads in a shared-memory arena local clients map (shm), or the heap")
    p.add_argument("--shm-dir", default=d.shm_dir, help="directory of the shared-memory arena (a tmpfs)")
    p.add_argument("--verify-commits", action="store_true",
                   help="re-verify shared-memory puts at Commit (reads always verify)")
    p.add_argument("--no-data-plane", dest="data_plane", action="store_false",
                   help="offer no direct data plane (Redis URL, shared-memory arena): payloads over gRPC only")
    p.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus /metrics on this port")
    p.add_argument("--grace-s", type=float, default=5.0, help="shutdown grace period (seconds)")
    p.add_argument("--log-level", default="INFO")
    return p


def config_from_args(args: argparse.Namespace) -> CacheServiceConfig:
    return CacheServiceConfig(
        address=args.address, backend=args.backend, byte_budget=args.byte_budget,
        high_watermark=args.high_watermark, low_watermark=args.low_watermark, handoff_ttl_s=args.handoff_ttl_s,
        lease_ttl_s=args.lease_ttl_s, chunk_bytes=args.chunk_bytes, max_message_bytes=args.max_message_bytes,
        max_object_bytes=args.max_object_bytes, redis_key_prefix=args.redis_key_prefix,
        redis_inline_bytes=args.redis_inline_bytes, memory_arena=args.memory_arena, shm_dir=args.shm_dir,
        verify_commits=args.verify_commits,
        data_plane=args.data_plane, metrics_port=args.metrics_port)


async def _run_until_signal(config: CacheServiceConfig, grace_s: float) -> None:
    server, port = await serve(config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    host = config.address.rsplit(":", 1)[0]
    extra = f", metrics on :{server.metrics_port}" if server.metrics_port is not None else ""
    print(f"kdamesh cache service listening on {host}:{port} (backend {server.store.backend}{extra})", flush=True)
    await stop.wait()
    await server.stop(grace_s)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    tune_malloc()  # MiB payload buffers reuse heap memory instead of faulting in fresh pages (see malloc_tuning)
    asyncio.run(_run_until_signal(config_from_args(args), args.grace_s))
    return 0
