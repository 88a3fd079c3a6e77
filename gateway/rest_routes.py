"""The REST API's route handlers (FastAPI), one small function per endpoint; `gateway/app.py` mounts them.

Contract (the endpoints are listed in gateway/app.py):
- A handler finds the `GatewayCore` at `request.app.state.core` (and the `ShutdownClock`, if any, at
  `request.app.state.shutdown`) and raises or returns `ApiError` for every refusal (the OpenAI envelope).
- `/v1/chat/completions` and `/v1/completions` differ only in how they start a run (`_start_chat`,
  `_start_completion`); both then go through `gateway.handler.open_run` and `_respond`: a stream as Server-Sent
  Events (`: keep-alive` comments while the mesh is silent, `--sse-keepalive-s`), else one JSON body; the CPU
  work (JSON decoding, validation, planning, tokenising) runs in the preparation pool (`GatewayCore.prepare`), and a
  client that disconnects while its request is prepared cancels that work (a preparation process is killed);
  every response names the request id (`X-Request-Id`). A client that disconnects
  before its response started cancels the run (499, nothing sent).
- `/metrics` and the API docs (`/openapi.json`, `/docs`, `/redoc`) need a key when keys are configured, unless
  `--public-metrics` / `--public-docs` open them.
"""

from __future__ import annotations

from fastapi import Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from gateway.caps import RequestCaps
from gateway.core import GatewayCore
from gateway.handler import Start, open_run
from gateway.info import tokenizer_info_body, version_body
from gateway.plan import ChatPlan, check_prompt_length
from gateway.protocol import (ApiError, ClientGone, failure_of, not_found_model, parse_chat, parse_completion,
                              parse_detokenize, parse_tokenize)
from gateway.request_trace import RequestTrace
from gateway.rest_io import SSE_HEADERS, decode_json, read_body, read_json, sse_stream, unless_disconnected
from gateway.rest_responses import CHAT, COMPLETION, RestFormat
from gateway.run import Run
from gateway.tenancy import Principal
from telemetry.context import REQUEST_ID_HEADER, request_id_from_headers


def error_response(exc: ApiError, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers={**exc.headers, **(headers or {})})


def _refusal(exc: ApiError | ClientGone, headers: dict[str, str]) -> Response:
    if isinstance(exc, ClientGone):
        return Response(status_code=499, headers=headers)
    return error_response(exc, headers)


def _core(request: Request) -> GatewayCore:
    return request.app.state.core


def _principal(request: Request) -> Principal:
    return _core(request).authenticate(request.headers.get("authorization"))


async def health(request: Request):
    core = _core(request)
    workers = await core.mesh.health()
    if all(workers.values()):
        status = "ok"
    elif any(ok for address, ok in workers.items() if address in core.mesh.decoders):
        status = "degraded"  # requests are routed around the failing workers
    else:
        status = "unavailable"
    identity = {"X-Kdamesh-Instance": core.config.instance_id} if core.config.instance_id else None
    return JSONResponse({"status": status, "workers": workers, "max_model_len": core.max_model_len},
                        status_code=503 if status == "unavailable" else 200, headers=identity)


def _unless_public(request: Request, public: bool) -> None:
    """401 unless `public` or the request has a key (an open gateway lets everyone in)."""
    if not public:
        _principal(request)


async def prometheus(request: Request):
    core = _core(request)
    _unless_public(request, core.config.public_metrics)
    relay = core.config.relay_worker_metrics
    pools = {"decode": {a: w.channel for a, w in core.mesh.decoders.items()},
             "prefill": {a: w.channel for a, w in core.mesh.prefillers.items()}} if relay else {}
    body, content_type = await core.metrics.render_mesh(pools)
    return Response(body, media_type=content_type)


async def openapi_json(request: Request):
    _unless_public(request, _core(request).config.public_docs)
    return JSONResponse(request.app.openapi())


async def swagger_docs(request: Request):
    _unless_public(request, _core(request).config.public_docs)
    return get_swagger_ui_html(openapi_url="/openapi.json", title=f"{request.app.title} - docs")


async def redoc_docs(request: Request):
    _unless_public(request, _core(request).config.public_docs)
    return get_redoc_html(openapi_url="/openapi.json", title=f"{request.app.title} - ReDoc")


