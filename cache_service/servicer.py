"""The cache service's gRPC servicer: parses each call, runs the store in a thread pool (so the event loop never
blocks on Redis or checksums) and maps the answers.

Contract:
- Per-key outcomes are statuses, never RPC errors. RPC errors: INVALID_ARGUMENT for a BatchPut stream that breaks
  framing (data outside an object, more data than announced), for a Lookup with an unusable kind or hash and for a
  Commit whose checksums do not match its reservation in number; FAILED_PRECONDITION for Reserve, Commit and Locate
  without an arena; UNAVAILABLE when a call without per-key results (Lookup, Release, Stats) cannot reach the
  backend. Deadlines and client cancellation cancel the handler (gRPC does); a store call already running in the
  thread pool finishes within the backend's socket timeouts and its result is dropped.
- BatchPut stores objects as they complete, in batches of about `put_batch_bytes` with at most two batches in flight
  (`batch_writer`), so receiving overlaps storing; BatchGet reads `get_window_keys` keys ahead of what it streams,
  in messages of `chunk_bytes` payload bytes.
- HANDOFF objects without an explicit TTL get `handoff_ttl_s`; other kinds default to no expiry. Reservations and
  Locate pins last as asked, at most `max_hold_s`.
- Every RPC runs in one wrapper (`_observed`, set up per method by its `_Rpc` row): the handler's latency goes to
  `kdamesh_cache_rpc_seconds{method}` (every call, however it ends); a call that finished with per-key results
  counts them in `kdamesh_cache_keys_total` and, for the payload methods, its bytes and wall time in
  `kdamesh_cache_transfer_*` (shm-plane bytes at Commit and Locate: the client's copies are not timed); the
  methods that move or look up objects get a child span (`cache.put`, `cache.get`, `cache.lookup`; attributes:
  bytes, keys, blocks, hit blocks, backend), marked failed (`error.type`) with the first failing key status, or
  with the reason the call was refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc
from opentelemetry import trace
from opentelemetry.trace import Span, Tracer

from cache_service.batch_writer import BatchWriter
from cache_service.config import CacheServiceConfig
from cache_service.metrics import CacheMetrics
from cache_service.objects import Checksum, Status, encode_key, encode_object_key, handoff_default_ttl
from cache_service.put_assembler import Admitted, ProtocolError, PutAssembler, admit
from cache_service.shm_arena import SharedArena
from cache_service.store import GetOutcome, KeyOutcome, ReserveItem, Store, StoreUnavailableError
from cache_service.store_factory import describe_data_plane
from protos import cache_pb2, cache_pb2_grpc, common_pb2
from telemetry import tracing

_NOT_STORED = (Status.CORRUPT, Status.TOO_LARGE, Status.INVALID)


@dataclass(frozen=True)
class _Rpc:
    """How one method is observed."""

    span: str | None = None  # the child span's name; None: no child span
    direction: str | None = None  # "put" | "get": payload bytes count in the transfer metrics
    failures: tuple[Status, ...] = ()  # key statuses that mark the span failed ...
    failure: str = ""  # ... with this description


_RPCS = {
    "BatchPut": _Rpc("cache.put", "put", (Status.ERROR, *_NOT_STORED), "some objects were not stored"),
    "BatchGet": _Rpc("cache.get", "get", (Status.ERROR, Status.CORRUPT),  # a MISSING key is a miss, not a failure
                     "some objects could not be read"),
    "Lookup": _Rpc("cache.lookup"),
    "Commit": _Rpc("cache.put", "put", _NOT_STORED, "some objects were not stored"),
    "Locate": _Rpc("cache.get", "get"),
    **{method: _Rpc() for method in ("Lease", "Release", "Remove", "Stats", "DataPlane", "Reserve")},
}


@dataclass
class _Call:
    """What a handler reports to `_observed`: its span, and at the end its per-key statuses and payload bytes."""

    span: Span
    statuses: list[Status] | None = None  # None: the call ended without per-key results
    nbytes: int = 0

    def finish(self, statuses: Sequence[Status], nbytes: int = 0, attributes: Mapping | None = None) -> None:
        self.statuses, self.nbytes = list(statuses), nbytes
        if attributes:
            tracing.set_attributes(self.span, attributes)


class CacheServicer(cache_pb2_grpc.CacheServiceServicer):
    def __init__(self, store: Store, config: CacheServiceConfig, metrics: CacheMetrics, executor: ThreadPoolExecutor,
                 tracer: Tracer | None = None):
        self._store = store
        self._config = config
        self._metrics = metrics
        self._executor = executor
        self._tracer = tracer if tracer is not None else tracing.get_tracer("kdamesh.cache")
        self._default_ttl_s = handoff_default_ttl(config.handoff_ttl_s)

    def _run(self, fn: Callable, *args) -> asyncio.Future:
        return asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    @contextlib.contextmanager
    def _observed(self, method: str, attributes: Mapping[str, object] | None = None) -> Iterator[_Call]:
        """The one place a call's latency, key results, transfer and span are recorded (module docstring)."""
        rpc = _RPCS[method]
        started = time.perf_counter()
        span_scope = tracing.child_span(self._tracer, rpc.span, attributes) if rpc.span else \
            contextlib.nullcontext(trace.INVALID_SPAN)
        with self._metrics.rpc_seconds.labels(method).time(), span_scope as span:
            call = _Call(span)
            yield call
            if call.statuses is None:
                return
            failure = _failed(call.statuses, rpc.failures)
            if failure is not None:
                tracing.mark_error(span, failure, rpc.failure)
            if rpc.direction is not None:
                self._metrics.transfer(rpc.direction, call.nbytes, time.perf_counter() - started)
            self._metrics.key_results(method, call.statuses)

    async def _run_or_unavailable(self, context, span: Span, fn: Callable, *args):
        """`fn(*args)` in the thread pool; a backend that cannot be reached aborts the call UNAVAILABLE."""
        try:
            return await self._run(fn, *args)
        except StoreUnavailableError as exc:
            tracing.mark_error(span, type(exc).__name__, str(exc))
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))

    # -- put and get over gRPC ----------------------------------------------------------------------------------

    async def BatchPut(self, request_iterator: AsyncIterator[cache_pb2.PutChunk],
                       context) -> cache_pb2.BatchPutResponse:
        assembler = PutAssembler(self._config.max_object_bytes, self._default_ttl_s)
        writer = BatchWriter(lambda items: self._run(self._store.put_many, items), self._config.put_batch_bytes)
        with self._observed("BatchPut", {tracing.BACKEND: self._store.backend}) as call:
            try:
                async for chunk in request_iterator:
                    for done in assembler.feed(chunk):
                        await writer.add(done)
                for done in assembler.finish():
                    await writer.add(done)
            except ProtocolError as exc:
                await writer.results()  # objects completed before the error stay stored
                tracing.mark_error(call.span, "INVALID_ARGUMENT", str(exc))
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            results = await writer.results()
            call.finish([outcome.status for _, outcome in results], assembler.bytes_received,
                        {tracing.BYTES: assembler.bytes_received, tracing.KEYS: len(results),
                         tracing.BLOCKS: _count_blocks(k for k, _ in results)})
        return cache_pb2.BatchPutResponse(results=[_key_result(k, o) for k, o in results],
                                          bytes_received=assembler.bytes_received)

    async def BatchGet(self, request: cache_pb2.BatchGetRequest, context) -> AsyncIterator[cache_pb2.GetChunk]:
        sent, statuses = 0, []
        keys = list(request.keys)
        step = self._config.get_window_keys
        windows = [range(i, min(i + step, len(keys))) for i in range(0, len(keys), step)]
        pending = asyncio.ensure_future(self._fetch([keys[i] for i in windows[0]])) if windows else None
        attributes = {tracing.BACKEND: self._store.backend, tracing.KEYS: len(keys),
                      tracing.BLOCKS: _count_blocks(keys)}
        with self._observed("BatchGet", attributes) as call:
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
                tracing.set_attributes(call.span, {tracing.BYTES: sent,
                                                   "kdamesh.keys_found": statuses.count(Status.FOUND)})
            call.finish(statuses, sent)

    async def _fetch(self, keys: Sequence[common_pb2.ObjectKey]) -> list[GetOutcome]:
        encoded = [_try_encode(key) for key in keys]
        valid = [k for k in encoded if isinstance(k, bytes)]
        found = iter(await self._run(self._store.get_many, valid) if valid else [])
        return [next(found) if isinstance(k, bytes) else GetOutcome(Status.MISSING, message=k) for k in encoded]

    # -- lookup, leases, removal, stats --------------------------------------------------------------------------

    async def Lookup(self, request: cache_pb2.LookupRequest, context) -> cache_pb2.LookupResponse:
        attributes = {tracing.BACKEND: self._store.backend, tracing.KEYS: len(request.content_hashes),
                      "kdamesh.cache.kind": common_pb2.ObjectKind.Name(request.kind)
                      if request.kind in common_pb2.ObjectKind.values() else str(request.kind)}
        with self._observed("Lookup", attributes) as call:
            try:
                keys = [encode_key(request.model_fingerprint, request.tenant_salt, request.kind, content_hash)
                        for content_hash in request.content_hashes]
            except ValueError as exc:
                tracing.mark_error(call.span, "INVALID_ARGUMENT", str(exc))
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"invalid Lookup: {exc}")
            outcome = await self._run_or_unavailable(context, call.span, self._store.lookup, keys,
                                                     request.include_presence)
            call.span.set_attribute(tracing.HIT_BLOCKS, outcome.prefix_hit_length)
            if request.include_presence:
                call.span.set_attribute("kdamesh.keys_present", sum(outcome.present))
            return cache_pb2.LookupResponse(prefix_hit_length=outcome.prefix_hit_length, present=outcome.present)

    async def Lease(self, request: cache_pb2.LeaseRequest, context) -> cache_pb2.LeaseResponse:
        ttl_s = request.ttl_ms / 1000 if request.ttl_ms else self._config.lease_ttl_s

        def lease(keys: list[bytes]) -> tuple[str, list[KeyOutcome]]:
            grant = self._store.lease(keys, ttl_s)
            return grant.lease_id, grant.outcomes

        with self._observed("Lease") as call:
            lease_id, outcomes = await self._per_key(request.keys, lease)
            call.finish([o.status for o in outcomes])
        return cache_pb2.LeaseResponse(lease_id=lease_id, ttl_ms=int(ttl_s * 1000),
                                       results=[_key_result(k, o) for k, o in zip(request.keys, outcomes)])

    async def Release(self, request: cache_pb2.ReleaseRequest, context) -> cache_pb2.ReleaseResponse:
        with self._observed("Release") as call:
            found, n = await self._run_or_unavailable(context, call.span, self._store.release, request.lease_id)
        return cache_pb2.ReleaseResponse(found=found, released_keys=n)

    async def Remove(self, request: cache_pb2.RemoveRequest, context) -> cache_pb2.RemoveResponse:
        with self._observed("Remove") as call:
            _, outcomes = await self._per_key(request.keys, lambda ks: ("", self._store.remove(ks, request.force)))
            call.finish([o.status for o in outcomes])
        return cache_pb2.RemoveResponse(results=[_key_result(k, o) for k, o in zip(request.keys, outcomes)])

    async def Stats(self, request: cache_pb2.StatsRequest, context) -> cache_pb2.StatsResponse:
        with self._observed("Stats") as call:
            stats = await self._run_or_unavailable(context, call.span, self._store.stats)
        return cache_pb2.StatsResponse(
            backend=stats.backend, objects=stats.objects, stored_bytes=stats.stored_bytes,
            capacity_bytes=stats.capacity_bytes, leased_objects=stats.leased_objects,
            active_leases=stats.active_leases, high_watermark=stats.high_watermark,
            low_watermark=stats.low_watermark, **vars(stats.counters))

    async def _per_key(self, keys: Sequence[common_pb2.ObjectKey],
                       call: Callable[[list[bytes]], tuple[str, list[KeyOutcome]]]) -> tuple[str, list[KeyOutcome]]:
        """Runs `call` on the valid keys; invalid keys answer INVALID. -> (lease id or "", per-key outcomes)."""
        encoded = [_try_encode(key) for key in keys]
        valid = [k for k in encoded if isinstance(k, bytes)]
        tag, outcomes = await self._run(call, valid) if valid else ("", [])
        it = iter(outcomes)
        return tag, [next(it) if isinstance(k, bytes) else KeyOutcome(Status.INVALID, k) for k in encoded]

    # -- direct data planes ---------------------------------------------------------------------------------------

    async def DataPlane(self, request: cache_pb2.DataPlaneRequest, context) -> cache_pb2.DataPlaneResponse:
        with self._observed("DataPlane"):
            return describe_data_plane(self._store, self._config)

    async def Reserve(self, request: cache_pb2.ReserveRequest, context) -> cache_pb2.ReserveResponse:
        arena = await self._arena_or_abort(context)
        with self._observed("Reserve") as call:
            admitted = [admit(o, self._config.max_object_bytes, self._default_ttl_s) for o in request.objects]
            items = [ReserveItem(a.item_key, o.size_bytes, a.ttl_s)
                     for a, o in zip(admitted, request.objects) if isinstance(a, Admitted)]
            grant = await self._run(self._store.reserve, items, self._hold_s(request.ttl_ms)) if items else None
            granted = iter(grant.outcomes if grant else [])
            outcomes = [next(granted) if isinstance(a, Admitted) else a for a in admitted]
            call.finish([o.status for o in outcomes])
        return cache_pb2.ReserveResponse(
            reservation_id=grant.reservation_id if grant else "", ttl_ms=int(grant.ttl_s * 1000) if grant else 0,
            arena_token=arena.token, results=[cache_pb2.ReserveResult(
                status=int(o.status), message=o.message, offset=getattr(o, "offset", 0)) for o in outcomes])

    async def Commit(self, request: cache_pb2.CommitRequest, context) -> cache_pb2.CommitResponse:
        await self._arena_or_abort(context)
        with self._observed("Commit", {tracing.BACKEND: self._store.backend,
                                       "kdamesh.cache.data_plane": "shm"}) as call:
            checksums = [_try_checksum(c) for c in request.checksums]
            try:
                committed = await self._run(self._store.commit, request.reservation_id, checksums)
            except ValueError as exc:
                tracing.mark_error(call.span, "INVALID_ARGUMENT", str(exc))
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            if committed is None:
                tracing.mark_error(call.span, "NOT_FOUND", "unknown or expired reservation")
                return cache_pb2.CommitResponse(found=False)
            outcomes, stored = committed
            call.finish([o.status for o in outcomes], stored, {tracing.KEYS: len(outcomes), tracing.BYTES: stored})
        return cache_pb2.CommitResponse(found=True, bytes_stored=stored, results=[
            cache_pb2.KeyResult(status=int(o.status), message=o.message) for o in outcomes])

    async def Locate(self, request: cache_pb2.LocateRequest, context) -> cache_pb2.LocateResponse:
        arena = await self._arena_or_abort(context)
        keys = list(request.keys)
        attributes = {tracing.BACKEND: self._store.backend, tracing.KEYS: len(keys),
                      tracing.BLOCKS: _count_blocks(keys), "kdamesh.cache.data_plane": "shm"}
        with self._observed("Locate", attributes) as call:
            encoded = [_try_encode(key) for key in keys]
            valid = [k for k in encoded if isinstance(k, bytes)]
            grant = await self._run(self._store.locate, valid, self._hold_s(request.pin_ttl_ms)) if valid else None
            found = iter(grant.locations if grant else [])
            locations = [_location(next(found)) if isinstance(k, bytes) else
                         cache_pb2.Location(status=int(Status.MISSING), message=k) for k in encoded]
            nbytes = sum(loc.size_bytes for loc in locations)  # the client copies them out after this
            call.finish([Status(loc.status) for loc in locations], nbytes, {tracing.BYTES: nbytes})
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
