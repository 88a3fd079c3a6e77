"""The REST plumbing of the APIs translated onto the chat path: the OpenAI Responses API (gateway/responses/) and the
Anthropic Messages API (gateway/anthropic/).

Contract:
- `respond_translated(request, endpoint, authorization, start, refuse)` runs one request as `/v1/chat/completions`
  does (`gateway.handler.open_run`: authentication, admission, metrics as `("rest", endpoint, status)`, the trace,
  cancellation when the client disconnects before the response starts: 499, nothing sent) — `start(principal,
  trace)` parses the API's body, plans the chat request it translates to and returns `(run, rendering)` — and
  answers with the rendering's whole body (JSON) or, when the run streams, its Server-Sent Events
  (`Rendering.stream`; an error after the stream started is the API's error event, `Rendering.error_event`; the
  stream ends at the shutdown deadline with a 503 error event like chat streams). `refuse(exc, headers)` is the
  API's HTTP error response (its own envelope); every response names the request id (`X-Request-Id`).
- `sse_event(name, body)`: one SSE event with an `event:` line, as both APIs' clients read them.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from gateway.chat_run import ChatRun
from gateway.events import ChatEvent
from gateway.handler import open_run
from gateway.protocol import ApiError, ClientGone, failure_of, internal_error
from gateway.request_trace import RequestTrace
from gateway.rest_io import SSE_HEADERS, ShutdownClock, unless_disconnected, until_shutdown
from gateway.tenancy import Principal
from telemetry.context import REQUEST_ID_HEADER, request_id_from_headers

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Rendering:
    """How one request's run becomes the API's response."""

    collect: Callable[[ChatRun], Awaitable[dict]]  # the whole response (consumes `run.events()`)
    stream: Callable[[ChatRun, AsyncIterator[ChatEvent]], AsyncIterator[str]]  # SSE text of the run's events
    error_event: Callable[[ApiError], str]  # an error after the stream started


TranslatedStart = Callable[[Principal, RequestTrace], Awaitable[tuple[ChatRun, Rendering]]]
Refuse = Callable[[ApiError, dict[str, str]], Response]


def sse_event(name: str, body: dict) -> str:
    return f"event: {name}\ndata: {json.dumps(body, separators=(',', ':'), ensure_ascii=False)}\n\n"


async def respond_translated(request: Request, endpoint: str, authorization: str | None, start: TranslatedStart,
                             refuse: Refuse) -> Response:
    core = request.app.state.core
    trace = core.trace(request.url.path, request_id_from_headers(request.headers), request.headers)
    ids = {REQUEST_ID_HEADER: trace.request_id}
    made: list[Rendering] = []

    async def start_run(principal: Principal, run_trace: RequestTrace) -> ChatRun:
        run, rendering = await start(principal, run_trace)
        made.append(rendering)
        return run

    try:
        run = await open_run(core, trace, "rest", endpoint, authorization, start_run,
                             lambda opening: unless_disconnected(request, opening))
    except ClientGone:
        return Response(status_code=499, headers=ids)
    except ApiError as exc:
        return refuse(exc, ids)
    rendering = made[0]
    if run.stream:
        return StreamingResponse(_sse(run, rendering, request.app.state.shutdown), media_type="text/event-stream",
                                 headers={**SSE_HEADERS, **ids}, background=BackgroundTask(run.close))
    try:
        return JSONResponse(await unless_disconnected(request, rendering.collect(run)), headers=ids)
    except ClientGone:
        trace.fail(*failure_of(ClientGone()))
        return Response(status_code=499, headers=ids)
    except ApiError as exc:
        trace.fail(*failure_of(exc))
        return refuse(exc, ids)
    finally:
        await run.close()


async def _sse(run: ChatRun, rendering: Rendering, clock: ShutdownClock | None) -> AsyncIterator[str]:
    try:
        async for text in rendering.stream(run, until_shutdown(run.events(), clock)):
            yield text
    except ApiError as exc:
        yield rendering.error_event(exc)
    except Exception:  # a bug: the client still gets a clean end; the detail goes to the log
        log.exception("unexpected error in the stream of request %s", run.id)
        yield rendering.error_event(internal_error(run.id))
    finally:
        await run.close()
