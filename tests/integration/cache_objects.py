"""What the cache-service integration tests share: object kinds, a test fingerprint and salt, key naming, a bounded
event loop runner, and the statuses of a batch result."""

from __future__ import annotations

import asyncio

from cache_service.objects import Status, object_key
from protos import common_pb2

KV, SNAPSHOT, HANDOFF = (common_pb2.OBJECT_KIND_KV_BLOCK, common_pb2.OBJECT_KIND_STATE_SNAPSHOT,
                         common_pb2.OBJECT_KIND_HANDOFF)
FP, SALT = b"model-fingerprint", b"tenant-a"
MIB = 1 << 20
PREFIX = b"kdamesh:"


def key(name: str, kind: int = KV, salt: bytes = SALT) -> common_pb2.ObjectKey:
    return object_key(FP, salt, kind, name.encode())


def run(coro, timeout_s: float = 30):
    """Runs a test body on a fresh event loop; a hang fails the test instead of the suite."""
    return asyncio.run(asyncio.wait_for(coro, timeout_s))


def statuses(results) -> list[Status]:
    return [r.status for r in results]
