"""Tracing: the process's tracer provider, kdamesh's span names and attributes, and the gateway's GenAI root span.

Contract:
- `setup_tracing(service_name, exporter)` builds the process's tracer provider and returns it:
  - "otlp": an SDK provider exporting in batches over OTLP to `OTEL_EXPORTER_OTLP_ENDPOINT` (or
    `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`); protocol from `OTEL_EXPORTER_OTLP_TRACES_PROTOCOL` /
    `OTEL_EXPORTER_OTLP_PROTOCOL`: "grpc" (the default here, port 4317) or "http/protobuf" (port 4318).
  - "console": an SDK provider printing each finished span as JSON on stdout.
  - "none": OpenTelemetry's no-op provider (nothing is recorded, trace context still passes through).
  - "auto" (the default): `OTEL_TRACES_EXPORTER` when set (otlp, console or none), else "otlp" when an OTLP endpoint
    variable is set, else "none".
  `span_exporter` (tests: an `InMemorySpanExporter`) is added with a synchronous processor, whatever `exporter` says.
  With `set_global` (the default) an SDK provider becomes OpenTelemetry's global provider — the library's own global
  and the only process-wide state here; OpenTelemetry accepts the first one set and ignores later ones (with a
  warning). `service.name` is `OTEL_SERVICE_NAME` when set, else `service_name`; `OTEL_RESOURCE_ATTRIBUTES` adds more.
- Services take a `tracer_provider` argument (None: the global one) and get tracers with `get_tracer`.
- `child_span(tracer, name, attributes)` is an INTERNAL span, current inside its block (also across `yield` in a
  generator that another task closes: `detach` restores a context only where it was attached); an exception leaving
  the block sets `error.type` (the exception's class name; "cancelled" for cancellation) and the ERROR status unless
  `mark_error` already recorded one; a gRPC `AbortError` is left to the caller (`mark_error` before aborting).
- Span names: `prefill`, `decode`, `prefix.lookup`, `prefix.load`, `handoff.publish`, `handoff.claim`, `cache.lookup`,
  `cache.get`, `cache.put`; the gRPC server spans of telemetry.rpc are `package.Service/Method`
  (`kdamesh.v1.PrefillService/Prefill`).
- The gateway's root span: `start_request_span(tracer, operation, model, headers, ...)` continues a W3C `traceparent`
  found in the REST headers (else starts a trace) and opens a SERVER span `"{operation} {model}"` (operation "chat"
  or "text_completion") with the GenAI request attributes; `RequestSpan.activate()` makes it current (gRPC calls made
  inside carry it); `RequestSpan.finish(...)` adds the usage and finish reasons and ends it (once).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import grpc
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, Tracer, TracerProvider

EXPORTERS = ("auto", "none", "console", "otlp")

# -- attribute names --------------------------------------------------------------------------------------------
# OpenTelemetry semantic conventions
ERROR_TYPE = "error.type"
GEN_AI_OPERATION = "gen_ai.operation.name"
GEN_AI_PROVIDER = "gen_ai.provider.name"
GEN_AI_REQUEST_MODEL = "gen_ai.request.model"
GEN_AI_REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
GEN_AI_REQUEST_TEMPERATURE = "gen_ai.request.temperature"
GEN_AI_REQUEST_TOP_P = "gen_ai.request.top_p"
GEN_AI_REQUEST_SEED = "gen_ai.request.seed"
GEN_AI_REQUEST_CHOICE_COUNT = "gen_ai.request.choice.count"
GEN_AI_RESPONSE_ID = "gen_ai.response.id"
GEN_AI_RESPONSE_MODEL = "gen_ai.response.model"
GEN_AI_RESPONSE_FINISH_REASONS = "gen_ai.response.finish_reasons"
GEN_AI_USAGE_INPUT_TOKENS = "gen_ai.usage.input_tokens"
GEN_AI_USAGE_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS = "gen_ai.usage.cache_read.input_tokens"
# kdamesh's own
REQUEST_ID = "kdamesh.request_id"
TENANT = "kdamesh.tenant"
BYTES = "kdamesh.bytes"  # payload bytes moved by the operation
BLOCKS = "kdamesh.blocks"  # KV blocks moved or looked up
KEYS = "kdamesh.keys"  # cache objects named by the call
HIT_TOKENS = "kdamesh.hit_tokens"  # prompt tokens served from a cache
HIT_BLOCKS = "kdamesh.hit_blocks"
BACKEND = "kdamesh.cache.backend"  # "memory" | "redis"
PROMPT_TOKENS = "kdamesh.prompt_tokens"
ROUTE = "kdamesh.route"  # "remote" | "local" | "fallback"
DECODE_PATH = "kdamesh.decode.path"  # "handoff" | "local" | "recompute"
STREAM = "kdamesh.stream"

PROVIDER_NAME = "kdamesh"


# -- the provider -----------------------------------------------------------------------------------------------


def resolve_exporter(exporter: str) -> str:
    """'auto' -> the exporter the environment asks for (see the module docstring); other names pass through."""
    if exporter not in EXPORTERS:
        raise ValueError(f"trace exporter must be one of {EXPORTERS}, got {exporter!r}")
    if exporter != "auto":
        return exporter
    named = os.environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if named in ("otlp", "console", "none"):
        return named
    if os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        return "otlp"
    return "none"


def _otlp_exporter():
    protocol = (os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
                or "grpc").strip().lower()
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    elif protocol in ("http/protobuf", "http"):
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    else:
        raise ValueError(f"OTLP protocol must be 'grpc' or 'http/protobuf', got {protocol!r}")
    return OTLPSpanExporter()  # endpoint, headers, timeouts: the OTEL_EXPORTER_OTLP_* variables


def setup_tracing(service_name: str, exporter: str = "auto", *, span_exporter=None,
                  set_global: bool = True) -> TracerProvider:
    """The process's tracer provider (see the module docstring)."""
    kind = resolve_exporter(exporter)
    if kind == "none" and span_exporter is None:
        return trace.NoOpTracerProvider()
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider as SdkTracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SimpleSpanProcessor

    resource = Resource.create({SERVICE_NAME: os.environ.get("OTEL_SERVICE_NAME") or service_name})
    provider = SdkTracerProvider(resource=resource)
    if kind == "otlp":
        provider.add_span_processor(BatchSpanProcessor(_otlp_exporter()))
    elif kind == "console":
        provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter()))
    if span_exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(span_exporter))
    if set_global:
        trace.set_tracer_provider(provider)
    return provider


