"""The telemetry of one API request (REST or gRPC): its request id, GenAI root span and access line.

Contract:
- `RequestTrace(tracer, model, endpoint, request_id, headers)`: `request_id` is the `X-Request-Id` (the client's
  when usable, else a new one); `headers` are the REST request's (an incoming W3C `traceparent` is continued) or
  None (the gRPC API: the current context's span — the server interceptor's — is the parent).
- `start_span(operation, tenant, sampling, n, stream)` opens the root span `chat {model}` / `text_completion
  {model}` with the GenAI attributes once the request is parsed; `scope()` makes the span and the request id
  current inside a block (the run wraps every step of its mesh call in it, so the gRPC client interceptors carry
  both to the workers, also while a response streams).
- `fail(error, status)` records a failure (`error.type`; the first one wins) and the status answered.
- `finish(run)` ends the span and writes one access line (`telemetry.logs.log_request`), once; a run given a trace
  finishes it on `close()`, a request refused before a run finishes it with `finish()` (no usage attributes).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from contextlib import ExitStack, contextmanager
from typing import Protocol

from protos import common_pb2
from telemetry import tracing
from telemetry.context import request_id_scope
from telemetry.logs import log_request



class FinishedRun(Protocol):
    """What `finish` reads of a run (gateway.run.Run has it; this module does not import the runs)."""

    id: str
    start: float  # time.monotonic() at admission
    first_token_at: float | None
    route: str

    def usage(self) -> common_pb2.Usage: ...

    def finish_reasons(self) -> list[str]: ...


class RequestTrace:
    """One API request's request id, root span and access line (see the module docstring)."""

    def __init__(self, tracer, model: str, endpoint: str, request_id: str,
                 headers: Mapping[str, str] | None = None):
        self.tracer = tracer
        self.model = model
        self.endpoint = endpoint  # e.g. "/v1/chat/completions", "kdamesh.v1.Generation/Chat"
        self.request_id = request_id
        self.headers = headers
        self.started = time.monotonic()
        self.tenant: str | None = None
        self.span: tracing.RequestSpan | None = None
        self.status = 200
        self.error: str | None = None
        self._done = False

    def start_span(self, operation: str, tenant: str, sampling: common_pb2.SamplingParams, n: int,
                   stream: bool) -> None:
        """Opens the root span (operation "chat" or "text_completion") once the request is parsed."""
        self.tenant = tenant
        has = sampling.HasField
        self.span = tracing.start_request_span(
            self.tracer, operation, self.model, self.headers,
            max_tokens=sampling.max_tokens if has("max_tokens") else None,
            temperature=sampling.temperature if has("temperature") else None,
            top_p=sampling.top_p if has("top_p") else None, seed=sampling.seed if has("seed") else None,
            choice_count=n, request_id=self.request_id, tenant=tenant, stream=stream)

    def fail(self, error: str, status: int | None = None) -> None:
        """Records the request's failure (`error.type`) and, when given, the status it was answered with."""
        if self.error is None:
            self.error = error
        if status is not None:
            self.status = status

    @contextmanager
    def scope(self):
        """The root span and the request id, current inside the block."""
        with ExitStack() as stack:
            if self.span is not None:
                stack.enter_context(self.span.activate())
            stack.enter_context(request_id_scope(self.request_id))
            yield

    def finish(self, run: FinishedRun | None = None) -> None:
        """Ends the root span and writes the access line (once)."""
        if self._done:
            return
        self._done = True
        usage = run.usage() if run is not None else common_pb2.Usage()
        reasons = run.finish_reasons() if run is not None else []
        ttft = None if run is None or run.first_token_at is None else run.first_token_at - run.start
        route = (run.route or None) if run is not None else None
        with self.scope():
            log_request(request_id=self.request_id, tenant=self.tenant, model=self.model, endpoint=self.endpoint,
                        status=self.status, prompt_tokens=usage.prompt_tokens,
                        completion_tokens=usage.completion_tokens, cached_tokens=usage.cached_tokens, ttft_s=ttft,
                        duration_s=time.monotonic() - self.started, route=route, finish_reasons=reasons,
                        error=self.error)
        if self.span is not None:
            ran = run is not None  # refused before a run: no usage or response attributes
            self.span.finish(input_tokens=usage.prompt_tokens if ran else None,
                             output_tokens=usage.completion_tokens if ran else None,
                             cached_tokens=usage.cached_tokens if ran else None, finish_reasons=reasons,
                             response_id=run.id if ran else None, response_model=self.model if ran else None,
                             route=route, error_type=self.error)
