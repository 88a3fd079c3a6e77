"""The cache client's direct data planes: payload bytes that bypass the service's gRPC hop; control stays on gRPC.

`DataPlanes` asks the service once (the DataPlane RPC) and gives `CacheClient` a plane for each put or get:
- `RedisPlane` (Redis backend): runs `RedisStore.put_many` / `get_many` itself against the service's Redis, with the
  service's key prefix, chunk and inline sizes. It is the code the service runs, so the key layout, manifests,
  chunking, atomic visibility, TTLs (the service's HANDOFF default included), checksum verification on read,
  per-key statuses and the counters in `{prefix}stats` are the same. The client computes each checksum once from the
  bytes it sends (the store does not verify puts again). Store calls run in a worker thread (the event loop never
  blocks); socket timeouts are at most the service's and at most the client's `timeout_s`.
- `ShmPlane` (memory backend with a shared-memory arena, same host): maps the arena after checking its token. put =
  Reserve, copy each payload into the mapping and checksum the copy (from cache: one pass over the payload), Commit
  with the checksums (the service verifies them over the arena and publishes); get = Locate (the service pins the
  objects), copy out, verify, Release in the background. A copy that fails its checksum is read again over BatchGet,
  where the service verifies, answers CORRUPT, counts and removes the object.

Contract:
- Every plane call keeps the caller's deadline: past it, the keys not answered are ERROR with DEADLINE_EXCEEDED in
  the message (a worker thread still running stops within one object, or within the Redis socket timeouts).
- `DataPlanes.plane(deadline)` is None (use gRPC) when data_plane="grpc", when the service offers no direct plane
  or predates DataPlane, when its arena cannot be mapped or holds another token (another host: logged once, at
  INFO), while a Redis plane that failed cools down (`retry_after_s`; logged once, WARNING), and when the DataPlane
  call itself failed (asked again on the next call).
- A plane call raises `DirectUnavailable` when the caller should redo the call over gRPC: Redis refuses us, or the
  service's arena changed (a restart) or is gone. Every other failure is a per-key status, as on gRPC (a Redis
  that times out too: the service's path to it is stuck as well; see `redis_store`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc

from cache_service.client_types import GetResult, KeyResult, PutObject, ttl_ms
from cache_service.objects import (Checksum, ChecksumAlgorithm, Refused, Status, admit_object, encode_object_key,
                                   handoff_default_ttl)
from cache_service.redis_store import RedisStore
from cache_service.shm_arena import ArenaMismatch, SharedArena
from cache_service.store import PutItem, StoreUnavailableError
from protos import cache_pb2, cache_pb2_grpc, common_pb2

log = logging.getLogger(__name__)

RELEASE_TIMEOUT_S = 2.0  # deadline of the background Release of a Locate pin
HOLD_GRACE_S = 1.0  # a reservation outlives the call's deadline by this much (a late copy finishing)
_DEADLINE = "DEADLINE_EXCEEDED: the direct data plane call ran past its deadline"


class DirectUnavailable(Exception):
    """Redo this call over gRPC. `rediscover`: the service's data plane changed (ask DataPlane again); otherwise the
    plane is unreachable for now (cool down)."""

    def __init__(self, why: str, rediscover: bool = False):
        super().__init__(why)
        self.rediscover = rediscover


@dataclass(frozen=True)
class ServicePolicy:
    """What the service applies to every put, which a direct put applies itself (from DataPlaneResponse)."""

    max_object_bytes: int
    handoff_ttl_s: float

    def admit(self, obj: PutObject) -> tuple[bytes, float | None]:
        """(store key, TTL in seconds or None) as the service decides it; raises Refused (INVALID, TOO_LARGE)."""
        return admit_object(obj.key, len(obj.data), None if obj.ttl_s is None else ttl_ms(obj.ttl_s),
                            self.max_object_bytes, handoff_default_ttl(self.handoff_ttl_s))


class _Cancelled:
    """Tells a worker thread its call's deadline passed: stop before the next object."""

    def __init__(self):
        self.set = False


