"""The gateway's REST front (FastAPI): the OpenAI-compatible API over the mesh.

Contract:
- `create_app(config, mesh=None, tokenizer=None, core=None)` builds the app over a `GatewayCore`
  (gateway/chat_service.py: the pipeline shared with the gRPC API). Without `core` it makes one; a core the app
  made is started and closed by the app's lifespan (a given core is the caller's to start and close).
- `GET /health`: `{"status", "workers": {address: serving}}` — 200 "ok" when every mesh worker reports SERVING,
  200 "degraded" when some do not but a decode worker does (requests are routed around the others), else 503
  "unavailable".
  `GET /metrics`: Prometheus text format (gateway/metrics.py). Neither needs an API key.
- With API keys configured (`KDAMESH_API_KEYS`, `--api-keys-file`) every other endpoint needs
  `Authorization: Bearer <key>` (401 otherwise); without keys the gateway is open (logged at start-up).
- `GET /v1/models`, `GET /v1/models/{id}`: the served model (with `max_model_len`).
- `POST /v1/chat/completions`: OpenAI chat completions with vLLM's extras (gateway/openai_protocol.py): streaming
  as `chat.completion.chunk` Server-Sent Events (the role in each choice's first delta, `finish_reason` only in its
  last chunk, `data: [DONE]` at the end, a `choices: []` usage trailer with `stream_options.include_usage`),
  reasoning as both `reasoning_content` and `reasoning`, tool calls (`tools`, `tool_choice` auto/none/required/named
  with `--enable-auto-tool-choice`), `response_format` (json_object / json_schema, enforced by the engine's
  grammar), `logprobs` / `top_logprobs`, `n`, `seed`, `stop`, `max_tokens` / `max_completion_tokens`, `user`,
  `priority`, `chat_template_kwargs`, `cache_salt` (mixed into the tenant's salt).
- `POST /v1/completions` (OpenAI legacy completions, vLLM's extra sampling fields): `prompt` as text, texts, token
  ids or lists of them; `n` choices per prompt (index = prompt index * n + i); `echo`, `logprobs`, `stop`, `seed`,
  `stream` (+ `stream_options.include_usage`), `return_token_ids`.
- `POST /tokenize` (`prompt`, or chat `messages`) -> `{"tokens", "count", "max_model_len"}`;
  `POST /detokenize` (`tokens`) -> `{"prompt"}` (vLLM's shapes).
- Errors use the OpenAI envelope `{"error": {"message", "type", "param", "code"}}`: malformed JSON or fields 400,
  a prompt beyond the context 400 `context_length_exceeded`, missing/invalid key 401, unknown model 404, over a
  tenant's quota 429 with `Retry-After`, mesh unavailable 503, deadline 504. Never a 500 for bad input. A stream
  reports an error that happens before its first token as a plain HTTP error; one after is sent as a final
  `data: {"error": …}` before `data: [DONE]`.
- A client that disconnects (streaming or not) cancels its mesh calls: decode aborts the request and frees its
  memory.
- Telemetry of `/v1/chat/completions` and `/v1/completions` (`RequestTrace`, gateway/chat_service.py): the request id
  is the client's `X-Request-Id` when usable, else a new one, and is returned in the `X-Request-Id` response header;
  the root span `chat {model}` / `text_completion {model}` continues an incoming W3C `traceparent`; one access line
  per request (`kdamesh.request` logger) when it ends — after the last streamed chunk for a stream.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.tokenizer import KimiTokenizer
from gateway.chat_service import ChatEvent, ChatRun, CompletionRun, GatewayCore, RequestTrace, api_error_type
from gateway.config import MODES, GatewayConfig  # noqa: F401  (re-exported: deploy/serve.py, tests)
from gateway.mesh_client import MeshClient
from gateway.openai_protocol import (ApiError, bad_json, chat_logprobs_entry, completion_logprobs, not_found_model,
                                     parse_chat, parse_completion, parse_detokenize, parse_tokenize, usage_dict)
from gateway.parsers import fold
from telemetry.context import REQUEST_ID_HEADER, request_id_from_headers
from telemetry.tracing import error_type_of

log = logging.getLogger(__name__)

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
# FastAPI's own OpenTelemetry spans (newer versions record them by default) are off: each API request has one SERVER
# span, the gateway's GenAI root span (RequestTrace), which continues the client's `traceparent` itself.
_FASTAPI_TELEMETRY = ({"telemetry": {"tracing": False, "metrics": False, "logs": False, "operation_spans": False}}
                      if "telemetry" in inspect.signature(FastAPI.__init__).parameters else {})


def _error_response(exc: ApiError, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers={**exc.headers, **(headers or {})})


def _request_trace(core: GatewayCore, request: Request) -> tuple[RequestTrace, dict[str, str]]:
    """The telemetry of one API request and the response headers that name its request id."""
    trace = RequestTrace(core, request.url.path, request_id_from_headers(request.headers), request.headers)
    return trace, {REQUEST_ID_HEADER: trace.request_id}


def _refused(trace: RequestTrace, exc: BaseException, status: int) -> None:
    """Ends the telemetry of a request answered with an error before (or instead of) its run's own end."""
    error = api_error_type(exc) if isinstance(exc, ApiError) else \
        "cancelled" if isinstance(exc, _ClientGone) else error_type_of(exc)
    trace.fail(error, status)
    trace.finish()  # a run that was opened has already finished it (with its usage): then this does nothing


