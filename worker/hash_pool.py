"""Per-part hashing and (de)serialisation of handoffs on a few threads, so no single thread hashes a whole handoff.

Contract:
- `parallel_map(fn, items, threads=None)` is engine/background.py's `parallel_map` (the calling thread and
  lowest-priority helpers claim the items in order; `threads=1` runs in the calling thread; the lowest-indexed
  failing item's exception propagates) with `HASH_THREADS` as the default, so the parts of a handoff (each
  serialised object carries its own checksum, engine/transfer.py) are hashed on up to `threads` cores at once.
  `HASH_THREADS` (engine/background.py's `PARALLEL_THREADS` unless changed: bench/bench_handoff.py sets it) governs
  these per-part maps only; the chunks of one large object hash at engine/transfer.py's default (a map inside a
  map runs in its calling thread). Call it from a worker thread (`asyncio.to_thread`), never from the event loop.
- `sha256_hex(data)`; `digests(parts, threads=None)` -> each part's sha256 (hex), in parallel.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import TypeVar

from engine import background

T = TypeVar("T")
R = TypeVar("R")

HASH_THREADS = background.PARALLEL_THREADS


def parallel_map(fn: Callable[[T], R], items: Sequence[T], threads: int | None = None) -> list[R]:
    return background.parallel_map(fn, items, HASH_THREADS if threads is None else threads)


def sha256_hex(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


def digests(parts: Sequence[bytes], threads: int | None = None) -> list[str]:
    return parallel_map(sha256_hex, parts, threads)
