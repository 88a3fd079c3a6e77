"""Timed transfers to and from the cache service, for the byte and second counters both roles keep.

Contract: `timed_get(cache, keys, span)` -> (the `BatchGet` results, payload bytes received, wall seconds of the
call) and records the bytes on `span`; `timed_put(cache, objects)` -> (the `BatchPut` results, payload bytes
sent, wall seconds). Neither raises for a missing or refused object: statuses are per key, as the client gives them.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from opentelemetry.trace import Span

from cache_service.client import CacheClient, GetResult, KeyResult, PutObject
from protos import common_pb2
from telemetry import tracing


async def timed_get(cache: CacheClient, keys: Sequence[common_pb2.ObjectKey],
                    span: Span) -> tuple[list[GetResult], int, float]:
    started = time.perf_counter()
    got = await cache.get_objects(keys)
    seconds = time.perf_counter() - started
    nbytes = sum(len(r.data) for r in got if r.data is not None)
    span.set_attribute(tracing.BYTES, nbytes)
    return got, nbytes, seconds


async def timed_put(cache: CacheClient, objects: Sequence[PutObject]) -> tuple[list[KeyResult], int, float]:
    started = time.perf_counter()
    results = await cache.put_objects(objects)
    return results, sum(len(o.data) for o in objects), time.perf_counter() - started