def _sse(body: dict) -> str:
    return f"data: {json.dumps(body, separators=(',', ':'), ensure_ascii=False)}\n\n"


class _ClientGone(Exception):
    """The HTTP client disconnected while its (non-streaming) request ran."""


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _unless_disconnected(request: Request, work: Awaitable):
    """Runs `work`; cancels it when the client disconnects first (raises `_ClientGone`)."""
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
    raise _ClientGone()


MAX_REQUEST_BYTES = 32 << 20  # a JSON body larger than this is refused with 413 before it is parsed


async def _read_json(request: Request):
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_REQUEST_BYTES:
        raise ApiError(413, f"the request body is {declared} bytes; the limit is {MAX_REQUEST_BYTES}",
                       code="request_too_large")
    raw = bytearray()
    async for part in request.stream():
        raw += part
        if len(raw) > MAX_REQUEST_BYTES:  # a body without (or lying about) its length
            raise ApiError(413, f"the request body exceeds {MAX_REQUEST_BYTES} bytes", code="request_too_large")
    raw = bytes(raw)
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise bad_json(exc) from None


class ShutdownClock:
    """When the HTTP server was told to stop: streams still running near the end of its grace period end with an
    OpenAI error event and `[DONE]` instead of being cut off mid-stream."""

    def __init__(self, grace_s: float, margin_s: float = 1.0):
        self.grace_s, self.margin_s = grace_s, margin_s
        self.deadline = asyncio.Event()  # set when streams must wrap up

    def begin(self) -> None:
        asyncio.get_running_loop().call_later(max(0.0, self.grace_s - self.margin_s), self.deadline.set)


SHUTTING_DOWN = "the server is shutting down; the stream ended before its output was complete"


async def _until_shutdown(events: AsyncIterator, clock: ShutdownClock | None) -> AsyncIterator:
    """Yields `events` until they end, or raises a 503 `ApiError` once the shutdown deadline passes."""
    if clock is None:
        async for item in events:
            yield item
        return
    iterator = events.__aiter__()
    deadline = asyncio.ensure_future(clock.deadline.wait())
    try:
        while True:
            step = asyncio.ensure_future(iterator.__anext__())
            await asyncio.wait({step, deadline}, return_when=asyncio.FIRST_COMPLETED)
            if not step.done():
                step.cancel()
                await asyncio.gather(step, return_exceptions=True)
                raise ApiError(503, SHUTTING_DOWN, code="shutting_down")
            try:
                item = step.result()
            except StopAsyncIteration:
                return
            yield item
    finally:
        deadline.cancel()


# -- chat responses ----------------------------------------------------------------------------------------------


def _chat_chunk(run: ChatRun, choices: list[dict], include_usage: bool, usage: dict | None = None) -> str:
    body = {"id": run.id, "object": "chat.completion.chunk", "created": run.created, "model": run.model,
            "choices": choices}
    if include_usage:
        body["usage"] = usage
    return _sse(body)


