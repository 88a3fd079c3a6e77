"""The REST API's plumbing around a request: its JSON body, its client's disconnect, the shutdown deadline, SSE.

Contract:
- `read_json(request)`: the decoded body; `read_body(request)` its bytes (same checks) and `decode_json(raw)`
  their decoding (the routes run it in the gateway's preparation pool, `GatewayCore.prepare`): `ApiError` 415
  `unsupported_media_type` unless `Content-Type` is `application/json`, 413 `request_too_large` past `MAX_REQUEST_BYTES` (declared or actual: refused before it is
  parsed), 400 `invalid_json` when it does not decode or nests deeper than `MAX_JSON_DEPTH`.
- `unless_disconnected(request, work)` runs `work` and cancels it when the client disconnects first (`ClientGone`).
- `ShutdownClock`: when the HTTP server was told to stop, streams still running near the end of its grace period
  end with an OpenAI error event (503 `shutting_down`) and `[DONE]` instead of being cut off mid-stream
  (`until_shutdown(events, clock)` raises that `ApiError` once the deadline passes).
- `sse_stream(run, fmt, clock, keepalive_s)`: a run's Server-Sent Events — a `: keep-alive` comment each time
  `keepalive_s` (`--sse-keepalive-s`; 0: never) passes without output (`with_keepalive`), its chunks (`gateway.rest_responses`), the usage
  trailer when asked, `data: [DONE]`; an error after the first chunk becomes a final `data: {"error": …}` before
  `[DONE]`, and an unexpected exception a final 500 `internal_error` event (logged). The run is closed when the
  stream ends, however it ends.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable
from contextlib import aclosing

from fastapi import Request

from gateway.protocol import ApiError, ClientGone, bad_json, internal_error
from gateway.rest_responses import RestFormat, usage_chunk
from gateway.run import Run

MAX_REQUEST_BYTES = 32 << 20  # a JSON body larger than this is refused with 413 before it is parsed
MAX_JSON_DEPTH = 64  # lists and objects nested deeper than this are refused with 400
log = logging.getLogger(__name__)
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
SSE_DONE = "data: [DONE]\n\n"
SSE_KEEPALIVE = ": keep-alive\n\n"  # an SSE comment: clients ignore it; proxies and clients see the stream alive
KEEPALIVE = object()
SHUTTING_DOWN = "the server is shutting down; the stream ended before its output was complete"


async def read_json(request: Request):
    """The decoded body, decoded on the event loop (small bodies; `read_body` + `decode_json` in the preparation
    pool for the others)."""
    return decode_json(await read_body(request))


async def read_body(request: Request) -> bytes:
    _check_content_type(request.headers.get("content-type"))
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_REQUEST_BYTES:
        raise ApiError(413, f"the request body is {declared} bytes; the limit is {MAX_REQUEST_BYTES}",
                       code="request_too_large")
    raw = bytearray()
    async for part in request.stream():
        raw += part
        if len(raw) > MAX_REQUEST_BYTES:  # a body without (or lying about) its length
            raise ApiError(413, f"the request body exceeds {MAX_REQUEST_BYTES} bytes", code="request_too_large")
    return bytes(raw)


def decode_json(raw: bytes):
    """A body's JSON (CPU work: `read_json` runs it in the preparation pool when given one)."""
    try:
        body = json.loads(raw)
    except ValueError as exc:  # not JSON, not UTF-8, or an integer of more digits than Python converts
        raise bad_json(exc) from None
    except RecursionError:  # nested deeper than the decoder's recursion limit
        raise _too_deep() from None
    if _nesting_exceeds(body, MAX_JSON_DEPTH):
        raise _too_deep()
    return body


def _check_content_type(value: str | None) -> None:
    """415 `unsupported_media_type` unless the body is declared `application/json` (parameters such as charset are
    allowed)."""
    media = (value or "").split(";", 1)[0].strip().lower()
    if media != "application/json":
        raise ApiError(415, f"the request body must be application/json, not {media or 'undeclared'}",
                       code="unsupported_media_type")


