"""gRPC (`grpc.aio`) interceptors: W3C trace context and the request id across services, per-call status counts, and
an access log line.

Contract:
- `server_interceptors(service, ...)` -> the list for `grpc.aio.server(interceptors=...)`: one `ServerCallInterceptor`
  that, for every call,
  - continues the caller's trace from the call metadata (`traceparent`/`tracestate`, through OpenTelemetry's
    configured propagator: W3C trace context by default) with a SERVER span named `package.Service/Method`
    (attributes `rpc.system`, `rpc.service`, `rpc.method`, `rpc.grpc.status_code`; `error.type` and the ERROR status
    for the server-error codes UNKNOWN, DEADLINE_EXCEEDED, UNIMPLEMENTED, INTERNAL, UNAVAILABLE, DATA_LOSS), current
    while the handler runs;
  - binds the call's `x-request-id` metadata as the request id of the handler (`telemetry.context`);
  - counts the call in `RpcMetrics` (`requests_total{method, status}` with the final gRPC status name,
    `requests_in_flight{method}`, optionally `rpc_seconds{method}`);
  - logs one access line on the `kdamesh.rpc` logger at `access_log_level` (fields `rpc.service`, `rpc.method`,
    `rpc.status`, `rpc.duration_ms`, `rpc.server`).
  Health checks and reflection pass through untouched.
- `client_interceptors(...)` -> the list for `grpc.aio.insecure_channel(..., interceptors=...)`: every call carries the
  current trace context (`traceparent`) and the current request id (`x-request-id`, unless the call sets one) in its
  metadata. They only add metadata and return the call unchanged, so cancellation, `read()` and `cancel()` behave as
  without them; spans are the servers' (parented on the caller's current span).
- A status is the code the handler aborted with, the code it set, OK when it returned, CANCELLED when it was
  cancelled (client gone, deadline, server stopping) and UNKNOWN for any other exception.

Why not opentelemetry-instrumentation-grpc's aio interceptors: its streaming wrappers keep a span current across
`yield`, which logs "Failed to detach context" whenever gRPC finalizes an abandoned stream from another task
(opentelemetry-python-contrib#2357), and its aio client interceptors change the returned call objects (a wrapping
generator for streams, awaited calls for unary ones; cancellation issues in #3271). Here, a context a generator
attached is detached only where it was attached (`tracing.detach`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import grpc
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind, Status, StatusCode, TracerProvider

from telemetry import tracing
from telemetry.context import (REQUEST_ID_METADATA, bind_request_id, current_request_id, request_id_from_metadata,
                               reset_request_id)
from telemetry.metrics import RpcMetrics

ACCESS_LOGGER = "kdamesh.rpc"
SERVER_ERROR_CODES = frozenset({grpc.StatusCode.UNKNOWN, grpc.StatusCode.DEADLINE_EXCEEDED,
                                grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.INTERNAL,
                                grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DATA_LOSS})
_PASS_THROUGH = ("grpc.health.v1.Health", "grpc.reflection.")


def _split(method: str | bytes) -> tuple[str, str]:
    """'/pkg.Service/Method' -> ('pkg.Service', 'Method')."""
    if isinstance(method, bytes):
        method = method.decode()
    service, _, name = method.lstrip("/").rpartition("/")
    return service, name


def _passes_through(service: str) -> bool:
    return service.startswith(_PASS_THROUGH)


# -- server ---------------------------------------------------------------------------------------------------------


def server_interceptors(service: str, *, tracer_provider: TracerProvider | None = None,
                        metrics: RpcMetrics | None = None,
                        access_log_level: int = logging.INFO) -> list[grpc.aio.ServerInterceptor]:
    """The interceptors of a kdamesh gRPC server (see the module docstring). `service` names the server in log lines
    ("cache", "prefill", "decode"); `tracer_provider` None: OpenTelemetry's global provider."""
    return [ServerCallInterceptor(service, metrics, access_log_level,
                                  tracing.get_tracer("kdamesh.rpc", tracer_provider))]


def _status(context, exc: BaseException | None) -> grpc.StatusCode:
    if exc is None or isinstance(exc, grpc.aio.AbortError):
        code = context.code()
        if isinstance(code, grpc.StatusCode):
            return code
        return grpc.StatusCode.OK if exc is None else grpc.StatusCode.UNKNOWN
    if isinstance(exc, (asyncio.CancelledError, GeneratorExit)):
        return grpc.StatusCode.CANCELLED
    return grpc.StatusCode.UNKNOWN


