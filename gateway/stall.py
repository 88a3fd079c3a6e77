"""When a worker that stopped answering ends a request (a paused or wedged process keeps its connection open, so
only silence shows it).

Contract:
- `StallPolicy(timeout_s, prefill_tokens_per_s)`: a stream whose worker sends nothing for `gap_s()` (=
  `timeout_s`) between two messages is stalled; before its first message a request is allowed the prompt's
  expected prefill time on top, `first_message_s(prompt_tokens)` = `timeout_s + prompt_tokens /
  prefill_tokens_per_s`. The limit is per message gap, never the whole request: a long generation that keeps
  streaming is never cut (the request deadline, `--request-timeout-s`, bounds that). A request the client reads
  whole lets its decode worker batch its tokens for `output_interval_s()` (a tenth of the gap limit) at a time.
- `next_message(iterator, limit_s, describe, since_serving)`: the iterator's next item, or `WorkerStalled` (a
  `gateway.mesh_client`-independent exception carrying `describe` and the limit) when none came within `limit_s`
  and the worker has not shown it is alive meanwhile: `since_serving()` (seconds since the worker last answered its
  health check SERVING; None: no such evidence) below `limit_s` means it answers — it is busy, the request waits
  in its queue or was preempted to give another tenant its share (engine/fair_share.py) — and the wait goes on
  until `limit_s` after its last SERVING answer. A paused or wedged worker stops answering its health checks too,
  so it is still given up on within `limit_s` of its last sign of life. Then the pending read is cancelled (also
  when the caller is). `StopAsyncIteration` passes through. It costs one timer per message (no task): it runs
  for every token of every stream.
- `WorkerStalled.api_error(request_id)`: the client's error, 503 `worker_stalled` with `Retry-After` (the request
  may be retried; the worker is avoided once the health checks mark it), naming the silence and the request id.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from gateway.protocol import ApiError
from gateway.protocol.errors import RETRY_AFTER_S


@dataclass(frozen=True)
class StallPolicy:
    timeout_s: float = 10.0
    prefill_tokens_per_s: float = 2000.0

    def __post_init__(self):
        if self.timeout_s <= 0 or self.prefill_tokens_per_s <= 0:
            raise ValueError("--stall-timeout-s and --stall-prefill-tokens-per-s must be positive (got "
                             f"{self.timeout_s}, {self.prefill_tokens_per_s})")

    def gap_s(self) -> float:
        return self.timeout_s

    def first_message_s(self, prompt_tokens: int) -> float:
        return self.timeout_s + prompt_tokens / self.prefill_tokens_per_s

    def output_interval_s(self) -> float:
        """How long a decode worker may hold back the tokens of a request the client reads whole (a tenth of the gap
        limit: batched output never comes near a stall)."""
        return self.timeout_s / 10


class WorkerStalled(Exception):
    """A worker sent nothing within the stall limit."""

    def __init__(self, describe: str, limit_s: float):
        super().__init__(f"{describe} sent nothing for {limit_s:.1f} s (--stall-timeout-s)")
        self.describe, self.limit_s = describe, limit_s

    def api_error(self, request_id: str) -> ApiError:
        return ApiError(503, f"the model server stopped answering (no output for {self.limit_s:.1f} s); retry "
                             f"(request {request_id})", code="worker_stalled",
                        headers={"Retry-After": RETRY_AFTER_S})


async def next_message(iterator: AsyncIterator, limit_s: float, describe: str,
                       since_serving: Callable[[], float | None] = lambda: None) -> Any:
    # One timer per message, no task (this runs for every token of every stream): when it fires and the worker
    # showed no sign of life, it cancels this task (asyncio.timeout's way, with uncancel: a cancellation from
    # outside that races it still wins, and 3.11's wait_for could swallow it); while the worker answers its health
    # checks it re-arms for the rest of the limit and the same read goes on.
    watch = _Watch(limit_s, since_serving)
    try:
        return await iterator.__anext__()
    except asyncio.CancelledError:
        if watch.stalled and watch.task.uncancel() == 0:
            raise WorkerStalled(describe, limit_s) from None
        raise
    finally:
        watch.timer.cancel()  # (drops its callback: nothing of this read is left in a reference cycle)


class _Watch:
    """The stall timer of one read (a class, not a closure that re-arms itself: that would be a reference cycle per
    message, garbage the cyclic collector must find)."""

    __slots__ = ("limit_s", "since_serving", "loop", "task", "timer", "stalled")

    def __init__(self, limit_s: float, since_serving: Callable[[], float | None]):
        self.limit_s, self.since_serving, self.stalled = limit_s, since_serving, False
        self.loop, self.task = asyncio.get_running_loop(), asyncio.current_task()
        self.timer = self.loop.call_later(limit_s, self.check)

    def check(self) -> None:
        quiet = self.since_serving()
        if quiet is None or quiet >= self.limit_s:
            self.stalled = True
            self.task.cancel()
        else:
            self.timer = self.loop.call_later(self.limit_s - quiet, self.check)