async def _in_thread(executor: ThreadPoolExecutor, deadline: float, fn: Callable[[_Cancelled], list],
                     on_deadline: Callable[[], list]) -> list:
    """fn(cancelled) in a worker thread, waited for until `deadline` (loop time); past it, `on_deadline()`."""
    loop = asyncio.get_running_loop()
    remaining = deadline - loop.time()
    if remaining <= 0:
        return on_deadline()
    cancelled = _Cancelled()
    try:
        return await asyncio.wait_for(loop.run_in_executor(executor, fn, cancelled), remaining)
    except TimeoutError:
        cancelled.set = True
        return on_deadline()
    except StoreUnavailableError as exc:
        raise DirectUnavailable(str(exc)) from exc


# -- Redis ---------------------------------------------------------------------------------------------------------


class RedisPlane:
    kind = "redis"

    def __init__(self, info: cache_pb2.RedisDataPlane, policy: ServicePolicy, timeout_s: float,
                 executor: ThreadPoolExecutor):
        self._policy = policy
        self._executor = executor
        self._store = RedisStore(
            info.url, chunk_bytes=info.chunk_bytes, key_prefix=info.key_prefix, inline_bytes=info.inline_bytes,
            socket_timeout_s=min(info.socket_timeout_ms / 1000 or timeout_s, timeout_s),
            connect_timeout_s=min(info.connect_timeout_ms / 1000 or timeout_s, timeout_s),
            verify_puts=False, raise_when_unavailable=True)

    async def put(self, objects: Sequence[PutObject], algorithm: ChecksumAlgorithm,
                  deadline: float) -> list[KeyResult]:
        return await _in_thread(self._executor, deadline, lambda c: self._put(objects, algorithm),
                                lambda: [KeyResult(o.key, Status.ERROR, _DEADLINE) for o in objects])

    async def get(self, keys: Sequence[common_pb2.ObjectKey], deadline: float) -> list[GetResult]:
        return await _in_thread(self._executor, deadline, lambda c: self._get(keys),
                                lambda: [GetResult(k, Status.ERROR, message=_DEADLINE) for k in keys])

    def retire(self) -> None:
        """Closes the connection pool (a call still running gets an error, and goes over gRPC)."""
        self._store.close()

    async def close(self) -> None:
        self.retire()

    def _put(self, objects: Sequence[PutObject], algorithm: ChecksumAlgorithm) -> list[KeyResult]:
        """(worker thread) Raises StoreUnavailableError when Redis cannot be reached."""
        results: list[KeyResult | None] = []
        items, slots = [], []
        for obj in objects:
            try:
                key, ttl_s = self._policy.admit(obj)
            except Refused as exc:
                results.append(KeyResult(obj.key, exc.status, exc.message))
                continue
            items.append(PutItem(key, obj.data, Checksum.of(obj.data, algorithm), ttl_s))
            slots.append(len(results))
            results.append(None)
        for i, outcome in zip(slots, self._store.put_many(items) if items else []):
            results[i] = KeyResult(objects[i].key, outcome.status, outcome.message)
        return results

    def _get(self, keys: Sequence[common_pb2.ObjectKey]) -> list[GetResult]:
        """(worker thread) Raises StoreUnavailableError when Redis cannot be reached."""
        encoded = [_try_encode(key) for key in keys]
        found = iter(self._store.get_many([k for k in encoded if isinstance(k, bytes)]))
        results = []
        for key, k in zip(keys, encoded):
            if isinstance(k, bytes):
                outcome = next(found)
                results.append(GetResult(key, outcome.status, outcome.data, outcome.message))
            else:  # as BatchGet answers an invalid key
                results.append(GetResult(key, Status.MISSING, message=k))
        return results


def _try_encode(key: common_pb2.ObjectKey) -> bytes | str:
    try:
        return encode_object_key(key)
    except ValueError as exc:
        return f"invalid key: {exc}"


# -- shared memory ---------------------------------------------------------------------------------------------------


def _rpc_error(exc: grpc.aio.AioRpcError) -> str:
    return f"cache service call failed: {exc.code().name}: {exc.details()}"


