"""Exceptions of the kdamesh SDK: one class per gRPC status the gateway answers with.

`from_rpc_error(error)` maps a `grpc.RpcError` to the matching `KdameshError` subclass:

| gRPC status | exception | REST twin |
| --- | --- | --- |
| INVALID_ARGUMENT, OUT_OF_RANGE, FAILED_PRECONDITION | `InvalidRequest` | 400 |
| UNAUTHENTICATED | `Unauthenticated` | 401 |
| PERMISSION_DENIED | `PermissionDenied` | 403 |
| NOT_FOUND | `NotFound` | 404 |
| RESOURCE_EXHAUSTED | `RateLimited` (`retry_after` seconds, from the `retry-after` trailer) | 429 |
| UNAVAILABLE | `Unavailable` (retried by the clients) | 503 |
| DEADLINE_EXCEEDED | `DeadlineExceeded` | 504 |
| CANCELLED | `Cancelled` | 499 |
| anything else | `InternalError` | 500 |
"""

from __future__ import annotations

import grpc


class KdameshError(Exception):
    """A call failed; `code` is the gRPC status code, `message` the server's explanation."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message


class InvalidRequest(KdameshError):
    """The request is malformed or out of range (including a prompt beyond the context length)."""


class Unauthenticated(KdameshError):
    """No API key, or one the gateway does not know."""


class PermissionDenied(KdameshError):
    pass


class NotFound(KdameshError):
    """Unknown model."""


class RateLimited(KdameshError):
    """The tenant is over a limit; retry after `retry_after` seconds (None when the server gave no hint)."""

    def __init__(self, code: grpc.StatusCode, message: str, retry_after: float | None = None):
        super().__init__(code, message)
        self.retry_after = retry_after


class Unavailable(KdameshError):
    """The gateway or the mesh behind it cannot serve now (retried with backoff before it is raised)."""


class DeadlineExceeded(KdameshError):
    pass


class Cancelled(KdameshError):
    pass


class InternalError(KdameshError):
    pass


_BY_CODE = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidRequest, grpc.StatusCode.OUT_OF_RANGE: InvalidRequest,
    grpc.StatusCode.FAILED_PRECONDITION: InvalidRequest, grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied, grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.RESOURCE_EXHAUSTED: RateLimited, grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded, grpc.StatusCode.CANCELLED: Cancelled,
}


def _retry_after(error: grpc.RpcError) -> float | None:
    try:
        trailers = error.trailing_metadata() or ()
    except Exception:  # some error objects carry no call
        return None
    for key, value in trailers:
        if key.lower() == "retry-after":
            try:
                return float(value)
            except ValueError:
                return None
    return None


def from_rpc_error(error: grpc.RpcError) -> KdameshError:
    code = error.code() if callable(getattr(error, "code", None)) else grpc.StatusCode.UNKNOWN
    message = (error.details() if callable(getattr(error, "details", None)) else None) or code.name
    cls = _BY_CODE.get(code, InternalError)
    if cls is RateLimited:
        return RateLimited(code, message, _retry_after(error))
    return cls(code, message)