def _too_deep() -> ApiError:
    return ApiError(400, f"the request body nests deeper than {MAX_JSON_DEPTH} levels", code="invalid_json")


def _nesting_exceeds(value, limit: int) -> bool:
    """Whether the decoded JSON `value` nests lists and objects more than `limit` deep (iterative: no recursion)."""
    pending = [(value, 1)]
    while pending:
        item, depth = pending.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        if depth > limit:
            return True
        pending.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return False


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(request: Request, work: Awaitable):
    """Runs `work`; cancels it when the client disconnects first (raises `ClientGone`)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    raise ClientGone()


class ShutdownClock:
    """When the HTTP server was told to stop (see the module docstring)."""

    def __init__(self, grace_s: float, margin_s: float = 1.0):
        self.grace_s, self.margin_s = grace_s, margin_s
        self.deadline = asyncio.Event()  # set when streams must wrap up

    def begin(self) -> None:
        asyncio.get_running_loop().call_later(max(0.0, self.grace_s - self.margin_s), self.deadline.set)


async def until_shutdown(events: AsyncIterator, clock: ShutdownClock | None) -> AsyncIterator:
    """Yields `events` until they end, or raises a 503 `ApiError` once the shutdown deadline passes."""
    if clock is None:
        async for item in events:
            yield item
        return
    iterator = events.__aiter__()
    deadline = asyncio.ensure_future(clock.deadline.wait())
    step = None
    try:
        while True:
            step = asyncio.ensure_future(iterator.__anext__())
            await asyncio.wait({step, deadline}, return_when=asyncio.FIRST_COMPLETED)
            if not step.done():
                raise ApiError(503, SHUTTING_DOWN, code="shutting_down")
            try:
                item = step.result()
            except StopAsyncIteration:
                return
            yield item
    finally:
        # however this ends (the deadline, or the consumer cancelled: the client went away), the pending step is
        # cancelled and awaited, so `events` is no longer running when its owner closes it
        deadline.cancel()
        if step is not None and not step.done():
            step.cancel()
            await asyncio.shield(asyncio.gather(step, return_exceptions=True))


async def with_keepalive(events: AsyncIterator, interval_s: float) -> AsyncIterator:
    """Yields `events`, and `KEEPALIVE` each time `interval_s` passes without one (0: never); the pending step is
    kept across a keep-alive, and cancelled and awaited however the iteration ends."""
    if interval_s <= 0:
        async for item in events:
            yield item
        return
    iterator = events.__aiter__()
    step = None
    try:
        while True:
            if step is None:
                step = asyncio.ensure_future(iterator.__anext__())
            done, _ = await asyncio.wait({step}, timeout=interval_s)
            if not done:
                yield KEEPALIVE
                continue
            finished, step = step, None
            try:
                item = finished.result()
            except StopAsyncIteration:
                return
            yield item
    finally:
        if step is not None and not step.done():
            step.cancel()
            await asyncio.shield(asyncio.gather(step, return_exceptions=True))


def sse(body: dict) -> str:
    return f"data: {json.dumps(body, separators=(',', ':'), ensure_ascii=False)}\n\n"


async def sse_stream(run: Run, fmt: RestFormat, clock: ShutdownClock | None = None,
                     keepalive_s: float = 0.0) -> AsyncIterator[str]:
    try:
        # closed here, however the stream ends: a pending step is cancelled before the run is closed
        async with aclosing(with_keepalive(until_shutdown(run.events(), clock), keepalive_s)) as events:
            async for event in events:
                if event is KEEPALIVE:
                    yield SSE_KEEPALIVE
                    continue
                for body in fmt.chunks(run, event):
                    yield sse(body)
        if run.include_usage:
            yield sse(usage_chunk(run, fmt))
        yield SSE_DONE
    except ApiError as exc:
        yield sse(exc.body())
        yield SSE_DONE
    except Exception:  # a bug: the client still gets a clean end; the detail goes to the log
        log.exception("unexpected error in the stream of request %s", run.id)
        yield sse(internal_error(run.id).body())
        yield SSE_DONE
    finally:
        await run.close()
