"""The gateway's REST front (FastAPI): the OpenAI-compatible API over the mesh.

Contract:
- `create_app(config, mesh=None, tokenizer=None, core=None, shutdown=None)` builds the app over a `GatewayCore`
  (gateway/core.py: the pipeline shared with the gRPC API). Without `core` it makes one; a core the app made is
  started and closed by the app's lifespan (a given core is the caller's to start and close). `shutdown` (a
  `gateway.rest_io.ShutdownClock`) lets running streams end cleanly when the server stops.
- `GET /health`: `{"status", "workers": {address: serving}, "max_model_len"}` — 200 "ok" when every mesh worker
  reports SERVING, 200 "degraded" when some do not but a decode worker does (requests are routed around the
  others), else 503 "unavailable"; `max_model_len` is null until a worker has reported its context length (until
  then requests get 503 "retry shortly": `kdamesh up` waits for it before it prints its endpoints).
  `GET /metrics`: Prometheus text format (gateway/metrics.py): the gateway's series and its workers'; `HEAD
  /metrics` and `HEAD /health` answer as GET without a body (scrapers such as aiperf probe with HEAD).
- With API keys configured (`KDAMESH_API_KEYS`, `--api-keys-file`) every endpoint but `/health` needs
  `Authorization: Bearer <key>` (401 otherwise) — `/metrics` and the docs (`/openapi.json`, `/docs`, `/redoc`)
  too, unless `--public-metrics` / `--public-docs` open them; without keys the gateway is open (logged at start-up).
- `GET /v1/models`, `GET /v1/models/{id}`: the served model (with `max_model_len`).
- `POST /v1/chat/completions`: OpenAI chat completions with vLLM's extras (gateway/protocol/chat.py): streaming
  as `chat.completion.chunk` Server-Sent Events (the role in each choice's first delta, `finish_reason` only in its
  last chunk, `data: [DONE]` at the end, a `choices: []` usage trailer with `stream_options.include_usage`),
  reasoning as both `reasoning_content` and `reasoning`, tool calls (`tools`, `tool_choice` auto/none/required/named
  with `--enable-auto-tool-choice`), `response_format` (json_object / json_schema, enforced by the engine's
  grammar), `logprobs` / `top_logprobs`, `n`, `seed`, `stop`, `max_tokens` / `max_completion_tokens`, `user`,
  `priority`, `chat_template_kwargs`, `cache_salt` (mixed into the tenant's salt).
- `POST /v1/completions` (OpenAI legacy completions, vLLM's extra sampling fields; gateway/protocol/completions.py):
  `prompt` as text, texts, token ids or lists of them; `n` choices per prompt (index = prompt index * n + i);
  `echo`, `logprobs`, `stop`, `seed`, `stream` (+ `stream_options.include_usage`), `return_token_ids`.
- `POST /tokenize` (`prompt`, or chat `messages`) -> `{"tokens", "count", "max_model_len"}`;
  `POST /detokenize` (`tokens`) -> `{"prompt"}` (vLLM's shapes); `GET /tokenizer_info` (the tokenizer's config,
  gateway/info.py) and `GET /version` (`{"version"}`, no API key needed), as vLLM.
- `POST /v1/responses`, `GET` / `DELETE /v1/responses/{id}`: the OpenAI Responses API (gateway/responses/), and
  `POST /v1/messages`, `POST /v1/messages/count_tokens`: the Anthropic Messages API (gateway/anthropic/, its own
  error envelope, `x-api-key`), both translated onto the chat path; the store of `store: true` responses is
  `app.state.responses` (`--responses-store-size`, `--responses-store-mib`).
- `GET /openapi.json` documents every endpoint, with the request body schema of each POST endpoint (the pydantic
  models that validate them, `BODIES`: `gateway.protocol.REQUEST_BODIES` and the translated APIs') and every status
  and media type it answers with (gateway/openapi_responses.py).
- Errors use the OpenAI envelope `{"error": {"message", "type", "param", "code"}}`: a body not declared
  `application/json` 415, malformed JSON (or nested deeper than 64) or fields 400 (strict JSON types; numbers in
  the ranges of the mesh's fields), a request over a per-request cap 400 (prompts, n × prompts) or 413 (prompt
  tokens; see docs/api.md), a prompt beyond the context 400 `context_length_exceeded`, missing/invalid key 401,
  unknown model 404, a body over 32 MiB 413, over a tenant's quota 429 with `Retry-After`, mesh unavailable 503,
  deadline 504 (a mesh failure's message is generic, with the request id: never a worker's address or message).
  Never a 500 for bad input; a bug is a logged 500 `internal_error` and the connection stays open
  (gateway/rest_guard.py). A stream reports an error that happens before its first token as a plain HTTP error; one after is sent as
  a final `data: {"error": …}` before `data: [DONE]`.
- A client that disconnects (streaming or not) cancels its mesh calls: decode aborts the request and frees its
  memory.
- Telemetry of `/v1/chat/completions` and `/v1/completions` (`RequestTrace`, gateway/request_trace.py): the request
  id is the client's `X-Request-Id` when usable, else a new one, and is returned in the `X-Request-Id` response
  header; the root span `chat {model}` / `text_completion {model}` continues an incoming W3C `traceparent`; one
  access line per request (`kdamesh.request` logger) when it ends — after the last streamed chunk for a stream.
"""

