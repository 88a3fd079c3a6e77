"""Threads for the heavy work that must not compete with a worker's step thread or its event loop.

Contract:
- `background_executor(threads, name)` is a `ThreadPoolExecutor` whose threads run at the lowest CPU priority
  (nice 19; on Linux a thread's own, and the threads it starts — xgrammar's compile workers, Pillow's, torch's —
  inherit it), so the step thread and the event loop get a core whenever they want one. What runs there (Pillow
  decoding and resizing, numpy, the vision encoder in torch, xgrammar's compiler) releases the GIL for its long
  parts. Where the priority cannot be lowered (another OS) the threads run at normal priority, logged once.
- `parallel_map(fn, items, threads=None)` -> `[fn(x) for x in items]`, in order, on up to `threads` threads at once
  (default `PARALLEL_THREADS`): the calling thread and `threads - 1` helpers of a shared lowest-priority pool (one
  per helper count and process, made on first use and kept) claim the items one at a time, in order. The caller
  works too, so a map is never slower than one thread even when the helpers get no core (a step thread that
  hashes a snapshot never waits on starved nice-19 threads). `threads=1`, a single item, or a call from one of the
  pools' own threads (a map inside a map: the outer one already keeps them busy) runs in the calling thread. When
  `fn` raises, no further item is started and the exception of the lowest-indexed failing item propagates once the
  items under way have ended. Meant for work that releases the GIL (hashlib on buffers over 2 KiB, torch's copies);
  call it from a worker thread (`asyncio.to_thread`), never from an event loop.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import threading
from collections.abc import Callable, Sequence
from typing import TypeVar

logger = logging.getLogger(__name__)

LOWEST_PRIORITY = 19
PARALLEL_THREADS = max(1, min(4, os.cpu_count() or 1))
_warned = threading.Event()
_helper_pools: dict[int, concurrent.futures.ThreadPoolExecutor] = {}
_pools_lock = threading.Lock()
_this_thread = threading.local()  # `.is_helper`: this thread is one of parallel_map's helpers

T = TypeVar("T")
R = TypeVar("R")


def lower_priority() -> None:
    """This thread (and the threads it starts from now on) at the lowest CPU priority."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), LOWEST_PRIORITY)
    except (AttributeError, OSError) as exc:
        if not _warned.is_set():
            _warned.set()
            logger.warning("background threads run at normal CPU priority: %s", exc)


def background_executor(threads: int, name: str) -> concurrent.futures.ThreadPoolExecutor:
    return concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix=name, initializer=lower_priority)


def parallel_map(fn: Callable[[T], R], items: Sequence[T], threads: int | None = None) -> list[R]:
    threads = PARALLEL_THREADS if threads is None else threads
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    if threads == 1 or len(items) < 2 or getattr(_this_thread, "is_helper", False):
        return [fn(x) for x in items]
    helpers = min(threads, len(items)) - 1
    return _SharedMap(fn, items).run(_helper_pool(helpers), helpers)


def _become_helper() -> None:
    lower_priority()
    _this_thread.is_helper = True


def _helper_pool(count: int) -> concurrent.futures.ThreadPoolExecutor:
    with _pools_lock:
        if count not in _helper_pools:
            _helper_pools[count] = concurrent.futures.ThreadPoolExecutor(
                count, thread_name_prefix=f"kdamesh-map{count}", initializer=_become_helper)
        return _helper_pools[count]


class _SharedMap:
    """One `parallel_map`: its items, claimed in order by whichever of its threads asks next."""

    def __init__(self, fn: Callable[[T], R], items: Sequence[T]):
        self.fn, self.items = fn, items
        self.results: list = [None] * len(items)
        self.errors: dict[int, BaseException] = {}
        self._next = self._busy = 0
        self._lock = threading.Lock()
        self._ended = threading.Event()  # nothing left to claim and no item under way

    def run(self, pool: concurrent.futures.ThreadPoolExecutor, helpers: int) -> list:
        for _ in range(helpers):
            pool.submit(self._work)  # a helper that starts after the end finds nothing to claim
        self._work()
        self._ended.wait()
        if self.errors:
            raise self.errors[min(self.errors)]
        return self.results

    def _work(self) -> None:
        while (i := self._claim()) is not None:
            try:
                self.results[i] = self.fn(self.items[i])
            except BaseException as exc:  # noqa: BLE001 - handed to the caller by `run`
                self.errors[i] = exc
            finally:
                self._release()

    def _claim(self) -> int | None:
        with self._lock:
            if self.errors or self._next == len(self.items):
                return None
            self._next += 1
            self._busy += 1
            return self._next - 1

    def _release(self) -> None:
        with self._lock:
            self._busy -= 1
            if not self._busy and (self.errors or self._next == len(self.items)):
                self._ended.set()
