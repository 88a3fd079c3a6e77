"""The gateway's bounded pool for CPU-heavy request preparation, so the event loop never does it.

Contract:
- `PrepPool(settings)` runs synchronous work (`await pool.run(fn, *args)`: JSON decoding of a request body, chat
  rendering and structure hints, tokenisation, structured-output preparation, image decoding) on `workers`
  threads, never on the event loop; what `fn` raises is re-raised (an `ApiError` reaches the client as is).
- At most `workers + queue_limit` requests are being prepared or waiting at once; one more is refused at once with
  `ApiError` 503 `server_busy` and `Retry-After` (nothing is queued without bound).
- Each request waits at most `timeout_s` for its preparation (queueing included): then `ApiError` 503
  `prepare_timeout` with `Retry-After`. A thread cannot be interrupted, so the refused work still holds its slot
  until it ends: the bound on work in flight stays true.
- Threads suffice because what they run either releases the GIL (the tokenizer's BPE, JSON decoding in C, image
  decoding) or is pure Python that the interpreter preempts every `sys.getswitchinterval()` (5 ms): the event loop
  gets the GIL back within a few milliseconds per wake-up, and /health answers in well under 100 ms while a
  worst-case request is prepared (tests/integration/test_gateway_event_loop.py measures it).
- `close()` stops the threads (work in flight finishes; nothing new starts).
"""

from __future__ import annotations

import asyncio
import functools
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
    queue_limit: int = 64  # requests waiting for a thread beyond those being prepared
    timeout_s: float = 30.0  # deadline of one request's preparation, queueing included (seconds)

    def __post_init__(self):
        if self.workers < 1 or self.queue_limit < 0 or self.timeout_s <= 0:
            raise ValueError("--prepare-workers must be >= 1, --prepare-queue-limit >= 0 and --prepare-timeout-s > 0"
                             f" (got {self.workers}, {self.queue_limit}, {self.timeout_s})")


class PrepPool:
    def __init__(self, settings: PrepSettings = PrepSettings()):
        self.settings = settings
        self._executor = ThreadPoolExecutor(settings.workers, thread_name_prefix="kdamesh-prepare")
        self.in_flight = 0  # requests being prepared or waiting for a thread (each until its work ends)

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        limit = self.settings.workers + self.settings.queue_limit
        if self.in_flight >= limit:
            raise ApiError(503, f"the gateway is preparing {self.in_flight} requests, its limit "
                                f"(--prepare-workers + --prepare-queue-limit); retry shortly", code="server_busy",
                           headers={"Retry-After": BUSY_RETRY_AFTER_S})
        self.in_flight += 1
        future = asyncio.get_running_loop().run_in_executor(self._executor, functools.partial(fn, *args, **kwargs))
        future.add_done_callback(self._release)
        try:
            return await asyncio.wait_for(asyncio.shield(future), self.settings.timeout_s)
        except asyncio.TimeoutError:
            raise ApiError(503, f"preparing the request took longer than {self.settings.timeout_s:g} s "
                                "(--prepare-timeout-s)", code="prepare_timeout",
                           headers={"Retry-After": BUSY_RETRY_AFTER_S}) from None

    def _release(self, future: asyncio.Future) -> None:
        self.in_flight -= 1
        if not future.cancelled():
            future.exception()  # retrieved: a refused request's late failure is not "never retrieved"

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