from __future__ import annotations

import inspect
import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from pydantic.json_schema import models_json_schema
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.tokenizer import KimiTokenizer
from gateway import rest_routes
from gateway.anthropic import routes as anthropic_routes
from gateway.anthropic.protocol import CountTokensRequest, MessagesRequest
from gateway.config import MODES, GatewayConfig  # noqa: F401  (re-exported: deploy/serve.py, tests)
from gateway.core import GatewayCore
from gateway.mesh_client import MeshClient
from gateway.openapi_responses import response_class, route_responses
from gateway.protocol import REQUEST_BODIES, ApiError
from gateway.responses import routes as responses_routes
from gateway.responses.protocol import ResponsesRequest
from gateway.responses.store import ResponseStore
from gateway.rest_guard import ContainErrors
from gateway.rest_io import ShutdownClock
from gateway.rest_routes import error_response

log = logging.getLogger(__name__)

# FastAPI's own OpenTelemetry spans (newer versions record them by default) are off: each API request has one SERVER
# span, the gateway's GenAI root span (RequestTrace), which continues the client's `traceparent` itself.
_FASTAPI_TELEMETRY = ({"telemetry": {"tracing": False, "metrics": False, "logs": False, "operation_spans": False}}
                      if "telemetry" in inspect.signature(FastAPI.__init__).parameters else {})
SCHEMA_REF = "#/components/schemas/{model}"
DOCS = ("/openapi.json", "/docs", "/redoc")
HEAD_TOO = ("/metrics", "/health")  # GET routes that probes reach with HEAD
# (method, path, handler): the request bodies of the POST routes are documented from REQUEST_BODIES
ROUTES = (("GET", "/health", rest_routes.health), ("GET", "/metrics", rest_routes.prometheus),
          ("GET", "/openapi.json", rest_routes.openapi_json), ("GET", "/docs", rest_routes.swagger_docs),
          ("GET", "/redoc", rest_routes.redoc_docs),
          ("GET", "/v1/models", rest_routes.models), ("GET", "/v1/models/{model_id:path}", rest_routes.model),
          ("POST", "/v1/chat/completions", rest_routes.chat_completions),
          ("POST", "/v1/completions", rest_routes.completions), ("POST", "/tokenize", rest_routes.tokenize),
          ("POST", "/detokenize", rest_routes.detokenize), ("GET", "/version", rest_routes.version),
          ("GET", "/tokenizer_info", rest_routes.tokenizer_info),
          ("POST", "/v1/responses", responses_routes.create_response),
          ("GET", "/v1/responses/{response_id}", responses_routes.get_response),
          ("DELETE", "/v1/responses/{response_id}", responses_routes.delete_response),
          ("POST", "/v1/messages", anthropic_routes.messages),
          ("POST", "/v1/messages/count_tokens", anthropic_routes.count_tokens))
# The request body models of every POST route (the OpenAI ones, gateway.protocol, and the translated APIs').
BODIES = {**REQUEST_BODIES, "/v1/responses": (ResponsesRequest,), "/v1/messages": (MessagesRequest,),
          "/v1/messages/count_tokens": (CountTokensRequest,)}


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

    # the docs are the gateway's own routes (ROUTES), so that they can need a key
    app = FastAPI(title="kdamesh gateway", lifespan=lifespan, openapi_url=None, docs_url=None, redoc_url=None,
                  **_FASTAPI_TELEMETRY)
    app.state.core, app.state.shutdown = core, shutdown
    app.state.responses = ResponseStore(config.responses_store_size, config.responses_store_mib << 20)
    _add_error_handlers(app)
    for method, path, handler in ROUTES:
        body = _request_body(BODIES[path]) if path in BODIES and method == "POST" else None
        for verb in (method, "HEAD") if path in HEAD_TOO else (method,):
            app.add_api_route(path, handler, methods=[verb], openapi_extra=body, include_in_schema=path not in DOCS,
                              response_class=response_class(path), responses=route_responses(verb, path))
    app.openapi = lambda: _openapi(app)
    return app


def _add_error_handlers(app: FastAPI) -> None:
    async def api_error(request: Request, exc: ApiError):
        return error_response(exc)

    async def http_error(request: Request, exc: StarletteHTTPException):
        return error_response(ApiError(exc.status_code, str(exc.detail), code=None,
                                       type_="invalid_request_error" if exc.status_code < 500 else "server_error"))

    app.add_exception_handler(ApiError, api_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_middleware(ContainErrors)  # anything else: a logged 500, the connection kept (gateway/rest_guard.py)


def _request_body(models: tuple) -> dict:
    """The OpenAPI `requestBody` of a POST route whose JSON body is one of `models` (validated by the handler)."""
    refs = [{"$ref": SCHEMA_REF.format(model=m.__name__)} for m in models]
    schema = refs[0] if len(refs) == 1 else {"oneOf": refs}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def _openapi(app: FastAPI) -> dict:
    """FastAPI's schema of the routes, plus the request body models under `components.schemas`."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        models = sorted({m for bodies in BODIES.values() for m in bodies}, key=lambda m: m.__name__)
        _, definitions = models_json_schema([(m, "validation") for m in models], ref_template=SCHEMA_REF)
        schema.setdefault("components", {}).setdefault("schemas", {}).update(definitions.get("$defs", {}))
        app.openapi_schema = schema
    return app.openapi_schema


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