def _chat_choice_chunks(run: ChatRun, event: ChatEvent, include_usage: bool) -> list[str]:
    tokenizer = run.core.tokenizer
    logprobs = {"content": [chat_logprobs_entry(tokenizer, lp) for lp in event.logprobs]} if event.logprobs else None
    def choice(delta: dict, lp, finish: str | None = None) -> dict:
        out = {"index": event.index, "delta": delta, "logprobs": lp, "finish_reason": finish}
        if finish is not None:
            out["stop_reason"] = event.stop_reason
        return out

    if event.role is not None:
        return [_chat_chunk(run, [choice({"role": event.role, "content": ""}, logprobs)], include_usage)]
    chunks = []
    for delta in event.deltas:
        chunks.append(_chat_chunk(run, [choice(delta.to_openai(), logprobs)], include_usage))
        logprobs = None
    if event.finish_reason is not None:
        chunks.append(_chat_chunk(run, [choice({}, logprobs, event.finish_reason)], include_usage))
    return chunks


async def _chat_stream(run: ChatRun, include_usage: bool, clock: ShutdownClock | None = None) -> AsyncIterator[str]:
    try:
        async for event in _until_shutdown(run.events(), clock):
            for chunk in _chat_choice_chunks(run, event, include_usage):
                yield chunk
        if include_usage:
            u = run.usage()
            yield _chat_chunk(run, [], True, usage_dict(u.prompt_tokens, u.completion_tokens, u.cached_tokens))
        yield "data: [DONE]\n\n"
    except ApiError as exc:
        yield _sse(exc.body())
        yield "data: [DONE]\n\n"
    finally:
        await run.close()


async def _chat_collect(run: ChatRun) -> dict:
    deltas: dict[int, list] = {c.index: [] for c in run.choices}
    logprobs: dict[int, list] = {c.index: [] for c in run.choices}
    finish: dict[int, tuple] = {}
    tokenizer = run.core.tokenizer
    async for event in run.events():
        deltas[event.index].extend(event.deltas)
        logprobs[event.index].extend(chat_logprobs_entry(tokenizer, lp) for lp in event.logprobs)
        if event.finish_reason is not None:
            finish[event.index] = (event.finish_reason, event.stop_reason)
    choices = []
    for index in sorted(deltas):
        message = fold(deltas[index]).to_openai_message()
        if message["content"] is None and "tool_calls" not in message:
            message["content"] = ""
        reason, stop_reason = finish.get(index, ("abort", None))
        choices.append({"index": index, "message": message,
                        "logprobs": {"content": logprobs[index]} if run.plan.request.logprobs else None,
                        "finish_reason": reason, "stop_reason": stop_reason})
    u = run.usage()
    return {"id": run.id, "object": "chat.completion", "created": run.created, "model": run.model,
            "choices": choices, "usage": usage_dict(u.prompt_tokens, u.completion_tokens, u.cached_tokens),
            "system_fingerprint": None}


# -- completion responses ----------------------------------------------------------------------------------------


def _completion_chunk(run: CompletionRun, choices: list[dict], usage: dict | None = None) -> str:
    body = {"id": run.id, "object": "text_completion", "created": run.created, "model": run.model,
            "choices": choices}
    if usage is not None or run.job.include_usage:
        body["usage"] = usage
    return _sse(body)


async def _completion_stream(run: CompletionRun, clock: ShutdownClock | None = None) -> AsyncIterator[str]:
    job, tokenizer = run.job, run.core.tokenizer
    try:
        async for ev in _until_shutdown(run.events(), clock):
            logprobs = completion_logprobs(tokenizer, ev.logprobs, ev.logprob_offset) \
                if job.logprobs is not None else None
            choice = {"index": ev.index, "text": ev.text, "logprobs": logprobs, "finish_reason": ev.finish_reason,
                      "stop_reason": ev.stop_reason}
            if job.return_token_ids:
                choice["token_ids"] = ev.token_ids
            if ev.text or ev.finish_reason is not None or (job.return_token_ids and ev.token_ids):
                yield _completion_chunk(run, [choice])
        if job.include_usage:
            u = run.usage()
            yield _completion_chunk(run, [], usage_dict(u.prompt_tokens, u.completion_tokens, u.cached_tokens))
        yield "data: [DONE]\n\n"
    except ApiError as exc:
        yield _sse(exc.body())
        yield "data: [DONE]\n\n"
    finally:
        await run.close()


