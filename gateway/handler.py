"""The one skeleton every generation request runs through — REST or gRPC, chat or completions — up to its first
output.

Contract:
- `open_run(core, trace, api, endpoint, authorization, start, guard)` authenticates (`authorization`: the
  `Authorization` header or metadata value), calls `start(principal, trace)` — the front's part: read and validate
  the body, plan, admit; it returns a run — and opens the run (`guard` wraps the opening, e.g. the REST API's
  watch for a client that disconnects; it may raise `ClientGone`).
- Accounting: a request that got this far is counted in the request metrics as `(api, endpoint, 200)`; one refused
  on the way with an `ApiError` or `ClientGone` as `(api, endpoint, its status)` (`failure_of`), and its trace
  records the failure and is finished; the exception is re-raised for the front to answer (error body, gRPC
  abort, 499). A run that was opened finishes its own trace when it is closed.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from gateway.protocol import ApiError, ClientGone, failure_of
from gateway.request_trace import RequestTrace
from gateway.run import Run
from gateway.tenancy import Principal

if TYPE_CHECKING:
    from gateway.core import GatewayCore

Start = Callable[[Principal, RequestTrace], Awaitable[Run]]
Guard = Callable[[Awaitable[None]], Awaitable[None]]


async def _unguarded(opening: Awaitable[None]) -> None:
    await opening


async def open_run(core: "GatewayCore", trace: RequestTrace, api: str, endpoint: str, authorization: str | None,
                   start: Start, guard: Guard = _unguarded) -> Run:
    """An opened run of the request, or the exception that refused it (see the module docstring)."""
    try:
        principal = core.authenticate(authorization)
        trace.tenant = principal.tenant
        run = await start(principal, trace)
        await guard(run.open())
    except BaseException as exc:
        error, status = failure_of(exc)
        if isinstance(exc, (ApiError, ClientGone)):
            core.metrics.count_request(api, endpoint, status)
        trace.fail(error, status)
        trace.finish()  # a run that was opened has already finished it (with its usage): then this does nothing
        raise
    core.metrics.count_request(api, endpoint, 200)
    return run
