"""The responses each REST route declares in `/openapi.json`: every status it can answer with, in the media type it
answers with (checked against the running gateway by schemathesis' conformance checks,
tests/integration/test_fuzz_gateway.py).

Contract:
- `route_responses(method, path)` -> FastAPI's `responses` for the route: each status of `STATUSES[path]` beside
  200, described, with the OpenAI error envelope (`ErrorResponse`) for the errors. `SUCCESS_MEDIA[path]` names the
  200 media types other than JSON (`/metrics` is Prometheus text; the completions answer JSON or, with `stream`,
  Server-Sent Events). A HEAD operation has no bodies.
- `response_class(path)`: the class whose media type FastAPI declares for the 200 (PlainTextResponse for
  `/metrics`, JSONResponse otherwise).
- `ERROR_SCHEMA` is the envelope: `{"error": {"message", "type", "param", "code"}}`
  (gateway/protocol/errors.py `ApiError.body`).
The statuses follow the handlers: a key is needed everywhere but `/health` and `/version` when keys are configured
(401; `/metrics` and the docs unless made public); a body not declared JSON 415, malformed 400, too large 413, an
unknown model 404, a tenant over its quota 429, the mesh unavailable 503 or past its deadline 504, a bug 500.
"""

from __future__ import annotations

from fastapi.responses import JSONResponse, PlainTextResponse

ERROR_SCHEMA = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type"],
    "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                   "param": {"type": ["string", "null"]}, "code": {"type": ["string", "integer", "null"]}}}}}

DESCRIPTIONS = {400: "Malformed JSON, an invalid field, or a request over a per-request cap",
                401: "Missing or invalid API key", 404: "Unknown model", 413: "Body or prompt too large",
                415: "Body not declared application/json", 429: "Over the tenant's quota (Retry-After)",
                500: "Internal error (logged)", 503: "No model server available (Retry-After)",
                504: "Past the request's deadline"}
_GENERATION = (400, 401, 404, 413, 415, 429, 500, 503, 504)
STATUSES: dict[str, tuple[int, ...]] = {
    "/health": (503,), "/metrics": (401,), "/v1/models": (401,), "/v1/models/{model_id}": (401, 404),
    "/v1/chat/completions": _GENERATION, "/v1/completions": _GENERATION,
    "/tokenize": (400, 401, 404, 413, 415, 500), "/detokenize": (400, 401, 404, 413, 415, 500),
    "/version": (), "/tokenizer_info": (401,),
    # the translated APIs (gateway/responses, gateway/anthropic): their own error bodies carry the same `error` object
    "/v1/responses": _GENERATION, "/v1/responses/{response_id}": (401, 404),
    "/v1/messages": _GENERATION, "/v1/messages/count_tokens": (400, 401, 404, 413, 415, 429, 500)}
SUCCESS_MEDIA = {"/v1/chat/completions": ("text/event-stream",), "/v1/completions": ("text/event-stream",),
                 "/v1/responses": ("text/event-stream",), "/v1/messages": ("text/event-stream",)}
HEALTH_SCHEMA = {"type": "object", "required": ["status", "workers"], "properties": {
    "status": {"type": "string", "enum": ["ok", "degraded", "unavailable"]},
    "workers": {"type": "object", "additionalProperties": {"type": "boolean"}},
    "max_model_len": {"type": ["integer", "null"]}}}


def _schema_path(path: str) -> str:
    return path.replace("{model_id:path}", "{model_id}")


def response_class(path: str) -> type:
    return PlainTextResponse if path == "/metrics" else JSONResponse


def route_responses(method: str, path: str) -> dict:
    path = _schema_path(path)
    if method == "HEAD":
        return {200: {"description": "The headers of GET, no body"}}
    responses: dict = {}
    extra = SUCCESS_MEDIA.get(path, ())
    if extra:
        responses[200] = {"content": {media: {"schema": {}} for media in extra}}  # SSE: each event a JSON chunk
    for status in STATUSES.get(path, ()):
        schema = HEALTH_SCHEMA if path == "/health" else ERROR_SCHEMA
        responses[status] = {"description": DESCRIPTIONS.get(status, "Unavailable"),
                             "content": {"application/json": {"schema": schema}}}
    return responses