def get_tracer(name: str, tracer_provider: TracerProvider | None = None) -> Tracer:
    """A tracer of `tracer_provider`, or of the global provider when None (resolved lazily: a provider installed
    later still receives the spans)."""
    return trace.get_tracer(name, tracer_provider=tracer_provider)


# -- spans --------------------------------------------------------------------------------------------------------


def error_type_of(exc: BaseException) -> str:
    if isinstance(exc, (asyncio.CancelledError, GeneratorExit)):
        return "cancelled"
    return type(exc).__name__


def mark_error(span: Span, error_type: str, description: str | None = None) -> None:
    """Records a failure on `span`: `error.type` and the ERROR status."""
    span.set_attribute(ERROR_TYPE, error_type)
    span.set_status(Status(StatusCode.ERROR, description))


def detach(token) -> None:
    """Restores the context before `otel_context.attach` returned `token` — when in the context that attached it.
    A generator closed by another task (gRPC finalizing an abandoned stream) is in another context, where there is
    nothing to restore: OpenTelemetry's `detach` would log "Failed to detach context" there, this stays quiet."""
    var = getattr(token, "var", None)
    if var is None:  # not the contextvars runtime context
        otel_context.detach(token)
        return
    try:
        var.reset(token)
    except ValueError:
        pass


@contextmanager
def use_span(span: Span) -> Iterator[Span]:
    """Makes `span` current inside the block without ending it; safe across `yield` in generators (see `detach`)."""
    token = otel_context.attach(trace.set_span_in_context(span))
    try:
        yield span
    finally:
        detach(token)


@contextmanager
def child_span(tracer: Tracer, name: str, attributes: Mapping[str, object] | None = None) -> Iterator[Span]:
    """An INTERNAL span, current inside the block (see the module docstring for failures); safe across `yield`."""
    span = tracer.start_span(name, attributes=_clean(attributes))
    try:
        with use_span(span):
            yield span
    except grpc.aio.AbortError:
        raise  # the RPC's status, recorded by the caller (mark_error) and by the gRPC server span
    except BaseException as exc:
        if not _has_error_type(span):  # a more precise error.type recorded before raising wins
            mark_error(span, error_type_of(exc), str(exc) or None)
        raise
    finally:
        span.end()