async def models(request: Request):
    core = _core(request)
    try:
        _principal(request)
    except ApiError as exc:
        core.metrics.count_request("rest", "models", exc.status)
        raise
    core.metrics.count_request("rest", "models", 200)
    return {"object": "list", "data": core.model_cards()}


async def model(model_id: str, request: Request):
    _principal(request)
    cards = [c for c in _core(request).model_cards() if model_id in (c["id"], c["root"])]
    if not cards:
        raise not_found_model(model_id)
    return cards[0]


async def tokenize(request: Request):
    core = _core(request)
    _principal(request)
    raw = await read_body(request)
    body = await core.prepare(_parsed, parse_tokenize, raw, core.served, size=len(raw))
    tokens = await core.tokenize(body, len(raw))
    reply = {"tokens": tokens, "count": len(tokens), "max_model_len": core.max_model_len}
    if body.return_token_strs:
        reply["token_strs"] = core.tokenizer.convert_ids_to_tokens(tokens)
    return reply


async def detokenize(request: Request):
    core = _core(request)
    _principal(request)
    body = parse_detokenize(await read_json(request), core.served, core.tokenizer.vocab_size)
    return {"prompt": core.detokenize(body.tokens)}


async def version(request: Request):
    return version_body()


async def tokenizer_info(request: Request):
    core = _core(request)
    _principal(request)
    return tokenizer_info_body(core.tokenizer, core.max_model_len)


async def chat_completions(request: Request):
    async def start(principal: Principal, trace: RequestTrace) -> Run:
        core = _core(request)
        raw = await read_body(request)

        async def plan() -> ChatPlan:
            chat = await core.prepare(_parsed, parse_chat, raw, core.served, size=len(raw))
            return await core.plan_chat(chat, len(raw))

        return core.chat(principal, await unless_disconnected(request, plan()), trace=trace)

    return await _respond(request, "chat", start, CHAT)


async def completions(request: Request):
    async def start(principal: Principal, trace: RequestTrace) -> Run:
        core = _core(request)
        raw = await read_body(request)
        job = await unless_disconnected(request, core.prepare(_checked_completion, raw, core.tokenizer, core.served,
                                                              core.caps, core.max_model_len, size=len(raw)))
        return core.complete(principal, job, trace=trace)

    return await _respond(request, "completions", start, COMPLETION)


def _parsed(parse, raw: bytes, *args):
    """`parse(decoded body, *args)`: a request's CPU work up to its validated form (run in the preparation pool)."""
    return parse(decode_json(raw), *args)


def _checked_completion(raw: bytes, tokenizer, served: set[str], caps: RequestCaps, limit: int | None):
    """The completion job of a body, its prompts already held to the caps and the context length (`limit`), so a
    refused 10 MB prompt's millions of ids never travel back from a preparation process (`GatewayCore.complete`
    checks the same again)."""
    job = _parsed(parse_completion, raw, tokenizer, served)
    caps.check([len(p) for p in job.prompts], job.request.n, "prompt")
    for prompt in job.prompts:
        check_prompt_length(len(prompt), job.max_tokens, limit, "prompt")
    return job


async def _respond(request: Request, endpoint: str, start: Start, fmt: RestFormat) -> Response:
    """Opens the run (`open_run`) and answers with its stream or its whole response."""
    core = _core(request)
    trace = core.trace(request.url.path, request_id_from_headers(request.headers), request.headers)
    ids = {REQUEST_ID_HEADER: trace.request_id}
    try:
        run = await open_run(core, trace, "rest", endpoint, request.headers.get("authorization"), start,
                             lambda opening: unless_disconnected(request, opening))
    except (ApiError, ClientGone) as exc:
        return _refusal(exc, ids)
    if run.stream:
        stream = sse_stream(run, fmt, request.app.state.shutdown, core.config.sse_keepalive_s)
        return StreamingResponse(stream, media_type="text/event-stream",
                                 headers={**SSE_HEADERS, **ids}, background=BackgroundTask(run.close))
    try:
        return JSONResponse(await unless_disconnected(request, fmt.collect(run)), headers=ids)
    except (ApiError, ClientGone) as exc:
        trace.fail(*failure_of(exc))
        return _refusal(exc, ids)
    finally:
        await run.close()