async def _completion_collect(run: CompletionRun) -> dict:
    job, tokenizer = run.job, run.core.tokenizer
    texts = {i: "" for i in run.choices}
    lps: dict[int, list] = {i: [] for i in run.choices}
    offsets = {i: 0 for i in run.choices}
    finish: dict[int, tuple] = {}
    async for ev in run.events():
        if not texts[ev.index] and ev.logprob_offset:
            offsets[ev.index] = ev.logprob_offset
        texts[ev.index] += ev.text
        lps[ev.index].extend(ev.logprobs)
        if ev.finish_reason is not None:
            finish[ev.index] = (ev.finish_reason, ev.stop_reason)
    choices = []
    for index in sorted(texts):
        logprobs = completion_logprobs(tokenizer, lps[index], offsets[index]) if job.logprobs is not None else None
        reason, stop_reason = finish.get(index, ("abort", None))
        choice = {"index": index, "text": texts[index], "logprobs": logprobs, "finish_reason": reason,
                  "stop_reason": stop_reason}
        if job.return_token_ids:
            choice["token_ids"] = list(run.choices[index].token_ids)
        choices.append(choice)
    u = run.usage()
    return {"id": run.id, "object": "text_completion", "created": run.created, "model": run.model,
            "choices": choices, "usage": usage_dict(u.prompt_tokens, u.completion_tokens, u.cached_tokens)}


# -- the app -----------------------------------------------------------------------------------------------------


def create_app(config: GatewayConfig, mesh: MeshClient | None = None, tokenizer: KimiTokenizer | None = None,
               core: GatewayCore | None = None, shutdown: ShutdownClock | None = None) -> FastAPI:
    own = core is None
    if core is None:
        core = GatewayCore(config, mesh=mesh, tokenizer=tokenizer)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if own:
            await core.start()
        try:
            yield
        finally:
            if own:
                await core.close()

    app = FastAPI(title="kdamesh gateway", lifespan=lifespan, **_FASTAPI_TELEMETRY)
    app.state.core = core
    metrics = core.metrics

    def count(endpoint: str, status: int) -> None:
        metrics.count_request("rest", endpoint, status)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError):
        return _error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        return _error_response(ApiError(exc.status_code, str(exc.detail), code=None,
                                        type_="invalid_request_error" if exc.status_code < 500 else "server_error"))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception):
        log.exception("unexpected error in %s %s", request.method, request.url.path)
        return _error_response(ApiError(500, f"internal error: {type(exc).__name__}"))

    def principal_of(request: Request):
        return core.authenticate(request.headers.get("authorization"))

    @app.get("/health")
    async def health():
        workers = await core.mesh.health()
        if all(workers.values()):
            status = "ok"
        elif any(ok for address, ok in workers.items() if address in core.mesh.decoders):
            status = "degraded"  # requests are routed around the failing workers
        else:
            status = "unavailable"
        return JSONResponse({"status": status, "workers": workers}, status_code=503 if status == "unavailable" else 200)

    @app.get("/metrics")
    async def prometheus():
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    @app.get("/v1/models")
    async def models(request: Request):
        try:
            principal_of(request)
        except ApiError as exc:
            count("models", exc.status)
            raise
        count("models", 200)
        return {"object": "list", "data": core.model_cards()}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request):
        principal_of(request)
        cards = [c for c in core.model_cards() if model_id in (c["id"], c["root"])]
        if not cards:
            raise not_found_model(model_id)
        return cards[0]

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        trace, ids = _request_trace(core, request)
        try:
            principal = principal_of(request)
            trace.tenant = principal.tenant
            chat = parse_chat(await _read_json(request), core.served)
            run = core.chat(principal, core.plan_chat(chat), trace=trace)
            await _unless_disconnected(request, run.open())
        except ApiError as exc:
            count("chat", exc.status)
            _refused(trace, exc, exc.status)
            return _error_response(exc, ids)
        except _ClientGone as exc:
            count("chat", 499)
            _refused(trace, exc, 499)
            return Response(status_code=499, headers=ids)
        except BaseException as exc:
            _refused(trace, exc, 500)
            raise
        count("chat", 200)
        if chat.stream:
            include_usage = bool(chat.stream_options and chat.stream_options.include_usage)
            return StreamingResponse(_chat_stream(run, include_usage, shutdown), media_type="text/event-stream",
                                     headers={**SSE_HEADERS, **ids}, background=BackgroundTask(run.close))
        try:
            return JSONResponse(await _unless_disconnected(request, _chat_collect(run)), headers=ids)
        except ApiError as exc:
            trace.fail(api_error_type(exc), exc.status)
            return _error_response(exc, ids)
        except _ClientGone:
            trace.fail("cancelled", 499)
            return Response(status_code=499, headers=ids)
        finally:
            await run.close()

    @app.post("/v1/completions")
    async def completions(request: Request):
        trace, ids = _request_trace(core, request)
        try:
            principal = principal_of(request)
            trace.tenant = principal.tenant
            job = parse_completion(await _read_json(request), core.tokenizer, core.served)
            run = core.complete(principal, job, trace=trace)
            await _unless_disconnected(request, run.open())
        except ApiError as exc:
            count("completions", exc.status)
            _refused(trace, exc, exc.status)
            return _error_response(exc, ids)
        except _ClientGone as exc:
            count("completions", 499)
            _refused(trace, exc, 499)
            return Response(status_code=499, headers=ids)
        except BaseException as exc:
            _refused(trace, exc, 500)
            raise
        count("completions", 200)
        if job.stream:
            return StreamingResponse(_completion_stream(run, shutdown), media_type="text/event-stream",
                                     headers={**SSE_HEADERS, **ids}, background=BackgroundTask(run.close))
        try:
            return JSONResponse(await _unless_disconnected(request, _completion_collect(run)), headers=ids)
        except ApiError as exc:
            trace.fail(api_error_type(exc), exc.status)
            return _error_response(exc, ids)
        except _ClientGone:
            trace.fail("cancelled", 499)
            return Response(status_code=499, headers=ids)
        finally:
            await run.close()

    @app.post("/tokenize")
    async def tokenize(request: Request):
        principal_of(request)
        body = parse_tokenize(await _read_json(request), core.served)
        tokens = core.tokenize(body)
        reply = {"tokens": tokens, "count": len(tokens), "max_model_len": core.max_model_len}
        if body.return_token_strs:
            reply["token_strs"] = core.tokenizer.convert_ids_to_tokens(tokens)
        return reply

    @app.post("/detokenize")
    async def detokenize(request: Request):
        principal_of(request)
        body = parse_detokenize(await _read_json(request), core.served, core.tokenizer.vocab_size)
        return {"prompt": core.detokenize(body.tokens)}

    return app