def _has_error_type(span: Span) -> bool:
    attributes = getattr(span, "attributes", None)  # SDK spans expose theirs; no-op spans have none
    return bool(attributes) and ERROR_TYPE in attributes


def _clean(attributes: Mapping[str, object] | None) -> dict | None:
    """Drops None values (OpenTelemetry rejects them)."""
    return None if attributes is None else {k: v for k, v in attributes.items() if v is not None}


def set_attributes(span: Span, attributes: Mapping[str, object]) -> None:
    span.set_attributes(_clean(attributes))


# -- the gateway's root span ------------------------------------------------------------------------------------


def extract_context(headers: Mapping[str, str] | None) -> Context | None:
    """The trace context of REST request headers (W3C `traceparent`/`tracestate`, and whatever else
    `OTEL_PROPAGATORS` names) -> a Context to parent the root span on; None when there are no headers."""
    if headers is None:
        return None
    carrier = {k.lower(): v for k, v in headers.items()}
    return propagate.extract(carrier)


def inject_headers(headers: dict[str, str]) -> dict[str, str]:
    """Adds the current trace context to outgoing headers (`traceparent`, ...) and returns them."""
    propagate.inject(headers)
    return headers


@dataclass
class RequestSpan:
    """The root span of one API request (see `start_request_span`)."""

    span: Span
    _ended: bool = field(default=False, repr=False)

    @property
    def trace_id(self) -> str:
        """32 hex digits ("0" * 32 when tracing is off)."""
        return format(self.span.get_span_context().trace_id, "032x")

    def activate(self):
        """Context manager making the span current (without ending it): gRPC calls and tasks created inside are its
        children. Safe to hold across `yield` in a streaming response generator."""
        return use_span(self.span)

    def finish(self, *, input_tokens: int | None = None, output_tokens: int | None = None,
               cached_tokens: int | None = None, finish_reasons: Sequence[str] = (), response_id: str | None = None,
               response_model: str | None = None, route: str | None = None, error_type: str | None = None,
               error_message: str | None = None) -> None:
        """Adds the response attributes (and `error.type` when given) and ends the span; later calls do nothing."""
        if self._ended:
            return
        self._ended = True
        set_attributes(self.span, {
            GEN_AI_USAGE_INPUT_TOKENS: input_tokens, GEN_AI_USAGE_OUTPUT_TOKENS: output_tokens,
            GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS: cached_tokens, GEN_AI_RESPONSE_ID: response_id,
            GEN_AI_RESPONSE_MODEL: response_model, ROUTE: route,
            GEN_AI_RESPONSE_FINISH_REASONS: tuple(finish_reasons) if finish_reasons else None})
        if error_type is not None:
            mark_error(self.span, error_type, error_message)
        self.span.end()


def start_request_span(tracer: Tracer, operation: str, model: str, headers: Mapping[str, str] | None = None, *,
                       max_tokens: int | None = None, temperature: float | None = None, top_p: float | None = None,
                       seed: int | None = None, choice_count: int | None = None, request_id: str | None = None,
                       tenant: str | None = None, stream: bool | None = None) -> RequestSpan:
    """Opens the SERVER span `"{operation} {model}"` for one API request, continuing the `traceparent` of `headers`.
    operation: "chat" (/v1/chat/completions) or "text_completion" (/v1/completions)."""
    attributes = {GEN_AI_OPERATION: operation, GEN_AI_PROVIDER: PROVIDER_NAME, GEN_AI_REQUEST_MODEL: model,
                  GEN_AI_REQUEST_MAX_TOKENS: max_tokens,
                  GEN_AI_REQUEST_TEMPERATURE: None if temperature is None else float(temperature),
                  GEN_AI_REQUEST_TOP_P: None if top_p is None else float(top_p), GEN_AI_REQUEST_SEED: seed,
                  GEN_AI_REQUEST_CHOICE_COUNT: choice_count if choice_count and choice_count != 1 else None,
                  REQUEST_ID: request_id, TENANT: tenant, STREAM: stream}
    span = tracer.start_span(f"{operation} {model}", context=extract_context(headers), kind=SpanKind.SERVER,
                             attributes=_clean(attributes))
    return RequestSpan(span)


def current_trace_ids() -> tuple[str, str] | None:
    """(trace id, span id) of the current span in hex, or None when there is no valid span."""
    ctx = trace.get_current_span().get_span_context()
    if not ctx.is_valid:
        return None
    return format(ctx.trace_id, "032x"), format(ctx.span_id, "016x")
