"""The lifecycle of one admitted request through the mesh (a "run"), shared by chat and completions.

Contract:
- A run is made by `GatewayCore.chat` / `GatewayCore.complete` after admission (it holds the rate-limit lease and
  counts as running). It must be `open()`ed — which starts the mesh request and waits for its first item, so errors
  before any output (context length from a worker, no healthy worker) still surface as plain `ApiError`s — then
  iterated with `events()` (the subclass: `ChatRun`, `CompletionRun`), and always `close()`d.
- Errors: every mesh item is taken by `_step`, the one place a `MeshError` (or a `gateway.stall.WorkerStalled`: 503
  `worker_stalled`) becomes an `ApiError` (`mesh_api_error`, naming `prompt_param` in a context-length error; the worker's message is logged, the client
  gets a generic one with the request id) and a failure is recorded on the trace
  (`failure_of`); a failure in `open()` also records its status (499 when cancelled: the client went away) and
  closes the run.
- `close()` is idempotent: it cancels the mesh call if still running (decode aborts the request and frees its
  memory), releases the lease with the tokens actually used, updates the metrics and finishes the trace — exactly
  once, even when the task closing it is being cancelled (a client that went away) or the mesh call fails to end.
- While the mesh works (each `_step`) the trace's span and request id are current, so gRPC calls and tasks started
  there carry them; they are attached and detached within one step, never across a `yield`.
- `stream` / `include_usage`: how the client asked for the response; `choices` has one entry per choice.
- A run sees the gateway only through its `RunContext` (`context`): the mesh's `generate`, the tokenizer its
  choices detokenise with (`choice_text(rules)` makes a choice's text state), the output markers, the metrics, the
  served model name and the deadline of one request through the mesh. `GatewayCore.run_context()` makes it; runs
  never import the core.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import nullcontext
from dataclasses import dataclass

from engine.tokenizer import KimiTokenizer
from gateway.mesh_client import MeshError, MeshRequest, TokenEvent
from gateway.metrics import GatewayMetrics
from gateway.protocol import failure_of, mesh_api_error
from gateway.ratelimit import Lease
from gateway.request_trace import RequestTrace
from gateway.stall import WorkerStalled
from gateway.tenancy import Principal
from gateway.text import ChoiceText, TextRules
from protos import common_pb2

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunContext:
    """What a run needs of the gateway (see the module docstring)."""

    generate: Callable[[MeshRequest], AsyncIterator[TokenEvent]]  # one prompt through the mesh
    tokenizer: KimiTokenizer
    marker_ids: frozenset[int]  # special ids the output parsers read (others are dropped)
    metrics: GatewayMetrics
    model: str  # the served model name
    request_timeout_s: float  # deadline of one request through the mesh (seconds)

    def choice_text(self, rules: TextRules) -> ChoiceText:
        """A choice's detokenisation and stop-rule state."""
        return ChoiceText(self.tokenizer, rules)