class _Call:
    """One call's span, request id, in-flight gauge, status count and access line."""

    def __init__(self, interceptor: ServerCallInterceptor, method: str, metadata, context):
        self.interceptor = interceptor
        self.service, self.method = _split(method)
        self.started = time.perf_counter()
        carrier = {}
        for item in metadata or ():
            key, value = (item.key, item.value) if hasattr(item, "key") else item
            if isinstance(value, str):
                carrier[key] = value
        self.request_id = request_id_from_metadata(metadata)
        self.span = interceptor.tracer.start_span(
            f"{self.service}/{self.method}", context=propagate.extract(carrier), kind=SpanKind.SERVER,
            attributes={"rpc.system": "grpc", "rpc.service": self.service, "rpc.method": self.method})
        self._span_token = otel_context.attach(trace.set_span_in_context(self.span))
        self._id_token = bind_request_id(self.request_id)
        if interceptor.metrics is not None:
            interceptor.metrics.in_flight.labels(self.method).inc()

    def finish(self, context, exc: BaseException | None) -> None:
        status = _status(context, exc)
        elapsed = time.perf_counter() - self.started
        interceptor = self.interceptor
        metrics = interceptor.metrics
        if metrics is not None:
            metrics.in_flight.labels(self.method).dec()
            metrics.requests.labels(self.method, status.name).inc()
            if metrics.seconds is not None:
                metrics.seconds.labels(self.method).observe(elapsed)
        if interceptor.logger.isEnabledFor(interceptor.level):
            request_id = current_request_id() or self.request_id  # the handler may have bound the request's own id
            interceptor.logger.log(
                interceptor.level, "%s/%s %s %.1f ms", self.service, self.method, status.name, elapsed * 1e3,
                extra={"request_id": request_id,
                       "rpc": {"service": self.service, "method": self.method, "status": status.name,
                               "duration_ms": round(elapsed * 1e3, 3), "server": interceptor.service}})
        self.span.set_attribute("rpc.grpc.status_code", status.value[0])
        if status in SERVER_ERROR_CODES:
            self.span.set_attribute(tracing.ERROR_TYPE, status.name)
            details = context.details() if exc is None or isinstance(exc, grpc.aio.AbortError) else str(exc)
            self.span.set_status(Status(StatusCode.ERROR, details or None))
        self.span.end()
        tracing.detach(self._span_token)
        _reset_quietly(self._id_token)


def _reset_quietly(token) -> None:
    try:
        reset_request_id(token)
    except ValueError:
        pass  # set in another context (a stream finalized by another task): nothing to restore here


class ServerCallInterceptor(grpc.aio.ServerInterceptor):
    """Trace context, request id, status counts and the access log of every call (see the module docstring)."""

    def __init__(self, service: str, metrics: RpcMetrics | None = None, access_log_level: int = logging.INFO,
                 tracer: trace.Tracer | None = None):
        self.service = service
        self.metrics = metrics
        self.level = access_log_level
        self.logger = logging.getLogger(ACCESS_LOGGER)
        self.tracer = tracer if tracer is not None else tracing.get_tracer("kdamesh.rpc")

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or _passes_through(_split(method)[0]):
            return handler
        metadata = handler_call_details.invocation_metadata
        if handler.unary_unary is not None:
            return handler._replace(unary_unary=self._unary(handler.unary_unary, method, metadata))
        if handler.stream_unary is not None:
            return handler._replace(stream_unary=self._unary(handler.stream_unary, method, metadata))
        if handler.unary_stream is not None:
            return handler._replace(unary_stream=self._stream(handler.unary_stream, method, metadata))
        return handler._replace(stream_stream=self._stream(handler.stream_stream, method, metadata))

    def _unary(self, behavior: Callable, method: str, metadata) -> Callable:
        async def handle(request_or_iterator, context):
            call = _Call(self, method, metadata, context)
            try:
                response = await behavior(request_or_iterator, context)
            except BaseException as exc:
                call.finish(context, exc)
                raise
            call.finish(context, None)
            return response

        return handle

    def _stream(self, behavior: Callable, method: str, metadata) -> Callable:
        async def handle(request_or_iterator, context):
            call = _Call(self, method, metadata, context)
            responses = behavior(request_or_iterator, context)
            try:
                async for response in responses:
                    yield response
            except BaseException as exc:
                await _close(responses)
                call.finish(context, exc)
                raise
            call.finish(context, None)

        return handle


async def _close(responses) -> None:
    """Closes the handler's generator now (so its cleanup runs here, not in a finalizer task later)."""
    aclose = getattr(responses, "aclose", None)
    if aclose is not None:
        try:
            await aclose()
        except Exception:  # noqa: BLE001 - the call is ending anyway; its own error is what matters
            pass


# -- client ---------------------------------------------------------------------------------------------------------


def client_interceptors(tracer_provider: TracerProvider | None = None) -> list[grpc.aio.ClientInterceptor]:
    """The interceptors of a kdamesh gRPC channel (see the module docstring): one per call kind (a grpc.aio channel
    files each interceptor under the first kind it implements only). `tracer_provider` is accepted for symmetry with
    `server_interceptors`; the trace context sent is the caller's current one."""
    del tracer_provider
    return [_context_interceptor(kind, method) for kind, method in _CLIENT_KINDS]


class _MetadataSetter:
    def set(self, carrier: grpc.aio.Metadata, key: str, value: str) -> None:
        carrier[key] = value


_SETTER = _MetadataSetter()


def _with_context(details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
    """`details` with the current trace context and request id added to the metadata."""
    metadata = grpc.aio.Metadata(*tuple(details.metadata or ()))
    propagate.inject(metadata, setter=_SETTER)
    request_id = current_request_id()
    if request_id is not None and REQUEST_ID_METADATA not in metadata:
        metadata.add(REQUEST_ID_METADATA, request_id)
    return grpc.aio.ClientCallDetails(details.method, details.timeout, metadata, details.credentials,
                                      details.wait_for_ready)


_CLIENT_KINDS = ((grpc.aio.UnaryUnaryClientInterceptor, "intercept_unary_unary"),
                 (grpc.aio.UnaryStreamClientInterceptor, "intercept_unary_stream"),
                 (grpc.aio.StreamUnaryClientInterceptor, "intercept_stream_unary"),
                 (grpc.aio.StreamStreamClientInterceptor, "intercept_stream_stream"))


def _context_interceptor(kind: type, method: str) -> grpc.aio.ClientInterceptor:
    """An interceptor of one call kind that adds `_with_context` to every call's metadata."""
    async def intercept(self, continuation, client_call_details, request_or_iterator):
        return await continuation(_with_context(client_call_details), request_or_iterator)

    return type(f"_Context{kind.__name__}", (kind,), {method: intercept})()
