"""Per-part hashing and (de)serialisation of handoffs on a few threads, so no single thread hashes a whole handoff.

Contract:
- `parallel_map(fn, items, threads=None)` -> `[fn(x) for x in items]`, in order, computed on a pool of
  `threads` background threads (default `HASH_THREADS`; engine/background.py: lowest CPU priority, so a worker's
  step thread and event loop keep their cores); `threads=1` runs in the calling thread. The first exception
  raised by `fn` propagates. hashlib releases the GIL while it hashes a buffer over 2 KiB, and torch's copies
  release it too, so the parts of a handoff (each serialised object carries its own sha256, engine/transfer.py)
  are hashed on up to `threads` cores at once. Call it from a worker thread (`asyncio.to_thread`), never from the
  event loop.
- `sha256_hex(data)`; `digests(parts, threads=None)` -> each part's sha256 (hex), in parallel.
- One pool per thread count and process, made on first use and kept.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import os
import threading
from collections.abc import Callable, Sequence
from typing import TypeVar

from engine.background import background_executor

T = TypeVar("T")
R = TypeVar("R")

HASH_THREADS = max(1, min(4, os.cpu_count() or 1))
_pools: dict[int, concurrent.futures.ThreadPoolExecutor] = {}
_lock = threading.Lock()


def _pool(threads: int) -> concurrent.futures.ThreadPoolExecutor:
    with _lock:
        if threads not in _pools:
            _pools[threads] = background_executor(threads, f"kdamesh-hash{threads}")
        return _pools[threads]


def parallel_map(fn: Callable[[T], R], items: Sequence[T], threads: int | None = None) -> list[R]:
    threads = HASH_THREADS if threads is None else threads
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    if threads == 1 or len(items) < 2:
        return [fn(x) for x in items]
    return list(_pool(threads).map(fn, items))


def sha256_hex(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


def digests(parts: Sequence[bytes], threads: int | None = None) -> list[str]:
    return parallel_map(sha256_hex, parts, threads)
