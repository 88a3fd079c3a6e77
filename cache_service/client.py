"""An asyncio client of the cache service (what prefill and decode workers use).

Contract:
- Every call has a deadline (`timeout_s`, default 10 s, overridable per call). A service that went away and came
  back is reconnected to within `RECONNECT_MAX_MS` (2 s): the channel's reconnect backoff is capped there.
- Batch calls never raise for a failed RPC: when the service is unreachable, the deadline passes or the call fails,
  every key the answer did not cover gets an ERROR status whose message names the gRPC code. The caller treats
  ERROR, MISSING and CORRUPT alike: a miss, recompute. `lookup` answers a prefix of 0 with `error` set, `release`
  answers False. Only `stats` raises (`grpc.aio.AioRpcError`).
- `put_objects` streams each object in `chunk_bytes` pieces with its checksum (XXH3-64 by default); `get_objects`
  reassembles the chunks and verifies the checksum again end to end (a mismatch is CORRUPT).
- Direct data planes (`data_plane="auto"`, the default; see `data_plane`): after one DataPlane call, puts and gets
  move payloads straight to the service's Redis, or through the service's shared-memory arena when it runs on this
  host, with the same statuses, checksums, TTLs and counters as over gRPC; when the direct path cannot be used (Redis
  unreachable from here, another host's arena) the call goes over gRPC instead (logged once). `data_plane="grpc"`:
  always gRPC. Lookup, Lease, Release, Remove and Stats always use gRPC.
- Create the client inside the event loop that uses it (a `grpc.aio` channel belongs to one loop), and `close` it
  (it may hold a Redis connection pool, an arena mapping and worker threads).
- Results come back in the order of the request. A large batch is spread over `streams` concurrent calls (default 2;
  each object stays whole within one call), which roughly doubles throughput over one stream.
- `interceptors` go on the channel (the workers pass telemetry's client interceptors: trace context and request id
  in the call metadata).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import grpc

from cache_service.client_types import (MAX_TTL_MS, GetResult, KeyResult, LeaseResult, LookupResult, PutObject,
                                        ttl_ms)
from cache_service.data_plane import DataPlanes, DirectUnavailable
from cache_service.objects import Checksum, ChecksumAlgorithm, Status
from protos import cache_pb2, cache_pb2_grpc, common_pb2

__all__ = ["CacheClient", "GetResult", "KeyResult", "LeaseResult", "LookupResult", "PutObject", "MAX_TTL_MS",
           "DEFAULT_TIMEOUT_S"]

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 10.0
RECONNECT_INITIAL_MS, RECONNECT_MAX_MS = 200, 2000  # the channel's reconnect backoff after a failed connect


@dataclass
class _Reassembly:
    status: Status
    size: int = 0
    checksum: Checksum | None = None
    parts: list[bytes] = field(default_factory=list)
    message: str = ""


def _describe(exc: grpc.aio.AioRpcError) -> str:
    return f"cache service call failed: {exc.code().name}: {exc.details()}"


class CacheClient:
    def __init__(self, address: str, *, timeout_s: float = DEFAULT_TIMEOUT_S, chunk_bytes: int = 1 << 20,
                 max_message_bytes: int = 4 << 20, checksum_algorithm: ChecksumAlgorithm = ChecksumAlgorithm.XXH3_64,
                 streams: int = 2, interceptors: Sequence[grpc.aio.ClientInterceptor] = (), data_plane: str = "auto"):
        if streams < 1:
            raise ValueError(f"streams must be >= 1, got {streams}")
        self.address = address
        self.timeout_s = timeout_s
        self.chunk_bytes = chunk_bytes
        self.streams = streams
        self.checksum_algorithm = checksum_algorithm
        options = [("grpc.max_receive_message_length", max_message_bytes),
                   ("grpc.max_send_message_length", max_message_bytes),
                   # a restarted cache service is found again within RECONNECT_MAX_MS (gRPC's default: up to 120 s)
                   ("grpc.initial_reconnect_backoff_ms", RECONNECT_INITIAL_MS),
                   ("grpc.max_reconnect_backoff_ms", RECONNECT_MAX_MS)]
        self._channel = grpc.aio.insecure_channel(address, options=options, interceptors=list(interceptors) or None)
        self._stub = cache_pb2_grpc.CacheServiceStub(self._channel)
        # "auto": payloads over the direct plane the service offers; "grpc": over gRPC only.
        self.data_planes = DataPlanes(self._stub, data_plane, timeout_s, self._grpc_get)

    async def __aenter__(self) -> CacheClient:
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.close()

    async def close(self) -> None:
        await self.data_planes.close()
        await self._channel.close()

    def _timeout(self, timeout_s: float | None) -> float:
        return self.timeout_s if timeout_s is None else timeout_s

    def _deadline(self, timeout_s: float | None) -> float:
        """The call's deadline (event loop time, seconds)."""
        return asyncio.get_running_loop().time() + self._timeout(timeout_s)

    # -- put / get ------------------------------------------------------------------------------------------------

    async def put_objects(self, objects: Sequence[PutObject], timeout_s: float | None = None) -> list[KeyResult]:
        """Stores objects -> one result per object: STORED, CORRUPT, TOO_LARGE, INVALID or ERROR."""
        deadline = self._deadline(timeout_s)
        groups = _split_by_bytes([len(o.data) for o in objects], self.streams, self.chunk_bytes)
        plane = await self.data_planes.plane(deadline) if objects else None
        if plane is not None:
            try:  # concurrent groups overlap one's checksums or verification with another's transfer
                answers = await asyncio.gather(*[plane.put(objects[a:b], self.checksum_algorithm, deadline)
                                                 for a, b in groups])
                return [result for answer in answers for result in answer]
            except DirectUnavailable as exc:  # objects a group stored already are stored again: same bytes
                self.data_planes.failed(plane, exc)
        answers = await asyncio.gather(*[self._put_stream(objects[a:b], deadline) for a, b in groups])
        return [result for answer in answers for result in answer]

    async def _put_stream(self, objects: Sequence[PutObject], deadline: float) -> list[KeyResult]:
        if not objects:
            return []
        try:
            response = await self._stub.BatchPut(self._put_chunks(objects), timeout=_remaining(deadline))
        except grpc.aio.AioRpcError as exc:
            log.warning("BatchPut of %d objects failed: %s", len(objects), _describe(exc))
            return [KeyResult(o.key, Status.ERROR, _describe(exc)) for o in objects]
        return [KeyResult(r.key, Status(r.status), r.message) for r in response.results]

    async def _put_chunks(self, objects: Sequence[PutObject]) -> AsyncIterator[cache_pb2.PutChunk]:
        step = self.chunk_bytes
        for obj in objects:
            header = cache_pb2.ObjectHeader(key=obj.key, size_bytes=len(obj.data),
                                            checksum=Checksum.of(obj.data, self.checksum_algorithm).to_proto())
            if obj.ttl_s is not None:
                header.ttl_ms = ttl_ms(obj.ttl_s)
            yield cache_pb2.PutChunk(header=header, data=obj.data[:step])
            for offset in range(step, len(obj.data), step):
                yield cache_pb2.PutChunk(data=obj.data[offset:offset + step])

    async def get_objects(self, keys: Sequence[common_pb2.ObjectKey],
                          timeout_s: float | None = None) -> list[GetResult]:
        """Reads objects -> one result per key: FOUND (with data), MISSING, CORRUPT or ERROR."""
        deadline = self._deadline(timeout_s)
        plane = await self.data_planes.plane(deadline) if keys else None
        if plane is not None:
            try:
                answers = await asyncio.gather(*[plane.get(keys[a:b], deadline) for a, b in self._key_groups(keys)])
                return [result for answer in answers for result in answer]
            except DirectUnavailable as exc:
                self.data_planes.failed(plane, exc)
        return await self._grpc_get(keys, deadline)

    def _key_groups(self, keys: Sequence[common_pb2.ObjectKey]) -> list[tuple[int, int]]:
        return _split_by_bytes([1] * len(keys), self.streams, 1)

    async def _grpc_get(self, keys: Sequence[common_pb2.ObjectKey], deadline: float) -> list[GetResult]:
        answers = await asyncio.gather(*[self._get_stream(keys[a:b], deadline) for a, b in self._key_groups(keys)])
        return [result for answer in answers for result in answer]

    async def _get_stream(self, keys: Sequence[common_pb2.ObjectKey], deadline: float) -> list[GetResult]:
        if not keys:
            return []
        got: dict[int, _Reassembly] = {}
        failure = ""
        try:
            call = self._stub.BatchGet(cache_pb2.BatchGetRequest(keys=keys), timeout=_remaining(deadline))
            async for chunk in call:
                _absorb(got, chunk)
        except grpc.aio.AioRpcError as exc:
            failure = _describe(exc)
            log.warning("BatchGet of %d keys failed: %s", len(keys), failure)
        return [_finish(key, got.get(i), failure) for i, key in enumerate(keys)]

    # -- lookup / lease / remove / stats -------------------------------------------------------------------------

    async def lookup(self, model_fingerprint: bytes, tenant_salt: bytes, kind: int, content_hashes: Sequence[bytes],
                     include_presence: bool = False, timeout_s: float | None = None) -> LookupResult:
        """How many leading hashes of a chain are cached (and, with include_presence, which ones)."""
        request = cache_pb2.LookupRequest(model_fingerprint=model_fingerprint, tenant_salt=tenant_salt, kind=kind,
                                          content_hashes=content_hashes, include_presence=include_presence)
        try:
            response = await self._stub.Lookup(request, timeout=self._timeout(timeout_s))
        except grpc.aio.AioRpcError as exc:
            return LookupResult(0, [], _describe(exc))
        return LookupResult(response.prefix_hit_length, list(response.present))

    async def lease(self, keys: Sequence[common_pb2.ObjectKey], ttl_s: float | None = None,
                    timeout_s: float | None = None) -> LeaseResult:
        """Pins present objects for ttl_s seconds (None: the service default, 30 s)."""
        ttl_ms = 0 if ttl_s is None else min(max(1, int(ttl_s * 1000)), MAX_TTL_MS)
        request = cache_pb2.LeaseRequest(keys=keys, ttl_ms=ttl_ms)
        try:
            response = await self._stub.Lease(request, timeout=self._timeout(timeout_s))
        except grpc.aio.AioRpcError as exc:
            return LeaseResult("", [KeyResult(k, Status.ERROR, _describe(exc)) for k in keys], ttl_s or 0.0)
        results = [KeyResult(r.key, Status(r.status), r.message) for r in response.results]
        return LeaseResult(response.lease_id, results, response.ttl_ms / 1000)

    async def release(self, lease_id: str, timeout_s: float | None = None) -> bool:
        """Ends a lease -> whether it was active (False also when the service cannot be reached)."""
        try:
            response = await self._stub.Release(cache_pb2.ReleaseRequest(lease_id=lease_id),
                                                timeout=self._timeout(timeout_s))
        except grpc.aio.AioRpcError as exc:
            log.warning("Release of lease %s failed: %s", lease_id, _describe(exc))
            return False
        return response.found

    async def remove(self, keys: Sequence[common_pb2.ObjectKey], force: bool = False,
                     timeout_s: float | None = None) -> list[KeyResult]:
        """Deletes objects -> per key: REMOVED, MISSING, LEASED (kept unless force) or ERROR."""
        try:
            response = await self._stub.Remove(cache_pb2.RemoveRequest(keys=keys, force=force),
                                               timeout=self._timeout(timeout_s))
        except grpc.aio.AioRpcError as exc:
            return [KeyResult(k, Status.ERROR, _describe(exc)) for k in keys]
        return [KeyResult(r.key, Status(r.status), r.message) for r in response.results]

    async def stats(self, timeout_s: float | None = None) -> cache_pb2.StatsResponse:
        """The store's occupancy and counters. Raises grpc.aio.AioRpcError."""
        return await self._stub.Stats(cache_pb2.StatsRequest(), timeout=self._timeout(timeout_s))