# -- running it --------------------------------------------------------------------------------------------------


def _DrainingServer(clock: ShutdownClock, config):  # noqa: N802 - a class factory (uvicorn imported lazily)
    """A uvicorn server that starts `clock` when told to exit, so running streams end cleanly within the grace."""
    import uvicorn

    class DrainingServer(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            if not self.should_exit:
                clock.begin()
            super().handle_exit(sig, frame)

    return DrainingServer(config)


async def serve(config: GatewayConfig, log_level: str = "info") -> None:
    """Runs the gateway — REST (uvicorn) and, unless `config.grpc_port` is None, the gRPC API — until SIGINT/SIGTERM."""
    import uvicorn

    from gateway.grpc_api import serve_grpc

    core = GatewayCore(config)
    await core.start()
    grpc_server = None
    try:
        if config.grpc_port is not None:
            grpc_server, port = await serve_grpc(core, f"{config.host}:{config.grpc_port}")
            log.info("gateway gRPC API listening on %s:%d", config.host, port)
        clock = ShutdownClock(grace_s=config.shutdown_grace_s)
        app = create_app(config, core=core, shutdown=clock)
        # log_config=None: uvicorn keeps the process's logging (telemetry.logs: text or JSON, with request ids)
        grace_s = max(1, round(config.shutdown_grace_s))  # uvicorn takes whole seconds
        server = _DrainingServer(clock, uvicorn.Config(app, host=config.host, port=config.http_port, log_config=None,
                                                       log_level=log_level.lower(), timeout_graceful_shutdown=grace_s))
        await server.serve()
    finally:
        if grpc_server is not None:
            await grpc_server.stop(config.shutdown_grace_s)
        await core.close()
