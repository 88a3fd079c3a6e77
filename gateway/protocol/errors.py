"""The OpenAI error envelope of the gateway and how other failures map onto it.

Contract:
- `ApiError(status, message, param, code, type_, headers)` is the only error a request handler raises for a request
  it refuses or that failed; `body()` is the OpenAI envelope `{"error": {"message", "type", "param", "code"}}`,
  `headers` go on the HTTP response (e.g. `Retry-After`), `grpc_code` is the status of the public gRPC API.
- `mesh_api_error(code, message, prompt_param, request_id)`: the error of a failed mesh call (the worker's gRPC
  status mapped to HTTP by `HTTP_STATUS`; a context-length refusal is 400 `context_length_exceeded` naming the prompt
  field); its message is generic (`MESH_MESSAGES` + the request id), never the worker's.
- `internal_error(request_id)`: the 500 `internal_error` of a bug, naming only the request id.
- `validation_error(exc)`: a pydantic `ValidationError` as a 400 naming the first bad field as `param`.
- `api_error_type(exc)`: the `error.type` telemetry records for a refused or failed request; `failure_of(exc)` is
  the one mapping of any exception to the (`error.type`, HTTP status) a request records: an `ApiError` its own,
  `ClientGone` (the HTTP client disconnected) and cancellation 499 "cancelled", anything else 500.
"""

from __future__ import annotations

import asyncio

import grpc
from pydantic import ValidationError

from telemetry.tracing import error_type_of

HTTP_STATUS = {grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.OUT_OF_RANGE: 400,
               grpc.StatusCode.FAILED_PRECONDITION: 400, grpc.StatusCode.NOT_FOUND: 404,
               grpc.StatusCode.UNIMPLEMENTED: 501, grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
               grpc.StatusCode.DEADLINE_EXCEEDED: 504, grpc.StatusCode.UNAVAILABLE: 503,
               grpc.StatusCode.CANCELLED: 499, grpc.StatusCode.UNAUTHENTICATED: 401,
               grpc.StatusCode.PERMISSION_DENIED: 403}
GRPC_CODE = {400: grpc.StatusCode.INVALID_ARGUMENT, 401: grpc.StatusCode.UNAUTHENTICATED,
             403: grpc.StatusCode.PERMISSION_DENIED, 404: grpc.StatusCode.NOT_FOUND,
             413: grpc.StatusCode.INVALID_ARGUMENT, 429: grpc.StatusCode.RESOURCE_EXHAUSTED,
             499: grpc.StatusCode.CANCELLED, 501: grpc.StatusCode.UNIMPLEMENTED,
             503: grpc.StatusCode.UNAVAILABLE, 504: grpc.StatusCode.DEADLINE_EXCEEDED}
# Seconds a client is told to wait (Retry-After) when the mesh has no serving worker for it (503).
RETRY_AFTER_S = "5"

# What a client is told when a mesh call fails with this HTTP status (the worker's detail stays in the log).
MESH_MESSAGES = {400: "the model server refused the request", 401: "the model server refused the request",
                 403: "the model server refused the request", 404: "the model server does not know the request",
                 429: "the model server is overloaded; retry later", 499: "the request was cancelled",
                 501: "the model server does not support the request",
                 503: "no model server is available; retry later", 504: "the request ran past its deadline",
                 500: "the model server failed"}
# pydantic names the union member it tried in an error's location ("str", "NamedToolChoice", ...): not a field
_UNION_MEMBERS = ("str", "int", "float", "bool", "list", "dict", "NamedToolChoice")


class ApiError(Exception):
    """A request failed with an HTTP status; `body()` is the OpenAI error envelope."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type_ or ("invalid_request_error" if status < 500 else "server_error")
        self.headers = headers or {}

    def __reduce__(self):  # pickled by the preparation processes (gateway/prep_procs.py)
        return (ApiError, (self.status, self.message, self.param, self.code, self.type, self.headers))

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    @property
    def grpc_code(self) -> grpc.StatusCode:
        return GRPC_CODE.get(self.status, grpc.StatusCode.INTERNAL)


class ClientGone(Exception):
    """The client disconnected while its request ran (HTTP: before its response started)."""


def api_error_type(exc: ApiError) -> str:
    """The `error.type` of a refused or failed request: the error's code, else its type."""
    return exc.code or exc.type


def failure_of(exc: BaseException) -> tuple[str, int]:
    """The (`error.type`, HTTP status) a request that failed with `exc` records."""
    if isinstance(exc, ApiError):
        return api_error_type(exc), exc.status
    if isinstance(exc, (ClientGone, asyncio.CancelledError)):
        return "cancelled", 499
    return error_type_of(exc), 500


def mesh_api_error(code: grpc.StatusCode, message: str, prompt_param: str = "prompt",
                   request_id: str | None = None) -> ApiError:
    """The REST error of a failed mesh call (gRPC status of the worker); `prompt_param` names the prompt field
    ("prompt" or "messages") in a context-length error. The worker's own message is only passed on for a
    context-length refusal (it names token counts); otherwise the client gets the generic message of the status
    (`MESH_MESSAGES`) and the request id — never a worker's address or a raw gRPC message (the caller logs those)."""
    status = HTTP_STATUS.get(code, 500)
    if "maximum context length" in message:
        return ApiError(400, message, param=prompt_param, code="context_length_exceeded")
    retry = {"Retry-After": RETRY_AFTER_S} if status == 503 else None  # a worker is down (restarting): come back
    generic = MESH_MESSAGES.get(status, MESH_MESSAGES[500])
    return ApiError(status, f"{generic} (request id {request_id})" if request_id else generic,
                    code=code.name.lower(), headers=retry)


def internal_error(request_id: str) -> ApiError:
    """The 500 of a bug: the client learns only the request id (the detail goes to the log)."""
    return ApiError(500, f"internal server error (request id {request_id})", code="internal_error")


def not_found_model(model: str) -> ApiError:
    return ApiError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found",
                    type_="NotFoundError")


def bad_json(exc: Exception) -> ApiError:
    return ApiError(400, f"the request body is not valid JSON: {exc}", code="invalid_json")


def validation_error(exc: ValidationError) -> ApiError:
    """The 400 of a request body pydantic refused: the first error, its location kept to field names and indices."""
    first = exc.errors(include_url=False)[0]
    loc = [str(p) for p in first.get("loc", ()) if isinstance(p, int) or str(p).isidentifier()]
    loc = [p for p in loc if p not in _UNION_MEMBERS]
    message = first.get("msg", "invalid request")
    if message.startswith("Value error, "):
        message = message[len("Value error, "):]
    where = f"'{'.'.join(loc)}': " if loc else ""
    return ApiError(400, f"{where}{message}", param=loc[0] if loc else None)