def _remaining(deadline: float) -> float:
    """Seconds left until `deadline` (event loop time), at least 0."""
    return max(0.0, deadline - asyncio.get_running_loop().time())


def _split_by_bytes(sizes: Sequence[int], streams: int, min_bytes: int) -> list[tuple[int, int]]:
    """Contiguous [start, end) groups of about equal total size, at most `streams` of them and each of at least
    `min_bytes` (one stream for small batches)."""
    total = sum(sizes)
    n = max(1, min(streams, len(sizes), total // max(min_bytes, 1)))
    groups, start, acc = [], 0, 0
    for i, size in enumerate(sizes):
        acc += size
        if acc * n >= total * (len(groups) + 1) and len(groups) < n - 1:
            groups.append((start, i + 1))
            start = i + 1
    groups.append((start, len(sizes)))
    return groups


def _absorb(got: dict[int, _Reassembly], chunk: cache_pb2.GetChunk) -> None:
    if chunk.status != cache_pb2.KEY_STATUS_UNSPECIFIED:  # first chunk of a key
        got[chunk.index] = _first(chunk)
    current, data = got.get(chunk.index), chunk.data  # each read of chunk.data copies: read it once
    if data and current is not None:
        current.parts.append(data)


def _first(chunk: cache_pb2.GetChunk) -> _Reassembly:
    if chunk.status != cache_pb2.KEY_STATUS_FOUND:
        return _Reassembly(Status(chunk.status), message=chunk.message)
    try:
        return _Reassembly(Status.FOUND, chunk.size_bytes, Checksum.from_proto(chunk.checksum))
    except ValueError as exc:
        return _Reassembly(Status.ERROR, message=f"unusable checksum from the service: {exc}")


def _finish(key: common_pb2.ObjectKey, got: _Reassembly | None, failure: str) -> GetResult:
    if got is None:
        return GetResult(key, Status.ERROR, message=failure or "no answer for this key")
    if got.status != Status.FOUND:
        return GetResult(key, got.status, message=got.message)
    got.parts, parts = [], got.parts  # release the chunks as they are joined
    data = parts[0] if len(parts) == 1 else b"".join(parts)
    if len(data) != got.size:
        return GetResult(key, Status.ERROR, message=failure or f"received {len(data)} of {got.size} bytes")
    if not got.checksum.matches(data):
        return GetResult(key, Status.CORRUPT, message="checksum mismatch after transfer")
    return GetResult(key, Status.FOUND, data)
