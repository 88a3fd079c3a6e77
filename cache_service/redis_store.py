"""The Redis store: objects in a real Redis server (`redis://host:port/db`) or a Redis Cluster
(`redis+cluster://host:port,host:port`), pipelined, chunked, checksummed.

The layout of objects, leases and counters in Redis is `redis_layout`'s (with hash tags on a cluster, so an object's
chunks, manifest and pins share a slot); a cluster is reached per node by `redis_cluster.ClusterClient`, one pipeline
per node per round trip. Everything below holds on a cluster too; there a node that is down answers ERROR for its own
keys only (a put's or a get's other keys succeed), and counts whose node is down wait here like those of a Redis
that is down.

Contract (in addition to `store.Store`'s):
- Atomic visibility: an object without a TTL is one MSET of its chunks and manifest (they appear together); one
  with a TTL is SET PX of each chunk, then of the manifest, in one pipeline on one connection, which Redis applies
  in order. Either way a reader that sees a manifest sees its chunks. A manifest whose chunk is gone (evicted, expired,
  flushed) is a miss and is deleted.
- TTLs are Redis expiries (SET PX) on the manifest and the chunks; a lease extends them to at least its own end.
  Redis, not this store, evicts under `maxmemory` (leases cannot stop that: use `volatile-*` policies or no limit).
- A restarted or flushed Redis loses objects: they are misses. A Redis that is down or stalled answers ERROR for
  every key (a get: counted as misses) within the operation's deadline (`redis_deadlines`): `op_timeout_s`
  (default: the read timeout) plus at most one read timeout, i.e. <= 4 s with the defaults (connect 0.5 s, read
  2 s; one immediate retry for a stale connection, none after a timeout). After a timeout the store answers at
  once, without asking Redis, for `backoff_s` (default 5 s: long enough to cover the rest of a request, prefill and
  a fallback decode alike; `gate.stalled`); a refused connection costs no wait.
- Checksums are verified on every read; a mismatch is CORRUPT, counted, and the object is deleted. Puts verify them
  too, unless built with `verify_puts=False` by a caller that computed every checksum itself from the very bytes it
  passes (the direct data plane client: one checksum pass instead of two).
- Counters: a put queues its HINCRBY in the same pipeline as its data (corrected afterwards only when a command
  failed); a get, whose counts are known only after its reads, sends them with its deletions of corrupt objects in
  one last small pipeline. Counts that cannot reach Redis (it is down) wait in this process and go with its next
  pipeline, so `stats` is exact once Redis is back (approximate only around a connection cut mid-pipeline, which
  Redis may or may not have applied).
- `raise_when_unavailable=True` (the direct data plane client): `put_many` / `get_many` raise StoreUnavailableError
  instead of answering ERROR per key when Redis cannot be reached (nothing is counted), so the caller can retry
  over gRPC; not when it timed out (`gate.stalled`): the service's own path to it is stuck too, so a retry over
  gRPC would only wait again. A put that failed mid-pipeline may have stored some objects whole; none is visible
  half-written.
- `stats` scans the prefix (O(objects)) and reads the counter hash. Leases' deadlines use `clock` (Unix seconds,
  this host's wall clock by default; injectable): Redis's own expiries run on Redis's clock.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence

import redis

from cache_service.objects import Status
from cache_service.redis_cluster import ClusterClient, is_cluster_url
from cache_service.redis_deadlines import RedisGate, gated_redis
from cache_service.redis_layout import (COUNTED, DEFAULT_INLINE_BYTES, HEADER, MAX_HEADER_BYTES, CorruptManifest,
                                        Manifest, RedisKeys, decode_manifest, encode_manifest, stored_size)
from cache_service.store import (GetOutcome, KeyOutcome, LeaseGrant, LookupOutcome, PutItem, Store, StoreCounters,
                                 StoreStats, StoreUnavailableError, prefix_length)

_REDIS_ERRORS = (redis.RedisError, OSError)

log = logging.getLogger(__name__)


def _operation(method: Callable) -> Callable:
    """`method` as one store operation: its round trips share one deadline (`RedisGate.operation`)."""
    @functools.wraps(method)
    def run(self, *args, **kwargs):
        with self.gate.operation():
            return method(self, *args, **kwargs)

    return run


class RedisStore(Store):
    backend = "redis"

    def __init__(self, url: str, chunk_bytes: int = 1 << 20, key_prefix: bytes = b"kdamesh:",
                 socket_timeout_s: float = 2.0, connect_timeout_s: float = 0.5, max_connections: int = 64,
                 socket_read_bytes: int = 1 << 20, inline_bytes: int = DEFAULT_INLINE_BYTES,
                 verify_puts: bool = True, raise_when_unavailable: bool = False,
                 clock: Callable[[], float] = time.time, op_timeout_s: float | None = None, backoff_s: float = 5.0):
        if chunk_bytes <= 0 or inline_bytes < 0:
            raise ValueError(f"need chunk_bytes > 0 and inline_bytes >= 0, got {chunk_bytes}, {inline_bytes}")
        self.url = url
        self.chunk_bytes = chunk_bytes
        self.inline_bytes = inline_bytes
        self.key_prefix = key_prefix
        self.socket_timeout_s = socket_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.cluster = is_cluster_url(url)
        self._keys = RedisKeys(key_prefix, tagged=self.cluster)
        self._clock = clock  # Unix seconds: lease deadlines
        self._verify_puts = verify_puts
        self._raise_when_unavailable = raise_when_unavailable
        self.gate = RedisGate(op_timeout_s or socket_timeout_s, backoff_s)
        connect = ClusterClient if self.cluster else gated_redis
        self._redis = connect(  # large reads: payloads are MiBs, redis-py's default is 32 KiB
            url, self.gate, socket_timeout_s=socket_timeout_s, connect_timeout_s=connect_timeout_s,
            max_connections=max_connections, socket_read_bytes=socket_read_bytes)
        self._lock = threading.Lock()
        self._pending = dict.fromkeys(COUNTED, 0)  # counts not yet in {prefix}stats (under _lock)

    # -- Store API ----------------------------------------------------------------------------------------------

    @_operation
    def put_many(self, items: Sequence[PutItem]) -> list[KeyOutcome]:
        outcomes: list[KeyOutcome] = [KeyOutcome(Status.CORRUPT, "checksum mismatch on arrival")] * len(items)
        pipe = self._redis.pipeline(transaction=False)
        spans: list[tuple[int, int]] = []  # (item index, number of commands queued for it)
        for i, item in enumerate(items):
            if not self._verify_puts or item.checksum.matches(item.data):
                spans.append((i, self._queue_put(pipe, item)))
        if not spans:
            return outcomes
        replies, failure = self._execute_counted(pipe, {"puts": len(spans)})  # counted as stored; corrected below
        if failure and self._raise_when_unavailable and not self.gate.stalled:
            raise StoreUnavailableError(failure)
        pos = 0
        for i, n in spans:
            outcomes[i] = KeyOutcome(Status.ERROR, failure) if failure else _put_outcome(replies[pos:pos + n])
            pos += n
        failed = sum(1 for i, _ in spans if outcomes[i].status == Status.ERROR)
        if failed:
            self._count(puts=0 if failure else -failed, errors=failed)
            if not failure:
                self._flush_counters()
        return outcomes

    @_operation
    def get_many(self, keys: Sequence[bytes]) -> list[GetOutcome]:
        try:
            return self._get_many(keys)
        except _REDIS_ERRORS as exc:
            if self._raise_when_unavailable and not self.gate.stalled:
                raise StoreUnavailableError(_describe(exc)) from exc
            self._count(misses=len(keys), errors=len(keys))
            return [GetOutcome(Status.ERROR, message=_describe(exc))] * len(keys)

    @_operation
    def lookup(self, keys: Sequence[bytes], include_presence: bool = False) -> LookupOutcome:
        try:
            pipe = self._redis.pipeline(transaction=False)
            for key in keys:
                pipe.exists(self._keys.manifest(key))
            present = [bool(n) for n in pipe.execute()]
        except _REDIS_ERRORS as exc:
            self._count(errors=len(keys))
            raise StoreUnavailableError(_describe(exc)) from exc
        return LookupOutcome(prefix_length(present), present if include_presence else [])

    @_operation
    def lease(self, keys: Sequence[bytes], ttl_s: float) -> LeaseGrant:
        try:
            return self._lease(keys, ttl_s)
        except _REDIS_ERRORS as exc:
            self._count(errors=len(keys))
            return LeaseGrant("", [KeyOutcome(Status.ERROR, _describe(exc))] * len(keys), ttl_s)

    @_operation
    def release(self, lease_id: str) -> tuple[bool, int]:
        try:
            members = self._redis.smembers(self._keys.lease(lease_id))
            if not members:
                return False, 0
            pipe = self._redis.pipeline(transaction=False)
            for key in members:
                pipe.zrem(self._keys.pins(key), lease_id)
            pipe.delete(self._keys.lease(lease_id))
            pipe.execute()
            return True, len(members)
        except _REDIS_ERRORS as exc:
            self._count(errors=1)
            raise StoreUnavailableError(_describe(exc)) from exc

    @_operation
    def remove(self, keys: Sequence[bytes], force: bool = False) -> list[KeyOutcome]:
        try:
            outcomes = self._remove(keys, force)
        except _REDIS_ERRORS as exc:
            self._count(errors=len(keys))
            return [KeyOutcome(Status.ERROR, _describe(exc))] * len(keys)
        self._count(removes=sum(1 for o in outcomes if o.status == Status.REMOVED))
        self._flush_counters()
        return outcomes

    @_operation
    def stats(self) -> StoreStats:
        try:
            self._flush_counters(raise_on_failure=True)
            objects, stored = self._scan_objects()
            leases = sum(1 for _ in self._redis.scan_iter(match=self._keys.pattern(b"l:"), count=1000))
            leased = self._count_leased()
            evicted = int(self._redis.info("stats").get("evicted_keys", 0))
            counted = self._redis.hgetall(self._keys.stats)
        except _REDIS_ERRORS as exc:
            raise StoreUnavailableError(f"redis at {self.url}: {_describe(exc)}") from exc
        counters = StoreCounters(**{name: int(counted.get(name.encode(), 0)) for name in COUNTED})
        counters.evictions = evicted
        return StoreStats(self.backend, objects, stored, 0, leased, leases, counters)

    def expire(self) -> int:
        return 0  # Redis expires keys itself

    def close(self) -> None:
        self._redis.close()  # and its connection pool(s)

    # -- put ----------------------------------------------------------------------------------------------------

    def _queue_put(self, pipe: redis.client.Pipeline, item: PutItem) -> int:
        """Queues the object's commands (chunks before the manifest); returns how many were queued."""
        px = None if item.ttl_s is None else max(1, int(item.ttl_s * 1000))
        size, step = len(item.data), self.chunk_bytes
        if size <= self.inline_bytes:
            pipe.set(self._keys.manifest(item.key), encode_manifest(item.checksum, size, 0, item.data), px=px)
            return 1
        num_chunks = -(-size // step)
        view = memoryview(item.data)  # slices share the payload's memory: sent as they are, no copy
        chunks = {self._keys.chunk(item.key, item.checksum, i): view[i * step:(i + 1) * step]
                  for i in range(num_chunks)}
        manifest = encode_manifest(item.checksum, size, num_chunks, b"")
        if px is None:  # one MSET: chunks and manifest appear together (and one command, one reply per object)
            pipe.mset({**chunks, self._keys.manifest(item.key): manifest})
            return 1
        for name, chunk in chunks.items():  # with a TTL: SET PX each, the manifest last
            pipe.set(name, chunk, px=px)
        pipe.set(self._keys.manifest(item.key), manifest, px=px)
        return num_chunks + 1

    # -- get ----------------------------------------------------------------------------------------------------

    def _get_many(self, keys: Sequence[bytes]) -> list[GetOutcome]:
        pipe = self._redis.pipeline(transaction=False)
        for key in keys:
            pipe.get(self._keys.manifest(key))
        manifests: list = [self._parse(raw) for raw in pipe.execute(raise_on_error=False)]
        chunks = self._fetch_chunks(keys, manifests)
        outcomes = [self._assemble(key, m, chunks.get(i)) for i, (key, m) in enumerate(zip(keys, manifests))]
        pipe = self._redis.pipeline(transaction=False)
        self._queue_deletions(pipe, keys, manifests, outcomes)
        found = sum(1 for o in outcomes if o.status == Status.FOUND)
        counts = {"hits": found, "misses": len(keys) - found,
                  "corrupt_reads": sum(1 for o in outcomes if o.status == Status.CORRUPT),
                  "errors": sum(1 for o in outcomes if o.status == Status.ERROR)}
        _, failure = self._execute_counted(pipe, counts)
        if failure:  # the reads stand; a later read deletes the bad objects; the counts wait here
            log.warning("could not delete corrupt or incomplete objects: %s", failure)
            self._count(**counts)
        return outcomes

    @staticmethod
    def _parse(raw: bytes | None | Exception) -> Manifest | None | str | Exception:
        """The manifest, None when absent, the reason it is corrupt, or the error of its read (a cluster node)."""
        if raw is None or isinstance(raw, Exception):
            return raw
        try:
            return decode_manifest(raw)
        except CorruptManifest as exc:
            return str(exc)

    def _fetch_chunks(self, keys: Sequence[bytes], manifests: list) -> dict[int, list]:
        wanted = [(i, self._keys.chunks(keys[i], m)) for i, m in enumerate(manifests)
                  if isinstance(m, Manifest) and m.num_chunks]
        if not wanted:
            return {}
        pipe = self._redis.pipeline(transaction=False)
        for _, chunk_keys in wanted:
            for chunk_key in chunk_keys:
                pipe.get(chunk_key)
        replies = iter(pipe.execute(raise_on_error=False))
        return {i: [next(replies) for _ in chunk_keys] for i, chunk_keys in wanted}

    @staticmethod
    def _assemble(key: bytes, manifest, parts: list | None) -> GetOutcome:
        failed = [p for p in [manifest, *(parts or ())] if isinstance(p, Exception)]
        if failed:  # a node that holds this object failed: an error, never a deletion
            return GetOutcome(Status.ERROR, message=_describe(failed[0]))
        if manifest is None:
            return GetOutcome(Status.MISSING)
        if isinstance(manifest, str):
            return GetOutcome(Status.CORRUPT, message=f"corrupt manifest: {manifest}; removed")
        if parts is not None and any(p is None for p in parts):
            return GetOutcome(Status.MISSING, message="a chunk was lost (evicted, expired or flushed)")
        data = manifest.inline if parts is None else parts[0] if len(parts) == 1 else b"".join(parts)
        if len(data) != manifest.size or not manifest.checksum.matches(data):
            return GetOutcome(Status.CORRUPT, message="stored object failed its checksum; removed")
        return GetOutcome(Status.FOUND, data, manifest.checksum)

    def _queue_deletions(self, pipe: redis.client.Pipeline, keys: Sequence[bytes], manifests: list,
                         outcomes: list[GetOutcome]) -> None:
        """Queues deletion of corrupt objects and of manifests whose chunks are gone, so they stop answering
        lookups."""
        for i, (m, o) in enumerate(zip(manifests, outcomes)):
            if o.status == Status.CORRUPT or (o.status == Status.MISSING and m is not None):
                chunk_keys = self._keys.chunks(keys[i], m) if isinstance(m, Manifest) else []
                pipe.delete(self._keys.manifest(keys[i]), *chunk_keys)

    # -- lease / remove -----------------------------------------------------------------------------------------

    def _headers(self, keys: Sequence[bytes], with_pttl: bool) -> list[tuple[Manifest | None, int]]:
        """Per key: (manifest header or None when absent/corrupt, manifest PTTL in ms or -1)."""
        pipe = self._redis.pipeline(transaction=False)
        for key in keys:
            pipe.getrange(self._keys.manifest(key), 0, MAX_HEADER_BYTES - 1)
            if with_pttl:
                pipe.pttl(self._keys.manifest(key))
        replies = pipe.execute()
        step = 2 if with_pttl else 1
        out = []
        for j in range(len(keys)):
            raw, pttl = replies[j * step], (replies[j * step + 1] if with_pttl else -1)
            try:
                out.append((decode_manifest(raw, header_only=True) if raw else None, pttl))
            except CorruptManifest:
                out.append((None, pttl))
        return out

    def _lease(self, keys: Sequence[bytes], ttl_s: float) -> LeaseGrant:
        headers = self._headers(keys, with_pttl=True)
        found = [h is not None for h, _ in headers]
        if not any(found):
            return LeaseGrant("", [KeyOutcome(Status.MISSING)] * len(keys), ttl_s)
        lease_id, ttl_ms = uuid.uuid4().hex, max(1, int(ttl_s * 1000))
        deadline_ms = int(self._clock() * 1000) + ttl_ms
        pipe = self._redis.pipeline(transaction=False)
        for key, (manifest, pttl) in zip(keys, headers):
            if manifest is None:
                continue
            pipe.zadd(self._keys.pins(key), {lease_id: deadline_ms})
            pipe.pexpire(self._keys.pins(key), ttl_ms, gt=True)  # extends a volatile pin set ...
            pipe.pexpire(self._keys.pins(key), ttl_ms, nx=True)  # ... or bounds a new one
            if 0 <= pttl < ttl_ms:  # a TTL'd object must outlive the lease
                for name in [self._keys.manifest(key), *self._keys.chunks(key, manifest)]:
                    pipe.pexpire(name, ttl_ms)
        pipe.sadd(self._keys.lease(lease_id), *[k for k, ok in zip(keys, found) if ok])
        pipe.pexpire(self._keys.lease(lease_id), ttl_ms)
        pipe.execute()
        return LeaseGrant(lease_id, [KeyOutcome(Status.FOUND if ok else Status.MISSING) for ok in found], ttl_s)

    def _remove(self, keys: Sequence[bytes], force: bool) -> list[KeyOutcome]:
        headers = self._headers(keys, with_pttl=False)
        pinned = self._pinned(keys) if not force else [False] * len(keys)
        pipe = self._redis.pipeline(transaction=False)
        queued = []
        for i, (key, (manifest, _)) in enumerate(zip(keys, headers)):
            if pinned[i]:
                continue
            chunk_keys = self._keys.chunks(key, manifest) if manifest is not None else []
            pipe.delete(self._keys.manifest(key), *chunk_keys)
            queued.append(i)
        deleted = dict(zip(queued, pipe.execute() if queued else []))
        return [KeyOutcome(Status.LEASED, "object is leased; pass force to remove it") if pinned[i]
                else KeyOutcome(Status.REMOVED) if deleted.get(i) else KeyOutcome(Status.MISSING)
                for i in range(len(keys))]

    def _pinned(self, keys: Sequence[bytes]) -> list[bool]:
        now_ms = int(self._clock() * 1000)
        pipe = self._redis.pipeline(transaction=False)
        for key in keys:
            pipe.zcount(self._keys.pins(key), f"({now_ms}", "+inf")
        return [n > 0 for n in pipe.execute()]

    # -- stats --------------------------------------------------------------------------------------------------

    def _scan_objects(self) -> tuple[int, int]:
        objects = stored = 0
        names = list(self._redis.scan_iter(match=self._keys.pattern(b"o:"), count=1000))
        for start in range(0, len(names), 1000):
            pipe = self._redis.pipeline(transaction=False)
            for name in names[start:start + 1000]:
                pipe.getrange(name, 0, HEADER.size - 1)
            for size in map(stored_size, pipe.execute()):
                if size is not None:
                    objects += 1
                    stored += size
        return objects, stored

    def _count_leased(self) -> int:
        names = list(self._redis.scan_iter(match=self._keys.pattern(b"p:"), count=1000))
        if not names:
            return 0
        keys = [self._keys.store_key_of_pins(name) for name in names]
        return sum(self._pinned(keys))

    # -- counters (in {prefix}stats) -----------------------------------------------------------------------------

    def _count(self, **deltas: int) -> None:
        """Adds to the counts waiting for the next pipeline."""
        with self._lock:
            for name, delta in deltas.items():
                self._pending[name] += delta

    def _take_pending(self) -> dict[str, int]:
        with self._lock:
            taken, self._pending = self._pending, dict.fromkeys(COUNTED, 0)
        return taken

    def _execute_counted(self, pipe: redis.client.Pipeline, deltas: dict[str, int]) -> tuple[list, str]:
        """Runs `pipe` with HINCRBYs of the waiting counts plus `deltas` queued after its own commands -> (the replies
        to its own commands, errors as values; "") or ([], why) when Redis cannot be reached. On failure the waiting
        counts wait on; `deltas` are dropped (the caller counts what happened instead)."""
        own = len(pipe)
        taken = self._take_pending()
        for name in COUNTED:
            delta = taken[name] + deltas.get(name, 0)
            if delta:
                pipe.hincrby(self._keys.stats, name, delta)
        if not len(pipe):
            return [], ""
        try:
            replies = pipe.execute(raise_on_error=False)
        except _REDIS_ERRORS as exc:
            self._count(**taken)
            return [], _describe(exc)
        if any(isinstance(r, Exception) for r in replies[own:]):  # the counter hash's node failed (a cluster)
            self._count(**{name: taken[name] + deltas.get(name, 0) for name in COUNTED})
        return replies[:own], ""

    def _flush_counters(self, raise_on_failure: bool = False) -> None:
        """Sends the waiting counts (a no-op when none wait)."""
        _, failure = self._execute_counted(self._redis.pipeline(transaction=False), {})
        if failure and raise_on_failure:
            raise redis.ConnectionError(failure)


def _put_outcome(replies: list) -> KeyOutcome:
    failed = [r for r in replies if r is not True]
    return KeyOutcome(Status.STORED) if not failed else KeyOutcome(Status.ERROR, f"redis replied {failed[0]!r}")


def _describe(exc: BaseException) -> str:
    return f"redis unavailable: {type(exc).__name__}: {exc}"