def _hold_ms(deadline: float) -> int:
    """A reservation's or pin's lifetime: the call's remaining time plus a grace (milliseconds, >= 1)."""
    return max(1, int((deadline - asyncio.get_running_loop().time() + HOLD_GRACE_S) * 1000))


class ShmPlane:
    kind = "shm"

    def __init__(self, stub: cache_pb2_grpc.CacheServiceStub, arena: SharedArena, executor: ThreadPoolExecutor,
                 reread: Callable[[Sequence[common_pb2.ObjectKey], float], Awaitable[list[GetResult]]]):
        self._stub = stub
        self.arena = arena
        self._executor = executor
        self._reread = reread
        self._releases: set[asyncio.Task] = set()
        self._inflight = 0  # calls using the mapping now
        self._retired = False  # unmap once no call uses it

    async def put(self, objects: Sequence[PutObject], algorithm: ChecksumAlgorithm,
                  deadline: float) -> list[KeyResult]:
        self._inflight += 1
        try:
            return await self._put(objects, algorithm, deadline)
        finally:
            self._inflight -= 1
            self._unmap_if_retired()

    async def get(self, keys: Sequence[common_pb2.ObjectKey], deadline: float) -> list[GetResult]:
        self._inflight += 1
        try:
            return await self._get(keys, deadline)
        finally:
            self._inflight -= 1
            self._unmap_if_retired()

    def retire(self) -> None:
        """No new calls: unmaps the arena once no call uses it (background releases need no mapping)."""
        self._retired = True
        self._unmap_if_retired()

    async def close(self) -> None:
        """Waits (bounded) for background releases, then retires."""
        if self._releases:
            await asyncio.wait(self._releases, timeout=RELEASE_TIMEOUT_S)
        self.retire()

    def _unmap_if_retired(self) -> None:
        if self._retired and self._inflight == 0:
            self.arena.close()  # a worker thread still copying for a call past its deadline fails harmlessly

    async def _put(self, objects: Sequence[PutObject], algorithm: ChecksumAlgorithm,
                   deadline: float) -> list[KeyResult]:
        def errors(why: str) -> list[KeyResult]:
            return [KeyResult(o.key, Status.ERROR, why) for o in objects]

        request = cache_pb2.ReserveRequest(ttl_ms=_hold_ms(deadline), objects=[_reserve_object(o) for o in objects])
        reply = await self._call(self._stub.Reserve, request, deadline)
        if isinstance(reply, str):
            return errors(reply)
        self._check_token(reply.arena_token, reply.reservation_id)
        results = [KeyResult(o.key, Status(r.status), r.message) for o, r in zip(objects, reply.results)]
        reserved = [i for i, r in enumerate(reply.results) if r.status == Status.RESERVED]
        if not reserved:
            return results
        checksums = await _in_thread(self._executor, deadline,
                                     lambda c: self._copy_in(objects, reply, reserved, algorithm, c), lambda: None)
        if checksums is None:
            return errors(_DEADLINE)  # the reservation expires on its own, after the copy has stopped
        commit = await self._call(self._stub.Commit, cache_pb2.CommitRequest(
            reservation_id=reply.reservation_id, checksums=[c.to_proto() for c in checksums]), deadline)
        if isinstance(commit, str) or not commit.found:
            why = commit if isinstance(commit, str) else "the reservation expired before Commit; nothing stored"
            for i in reserved:
                results[i] = KeyResult(objects[i].key, Status.ERROR, why)
            return results
        for i, r in zip(reserved, commit.results):
            results[i] = KeyResult(objects[i].key, Status(r.status), r.message)
        return results

    async def _get(self, keys: Sequence[common_pb2.ObjectKey], deadline: float) -> list[GetResult]:
        reply = await self._call(self._stub.Locate, cache_pb2.LocateRequest(keys=keys, pin_ttl_ms=_hold_ms(deadline)),
                                 deadline)
        if isinstance(reply, str):
            return [GetResult(k, Status.ERROR, message=reply) for k in keys]
        try:
            self._check_token(reply.arena_token)
            results = await _in_thread(self._executor, deadline, lambda c: self._copy_out(keys, reply.locations, c),
                                       lambda: [GetResult(k, Status.ERROR, message=_DEADLINE) for k in keys])
        finally:
            if reply.pin_id:
                self._release_later(reply.pin_id)
        mismatched = [i for i, r in enumerate(results) if r is None]
        if mismatched:  # the service verifies these itself: CORRUPT (counted, removed), or a good newer copy
            for i, r in zip(mismatched, await self._reread([keys[i] for i in mismatched], deadline)):
                results[i] = r
        return results

    async def _call(self, method, request, deadline: float):
        """The RPC's reply, or why it failed (a per-key ERROR message). Raises DirectUnavailable when the service no
        longer serves this plane."""
        remaining = deadline - asyncio.get_running_loop().time()
        try:
            return await method(request, timeout=max(remaining, 0.0))
        except grpc.aio.AioRpcError as exc:
            if exc.code() in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNIMPLEMENTED):
                raise DirectUnavailable(_rpc_error(exc), rediscover=True) from exc
            return _rpc_error(exc)

    def _check_token(self, token: bytes, reservation_id: str = "") -> None:
        if token != self.arena.token:
            if reservation_id:
                self._release_later(reservation_id)
            raise DirectUnavailable("the service's arena changed (restarted?)", rediscover=True)

    def _copy_in(self, objects: Sequence[PutObject], reply: cache_pb2.ReserveResponse, reserved: list[int],
                 algorithm: ChecksumAlgorithm, cancelled: _Cancelled) -> list[Checksum] | None:
        """(worker thread) Writes the reserved payloads into the arena -> the checksum of each copy (None when the
        call's deadline passed)."""
        checksums = []
        for i in reserved:
            if cancelled.set:
                return None
            offset, data = reply.results[i].offset, objects[i].data
            if offset < self.arena.data_offset or offset + len(data) > self.arena.size:
                raise DirectUnavailable(f"the service reserved bytes outside the arena ({offset})", rediscover=True)
            self.arena.write(offset, data)
            with self.arena.view(offset, len(data)) as copy:  # still in cache: hashing it is nearly free
                checksums.append(Checksum.of(copy, algorithm))
        return checksums

    def _copy_out(self, keys: Sequence[common_pb2.ObjectKey], locations, cancelled: _Cancelled) -> list:
        """(worker thread) Per key a GetResult, or None for a copy that failed its checksum."""
        results: list[GetResult | None] = []
        for key, loc in zip(keys, locations):
            if loc.status != Status.FOUND:
                results.append(GetResult(key, Status(loc.status), message=loc.message))
            elif cancelled.set:
                results.append(GetResult(key, Status.ERROR, message=_DEADLINE))
            elif loc.offset < self.arena.data_offset or loc.offset + loc.size_bytes > self.arena.size:
                results.append(GetResult(key, Status.ERROR, message="the service located bytes outside the arena"))
            else:
                results.append(_verified(key, loc, self.arena.read(loc.offset, loc.size_bytes)))
        return results

    def _release_later(self, hold_id: str) -> None:
        """Ends a pin or reservation in the background (it would expire anyway)."""
        task = asyncio.ensure_future(self._release(hold_id))
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    async def _release(self, hold_id: str) -> None:
        try:
            await self._stub.Release(cache_pb2.ReleaseRequest(lease_id=hold_id), timeout=RELEASE_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            log.debug("Release of %s failed (it expires on its own): %s", hold_id, _rpc_error(exc))


def _reserve_object(obj: PutObject) -> cache_pb2.ReserveObject:
    msg = cache_pb2.ReserveObject(key=obj.key, size_bytes=len(obj.data))
    if obj.ttl_s is not None:
        msg.ttl_ms = ttl_ms(obj.ttl_s)
    return msg


def _verified(key: common_pb2.ObjectKey, loc: cache_pb2.Location, data: bytes) -> GetResult | None:
    try:
        checksum = Checksum.from_proto(loc.checksum)
    except ValueError as exc:
        return GetResult(key, Status.ERROR, message=f"unusable checksum from the service: {exc}")
    return GetResult(key, Status.FOUND, data) if checksum.matches(data) else None


# -- choosing a plane ------------------------------------------------------------------------------------------------


class DataPlanes:
    """Discovers the service's data plane once and hands out the plane to use (see the module docstring)."""

    def __init__(self, stub: cache_pb2_grpc.CacheServiceStub, mode: str, timeout_s: float,
                 reread: Callable[[Sequence[common_pb2.ObjectKey], float], Awaitable[list[GetResult]]],
                 retry_after_s: float = 5.0, threads: int = 4):
        if mode not in ("auto", "grpc"):
            raise ValueError(f"data_plane must be 'auto' or 'grpc', got {mode!r}")
        self._stub = stub
        self._timeout_s = timeout_s
        self._reread = reread
        self._retry_after_s = retry_after_s
        self._threads = threads
        self._plane: RedisPlane | ShmPlane | None = None
        self._settled = mode == "grpc"  # True once the answer is known (a plane, or None: gRPC)
        self._retry_at = 0.0  # loop time before which a failed plane is not tried again
        self._lock = asyncio.Lock()
        self._executor: ThreadPoolExecutor | None = None
        self._logged: set[str] = set()

    @property
    def kind(self) -> str:
        """The plane in use: redis, shm or grpc; unknown before the first call."""
        return self._plane.kind if self._plane is not None else "grpc" if self._settled else "unknown"

    async def plane(self, deadline: float) -> RedisPlane | ShmPlane | None:
        if not self._settled:
            async with self._lock:
                if not self._settled:
                    await self._discover(deadline)
        if self._plane is None or asyncio.get_running_loop().time() < self._retry_at:
            return None
        return self._plane

    def failed(self, plane: RedisPlane | ShmPlane, exc: DirectUnavailable) -> None:
        """A plane call raised DirectUnavailable: cool down, or forget the plane and ask DataPlane again."""
        self._log_once(f"{plane.kind} failed", "%s data plane unusable, using gRPC: %s", plane.kind, exc)
        if exc.rediscover and self._plane is plane:
            self._plane, self._settled = None, False
            plane.retire()
        else:
            self._retry_at = asyncio.get_running_loop().time() + self._retry_after_s

    async def close(self) -> None:
        if self._plane is not None:
            await self._plane.close()
            self._plane = None
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)

    async def _discover(self, deadline: float) -> None:
        remaining = deadline - asyncio.get_running_loop().time()
        if remaining <= 0:
            return
        try:
            answer = await self._stub.DataPlane(cache_pb2.DataPlaneRequest(), timeout=remaining)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                self._settle(None, "the service predates DataPlane")
            return  # unreachable now: the gRPC call reports it; ask again next call
        policy = ServicePolicy(answer.max_object_bytes, answer.handoff_ttl_ms / 1000)
        which = answer.WhichOneof("plane")
        if which == "redis":
            self._settle(RedisPlane(answer.redis, policy, self._timeout_s, self._pool()), "")
        elif which == "shm":
            self._settle(self._map_arena(answer.shm), "")
        else:
            self._settle(None, answer.grpc.reason or "the service offers no direct data plane")

    def _map_arena(self, info: cache_pb2.ShmDataPlane) -> ShmPlane | None:
        try:
            arena = SharedArena.attach(info.path, info.size_bytes, info.token, info.token_offset)
        except (ArenaMismatch, OSError, ValueError) as exc:
            # expected when the service runs on another host or in another container: INFO, not WARNING
            self._log_once("shm attach", "cannot map the cache service's arena, using gRPC: %s", exc,
                           level=logging.INFO)
            return None
        return ShmPlane(self._stub, arena, self._pool(), self._reread)

    def _settle(self, plane: RedisPlane | ShmPlane | None, why_none: str) -> None:
        self._plane, self._settled = plane, True
        if plane is None and why_none:
            log.debug("cache payloads over gRPC: %s", why_none)

    def _pool(self) -> ThreadPoolExecutor:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=self._threads, thread_name_prefix="cache-direct")
        return self._executor

    def _log_once(self, topic: str, message: str, *args, level: int = logging.WARNING) -> None:
        """Logs at `level` the first time per topic, at DEBUG afterwards."""
        log.log(logging.DEBUG if topic in self._logged else level, message, *args)
        self._logged.add(topic)

