"""The gateway's bounded pool for CPU-heavy request preparation, so the event loop never does it.

Contract:
- `PrepPool(settings)` runs synchronous work (`await pool.run(fn, *args, size=...)`: JSON decoding of a request
  body, chat rendering and structure hints, tokenisation, structured-output preparation, image decoding) on
  threads or preparation processes, never on the event loop; what `fn` raises is re-raised (an `ApiError` reaches
  the client as is).
- Two lanes: work for a request of at most `small_bytes` (`size`: its body and fetched images, in bytes) runs on
  the small lane, larger work on the large lane, so a small request never waits behind a worst-case one.
- Per lane, at most `workers + queue_limit` requests are being prepared or waiting at once; one more is refused at
  once with `ApiError` 503 `server_busy` and `Retry-After` (nothing is queued without bound).
- Each request waits at most `timeout_s` for its preparation (queueing included): then `ApiError` 503
  `prepare_timeout` with `Retry-After`. A thread cannot be interrupted, so work refused on a thread still holds
  its slot until it ends (the bound on work in flight stays true); work on a process is killed with it.
- The large lane runs on `processes` preparation processes (gateway/prep_procs.py, `--prepare-processes`, 2) once
  `use_processes(config, objects, max_model_len)` has named the gateway's tokenizer / renderer / planner (the
  gateway's start does): the heavy CPU work of a worst-case request (a 10,000-message chat, a 10 MB prompt, a
  2,000-way schema) then runs off the gateway process's GIL, at a lower CPU priority, and a request whose client
  goes away or whose deadline passes has its process killed (the work stops and frees its slot at once). With
  `processes` 0, or before `use_processes`, the large lane runs on `workers` threads like the small lane.
- The small lane stays on threads (no pickling, no process hop): what it runs is small, or releases the GIL (the
  tokenizer's BPE); `start()` sets the process's switch interval to `switch_interval_ms` (`--switch-interval-ms`,
  1 ms; Python's default is 5 ms), so the event loop waits about that long for the GIL at each wake-up. Measured
  (tests/integration/test_gateway_event_loop.py, docs/benchmarks.md): /health p99 stays under 100 ms while
  worst-case requests are prepared, where it froze for seconds before the pool and reached ~110 ms with threads.
- `close()` stops the threads (work in flight finishes; nothing new starts), kills the processes and restores the
  switch interval.
"""

from __future__ import annotations

import asyncio
import functools
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from gateway.prep_procs import ProcessLane
from gateway.prep_settings import PrepSettings
from gateway.protocol import ApiError

T = TypeVar("T")
BUSY_RETRY_AFTER_S = "1"


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
        self.processes: ProcessLane | None = None  # the large lane's processes (`use_processes`)
        self._max_model_len: Callable[[], int | None] = lambda: None

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
        if lane is self.large and self.processes is not None:
            return await self._on_process(lane, fn, args)
        future = asyncio.get_running_loop().run_in_executor(lane.executor, functools.partial(fn, *args))
        future.add_done_callback(lane.release)
        try:
            async with asyncio.timeout(self.settings.timeout_s):  # not wait_for: see gateway/stall.py
                return await asyncio.shield(future)
        except TimeoutError:
            raise self._timeout() from None

    async def _on_process(self, lane: _Lane, fn: Callable[..., T], args: tuple) -> T:
        """`fn(*args)` on a preparation process; cancelled (deadline, client gone): the process is killed."""
        try:
            async with asyncio.timeout(self.settings.timeout_s):
                return await self.processes.run(fn, *args, max_model_len=self._max_model_len())
        except TimeoutError:
            raise self._timeout() from None
        finally:
            lane.in_flight -= 1

    def _timeout(self) -> ApiError:
        return ApiError(503, f"preparing the request took longer than {self.settings.timeout_s:g} s "
                             "(--prepare-timeout-s)", code="prepare_timeout", headers={"Retry-After": BUSY_RETRY_AFTER_S})

    def use_processes(self, config, objects: dict[str, Any], max_model_len: Callable[[], int | None]) -> None:
        """Moves the large lane onto `settings.processes` processes (none: it stays on threads); `objects`: the
        gateway's tokenizer / renderer / planner by name (gateway/prep_procs.py), `max_model_len`: the planner's."""
        if self.settings.processes > 0 and self.processes is None:
            self.processes = ProcessLane(self.settings.processes, config, objects)
            self._max_model_len = max_model_len

    def start(self) -> None:
        """Sets the process's thread switch interval (see the module docstring); the gateway's start calls it."""
        if self._previous_interval is None:
            self._previous_interval = sys.getswitchinterval()
        sys.setswitchinterval(self.settings.switch_interval_ms / 1000)

    def close(self) -> None:
        """Stops the threads and processes and gives the process back the switch interval it had before `start()`."""
        for lane in (self.small, self.large):
            lane.executor.shutdown(wait=False, cancel_futures=True)
        if self.processes is not None:
            self.processes.close()
            self.processes = None
        if self._previous_interval is not None:
            sys.setswitchinterval(self._previous_interval)
            self._previous_interval = None
