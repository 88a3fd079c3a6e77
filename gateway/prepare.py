"""The gateway's bounded pool for CPU-heavy request preparation, so the event loop never does it.

Contract:
- `PrepPool(settings)` runs synchronous work (`await pool.run(fn, *args, size=...)`: JSON decoding of a request
  body, chat rendering and structure hints, tokenisation, structured-output preparation, image decoding) on
  threads, never on the event loop; what `fn` raises is re-raised (an `ApiError` reaches the client as is).
- Two lanes of `workers` threads each: work for a request of at most `small_bytes` (`size`: its body and fetched
  images, in bytes) runs on the small lane, larger work on the large lane, so a small request never waits behind
  a worst-case one.
- Per lane, at most `workers + queue_limit` requests are being prepared or waiting at once; one more is refused at
  once with `ApiError` 503 `server_busy` and `Retry-After` (nothing is queued without bound).
- Each request waits at most `timeout_s` for its preparation (queueing included): then `ApiError` 503
  `prepare_timeout` with `Retry-After`. A thread cannot be interrupted, so the refused work still holds its slot
  until it ends: the bound on work in flight stays true.
- Threads, not processes: what they run either releases the GIL (the tokenizer's BPE, image decoding) or is
  Python that the interpreter preempts every switch interval; `start()` sets the process's interval to
  `switch_interval_ms` (`--switch-interval-ms`, 1 ms; Python's default is 5 ms), so the event loop waits about
  that long for the GIL at each wake-up rather than 5 ms. Measured (tests/integration/test_gateway_event_loop.py,
  docs/benchmarks.md): /health stays in the tens to low hundreds of milliseconds while worst-case requests are
  prepared, where it froze for seconds before; a process pool would remove the GIL share of that wait.
- `close()` stops the threads (work in flight finishes; nothing new starts) and restores the switch interval.
"""

from __future__ import annotations

import asyncio
import functools
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from gateway.protocol import ApiError

T = TypeVar("T")
BUSY_RETRY_AFTER_S = "1"


@dataclass(frozen=True)
class PrepSettings:
    workers: int = 2  # threads preparing requests
    queue_limit: int = 512  # requests waiting for a thread beyond those being prepared
    timeout_s: float = 30.0  # deadline of one request's preparation, queueing included (seconds)
    small_bytes: int = 64 << 10  # requests of at most this many bytes have their own lane
    switch_interval_ms: float = 1.0  # the interpreter's thread switch interval in the gateway's process (ms)

    def __post_init__(self):
        if self.workers < 1 or self.queue_limit < 0 or self.timeout_s <= 0 or self.small_bytes < 0 \
                or self.switch_interval_ms <= 0:
            raise ValueError("--prepare-workers must be >= 1, --prepare-queue-limit >= 0, --prepare-timeout-s > 0, "
                             "--prepare-small-bytes >= 0 and --switch-interval-ms > 0 (got "
                             f"{self.workers}, {self.queue_limit}, {self.timeout_s}, {self.small_bytes}, "
                             f"{self.switch_interval_ms})")


class _Lane:
    def __init__(self, name: str, workers: int):
        self.name = name
        self.executor = ThreadPoolExecutor(workers, thread_name_prefix=f"kdamesh-prepare-{name}")
        self.in_flight = 0  # requests being prepared or waiting for a thread (each until its work ends)

    def release(self, future: asyncio.Future) -> None:
        self.in_flight -= 1
        if not future.cancelled():
            future.exception()  # retrieved: a refused request's late failure is not "never retrieved"


class PrepPool:
    def __init__(self, settings: PrepSettings = PrepSettings()):
        self.settings = settings
        self.small = _Lane("small", settings.workers)
        self.large = _Lane("large", settings.workers)
        self._previous_interval: float | None = None  # the process's switch interval before `start()`

    @property
    def in_flight(self) -> int:
        return self.small.in_flight + self.large.in_flight

    async def run(self, fn: Callable[..., T], *args: Any, size: int = 0) -> T:
        lane = self.small if size <= self.settings.small_bytes else self.large
        limit = self.settings.workers + self.settings.queue_limit
        if lane.in_flight >= limit:
            raise ApiError(503, f"the gateway is preparing {lane.in_flight} {lane.name} requests, its limit "
                                f"(--prepare-workers + --prepare-queue-limit); retry shortly", code="server_busy",
                           headers={"Retry-After": BUSY_RETRY_AFTER_S})
        lane.in_flight += 1
        future = asyncio.get_running_loop().run_in_executor(lane.executor, functools.partial(fn, *args))
        future.add_done_callback(lane.release)
        try:
            async with asyncio.timeout(self.settings.timeout_s):  # not wait_for: see gateway/stall.py
                return await asyncio.shield(future)
        except TimeoutError:
            raise ApiError(503, f"preparing the request took longer than {self.settings.timeout_s:g} s "
                                "(--prepare-timeout-s)", code="prepare_timeout",
                           headers={"Retry-After": BUSY_RETRY_AFTER_S}) from None

    def start(self) -> None:
        """Sets the process's thread switch interval (see the module docstring); the gateway's start calls it."""
        if self._previous_interval is None:
            self._previous_interval = sys.getswitchinterval()
        sys.setswitchinterval(self.settings.switch_interval_ms / 1000)

    def close(self) -> None:
        """Stops the threads and gives the process back the switch interval it had before `start()`."""
        for lane in (self.small, self.large):
            lane.executor.shutdown(wait=False, cancel_futures=True)
        if self._previous_interval is not None:
            sys.setswitchinterval(self._previous_interval)
            self._previous_interval = None