class Run:
    """Common lifecycle of one admitted request: open (first mesh item), events, close (accounting)."""

    endpoint = ""  # the metrics label: "chat" | "completions"
    sampling: common_pb2.SamplingParams | None = None  # set by a subclass: the request's (vllm:request_params_*)
    prompt_param = "prompt"  # the request field a context-length error names

    def __init__(self, context: RunContext, principal: Principal, lease: Lease, request_id: str,
                 prompt_tokens: int, api: str, trace: RequestTrace | None = None):
        self.context = context
        self.trace = trace
        self.principal = principal
        self.lease = lease
        self.id = request_id
        # the mesh's request id: unique even when a client reuses its own `request_id`
        self.mesh_id = f"{request_id}-{uuid.uuid4().hex[:8]}"
        self.created = int(time.time())
        self.model = context.model
        self.api = api
        self.prompt_tokens = prompt_tokens
        self.stream = False
        self.include_usage = False
        self.continuous_usage = False  # stream_options.continuous_usage_stats: usage so far on every chunk
        self.start = time.monotonic()
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.cached_tokens = 0
        self.route = ""
        self._source: AsyncIterator | None = None
        self._first = None
        self._closed = False

    @property
    def tenant_share(self) -> common_pb2.TenantShare:
        """Whom the workers run this request for in their fair share (the tenant's configured name and weight)."""
        return common_pb2.TenantShare(name=self.principal.tenant, weight=self.principal.weight)

    # -- what a subclass provides --------------------------------------------------------------------------------

    def _items(self) -> AsyncIterator:
        """The mesh items of this request (started by `open`)."""
        raise NotImplementedError

    def choice_token_counts(self) -> list[int]:
        """Completion tokens of each choice so far."""
        raise NotImplementedError

    def finish_reasons(self) -> list[str]:
        """The finish reasons of the choices that finished, by choice index."""
        raise NotImplementedError

    # -- the lifecycle -------------------------------------------------------------------------------------------

    def reasoning_token_count(self) -> int:
        """Completion tokens spent in reasoning blocks so far, over the choices (0 where no parser reads them)."""
        return 0

    def usage(self) -> common_pb2.Usage:
        return common_pb2.Usage(prompt_tokens=self.prompt_tokens, completion_tokens=sum(self.choice_token_counts()),
                                cached_tokens=self.cached_tokens, reasoning_tokens=self.reasoning_token_count())

    async def _step(self):
        """The next mesh item (see the module docstring); a `MeshError` becomes its `ApiError` here."""
        try:
            with self.trace.scope() if self.trace is not None else nullcontext():
                return await self._source.__anext__()
        except StopAsyncIteration:
            raise
        except BaseException as exc:
            error = self._mesh_error(exc) if isinstance(exc, (MeshError, WorkerStalled)) else exc
            self._fail(failure_of(error)[0])
            if error is exc:
                raise
            raise error from None

    def _mesh_error(self, exc: MeshError | WorkerStalled):
        request_id = self.trace.request_id if self.trace is not None else self.id  # the X-Request-Id
        if isinstance(exc, WorkerStalled):
            log.warning("request %s (%s): %s", request_id, self.id, exc)
            return exc.api_error(request_id)
        log.warning("request %s (%s): mesh call failed: %s: %s", request_id, self.id, exc.code.name, exc.message)
        return mesh_api_error(exc.code, exc.message, self.prompt_param, request_id)

    def _fail(self, error: str, status: int | None = None) -> None:
        if self.trace is not None:
            self.trace.fail(error, status)

    async def open(self) -> None:
        """Starts the mesh request and waits for its first item; raises ApiError when it fails before any."""
        self._source = self._items()
        try:
            self._first = await self._step()
        except StopAsyncIteration:
            self._first = None
        except BaseException as exc:
            self._fail(*failure_of(exc))
            await self.close()
            raise

    async def _mesh_items(self) -> AsyncIterator:
        """The items after `open()`: the peeked first one, then the rest."""
        if self._source is None:
            raise RuntimeError("open() the run first")
        if self._first is not None:
            first, self._first = self._first, None
            yield first
        while True:
            try:
                item = await self._step()
            except StopAsyncIteration:
                return
            yield item

    def _saw_tokens(self, event: TokenEvent) -> None:
        if event.token_ids:
            now = time.monotonic()
            if self.first_token_at is None:
                self.first_token_at = now
            self.last_token_at = now
        if event.cached_tokens is not None:  # the first event: known even if the stream is left early
            self.cached_tokens = event.cached_tokens
        if event.usage is not None:
            self.cached_tokens = event.usage.cached_tokens
            if event.route:
                self.route = event.route
                self.context.metrics.routes.labels(event.route).inc()

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            if self._source is not None:
                # shielded: a close run by a cancelled task (the client went away) still ends the mesh call
                await asyncio.shield(self._source.aclose())
        finally:
            self._account()

    def _account(self) -> None:
        """Releases the lease and records the run, exactly once (from `close`, whatever ended the run)."""
        usage = self.usage()
        self.lease.release(usage.prompt_tokens + usage.completion_tokens)
        metrics = self.context.metrics
        metrics.running.labels(self.api).dec()
        metrics.observe_tokens(self.principal.tenant, usage.prompt_tokens, usage.completion_tokens,
                               usage.cached_tokens)
        metrics.observe_timing(self.endpoint, self.start, self.first_token_at, self.last_token_at,
                               max(self.choice_token_counts(), default=0))
        counts = self.choice_token_counts()
        sampling = self.sampling
        metrics.observe_run(self.finish_reasons(), usage.prompt_tokens, usage.completion_tokens, self.start,
                            self.first_token_at, self.last_token_at, max(counts, default=0), n=max(1, len(counts)),
                            max_tokens=sampling.max_tokens if sampling is not None and sampling.HasField("max_tokens")
                            else None)
        if self.trace is not None:
            self.trace.finish(self)
