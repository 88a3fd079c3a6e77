"""When a worker that stopped answering ends a request (a paused or wedged process keeps its connection open, so
only silence shows it).

Contract:
- `StallPolicy(timeout_s, prefill_tokens_per_s)`: a stream whose worker sends nothing for `gap_s()` (=
  `timeout_s`) between two messages is stalled; before its first message a request is allowed the prompt's
  expected prefill time on top, `first_message_s(prompt_tokens)` = `timeout_s + prompt_tokens /
  prefill_tokens_per_s`. The limit is per message gap, never the whole request: a long generation that keeps
  streaming is never cut (the request deadline, `--request-timeout-s`, bounds that).
- `next_message(iterator, limit_s, describe)`: the iterator's next item, or `WorkerStalled` (a
  `gateway.mesh_client`-independent exception carrying `describe` and the limit) when none came within `limit_s`;
  the pending read is cancelled. `StopAsyncIteration` passes through.
- `WorkerStalled.api_error(request_id)`: the client's error, 503 `worker_stalled` with `Retry-After` (the request
  may be retried; the worker is avoided once the health checks mark it), naming the silence and the request id.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
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


class WorkerStalled(Exception):
    """A worker sent nothing within the stall limit."""

    def __init__(self, describe: str, limit_s: float):
        super().__init__(f"{describe} sent nothing for {limit_s:.1f} s (--stall-timeout-s)")
        self.describe, self.limit_s = describe, limit_s

    def api_error(self, request_id: str) -> ApiError:
        return ApiError(503, f"the model server stopped answering (no output for {self.limit_s:.1f} s); retry "
                             f"(request {request_id})", code="worker_stalled",
                        headers={"Retry-After": RETRY_AFTER_S})


async def next_message(iterator: AsyncIterator, limit_s: float, describe: str) -> Any:
    # asyncio.timeout, not wait_for: Python 3.11's wait_for may swallow a cancellation that races the item (the
    # run of a client that went away would go on)
    try:
        async with asyncio.timeout(limit_s):
            return await iterator.__anext__()
    except TimeoutError:
        raise WorkerStalled(describe, limit_s) from None
