"""The gateway's request pipeline, shared by the REST API (gateway/app.py) and the gRPC API (gateway/grpc_api.py).

One chat request: authenticate (API key -> tenant) -> validate -> render the chat template -> derive the tenant's
cache salt -> admit (per-tenant rate and concurrency limits) -> mesh (P/D decision, prefill -> decode) -> incremental
detokenisation, stop strings -> reasoning / tool-call parsers -> transport-neutral events -> usage and metrics.

Contract:
- `GatewayCore(config, ...)` owns the tokenizer, chat renderer, mesh client, tenant directory, cache salter, rate
  limiter and metrics. `start()` loads what was not given, logs whether the gateway is open, and starts the periodic
  worker health checks; `close()` stops them (and closes a mesh it created).
- `authenticate(authorization)` -> `Principal`, or `ApiError` 401 (open mode: every request is anonymous).
- `plan_chat(request)` renders and decides everything about a validated chat request (`ChatPlan`): the prompt ids,
  the sampling parameters with structured output (`tool_choice` "required"/named and `response_format` json kinds
  become the engine's grammar), which parsers read the output. Raises `ApiError` (400 for a malformed
  conversation, context length, "auto" tool choice without `--enable-auto-tool-choice`).
- `chat(principal, plan, ...)` / `complete(principal, job, ...)` admit the request (`ApiError` 429 with a
  `Retry-After` header when over a limit) and return a run. A run must be `open()`ed — which waits for the mesh's
  first event, so errors before any output (context length from a worker, no healthy worker) are still plain
  `ApiError`s — then iterated with `events()`, and always `close()`d (idempotent: releases the rate-limit lease
  with the tokens actually used, cancels the mesh call if still running, records metrics). Leaving `events()` early
  cancels the mesh request (decode aborts it and frees its memory).
- Chat events (`ChatEvent`): first one per choice with `role="assistant"`, then parser deltas (reasoning, content,
  tool-call fragments, in order), token logprobs attached to the next event of their choice, and a last event per
  choice with `finish_reason` ("stop", "length", "tool_calls" when the turn ended with parsed calls, "abort").
  Completion events (`CompletionEvent`) carry text deltas, token ids and logprobs the same way.
- The cache salt passed to the mesh is derived from the authenticated principal (`CacheSalter`); a client's
  `cache_salt` is only mixed in. Tenants therefore never share prefix-cache entries.
- `tokenize` / `detokenize` / `model_cards` answer vLLM's /tokenize, /detokenize and /v1/models.
- Telemetry (`RequestTrace`, one per API request): the request id (`X-Request-Id`), the root span
  `chat {model}` / `text_completion {model}` with the GenAI attributes (continuing a REST `traceparent`, or the
  gRPC API's server span), current — with the request id — around every step of the mesh call (so the gRPC client
  interceptors carry both to the workers, also while a response streams), and one access line (`log_request`)
  when the request ends. A run given a trace finishes it on `close()`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from contextlib import ExitStack, aclosing, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from engine.tokenizer import IncrementalDetokenizer, KimiTokenizer
from gateway.chat import ChatFormatError, ChatRenderer, RenderedPrompt, read_family
from gateway.config import GatewayConfig
from gateway.mesh_client import MeshClient, MeshError, MeshRequest, TokenEvent
from gateway.metrics import GatewayMetrics
from gateway.openai_protocol import (ApiError, ChatCompletionRequest, CompletionJob, TokenizeChatRequest,
                                     TokenizeCompletionRequest, mesh_api_error, sampling_from_chat)
from gateway.parsers import DeltaMessage, build_output_parser
from gateway.parsers.k2 import MARKERS as K2_MARKERS
from gateway.parsers.k3 import MARKERS as K3_MARKERS
from gateway.ratelimit import Lease, RateLimiter, RateLimitExceeded
from gateway.tenancy import AuthError, CacheSalter, Principal, TenantDirectory
from protos import common_pb2
from telemetry import tracing
from telemetry.context import request_id_scope
from telemetry.logs import log_request

log = logging.getLogger(__name__)

CHAT_FIELDS = ("messages", "tools", "tool_choice", "response_format", "chat_template_kwargs")
StructuredOutput = common_pb2.StructuredOutput


# -- text of one choice ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TextRules:
    """How a choice's tokens become text: stop strings and tokens, special tokens."""

    stop: tuple[str, ...] = ()
    include_stop_str: bool = False
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    # With special tokens kept (the output parsers read them): keep only these special ids in the text, drop the
    # others (reserved tokens a model may emit); None keeps every special token.
    keep_special_ids: frozenset[int] | None = None

    @classmethod
    def of(cls, sampling: common_pb2.SamplingParams, keep_special_ids: frozenset[int] | None = None) -> "TextRules":
        return cls(stop=tuple(sampling.stop), include_stop_str=sampling.include_stop_str_in_output,
                   min_tokens=sampling.min_tokens, stop_token_ids=tuple(sampling.stop_token_ids),
                   ignore_eos=sampling.ignore_eos, skip_special_tokens=sampling.skip_special_tokens,
                   keep_special_ids=None if sampling.skip_special_tokens else keep_special_ids)


class ChoiceText:
    """Detokenises one choice incrementally, matches stop strings and releases text that can no longer be part of
    one (the same rules as the engine's `OutputState`)."""

    def __init__(self, tokenizer: KimiTokenizer, rules: TextRules):
        self.tokenizer = tokenizer
        self.detok = IncrementalDetokenizer(tokenizer, rules.skip_special_tokens)
        self.keep_special = rules.keep_special_ids
        self.stop = list(rules.stop)
        self.include_stop = rules.include_stop_str
        self.min_tokens = rules.min_tokens
        self.stop_ids = set(rules.stop_token_ids) | (set() if rules.ignore_eos else set(tokenizer.stop_token_ids))
        self.holdback = max((len(s) for s in self.stop), default=1) - 1
        self.text = ""
        self.emitted = 0
        self.token_ids: list[int] = []
        self.logprobs: list[common_pb2.TokenLogprob] = []
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None  # the stop string or stop token id (not EOS) that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def add(self, event: TokenEvent) -> str:
        """Takes an event's tokens; returns the text newly safe to emit."""
        for i, token in enumerate(event.token_ids):
            if self.finished:
                break
            self.token_ids.append(token)
            if i < len(event.logprobs):
                self.logprobs.append(event.logprobs[i])
            last = i == len(event.token_ids) - 1
            min_reached = len(self.token_ids) > self.min_tokens
            is_stop_token = token in self.stop_ids or token == event.stop_token_id
            if last and event.finish_reason == "stop" and is_stop_token and min_reached:
                self.finish_reason = "stop"  # a stop token: its text is not output
                if token not in self.tokenizer.stop_token_ids:
                    self.stop_reason = token
                break
            before = len(self.text)
            if self.keep_special is None or token in self.keep_special or not self.tokenizer.is_special(token):
                self.text += self.detok.push(token)
            if self.stop and min_reached and self._match_stop(before):
                self.finish_reason = "stop"
        if event.finish_reason is not None and not self.finished:
            if event.finish_reason != "stop":
                self.text += self.detok.finish()
            self.finish_reason = event.finish_reason
        visible = len(self.text) if self.finished else max(self.emitted, len(self.text) - self.holdback)
        delta = self.text[self.emitted:visible]
        self.emitted = max(self.emitted, visible)
        return delta

    def _match_stop(self, old_len: int) -> bool:
        start = max(0, old_len - self.holdback)
        found = [(self.text.find(s, start), s) for s in self.stop]
        found = [(i, s) for i, s in found if i >= 0]
        if not found:
            return False
        i, s = min(found)
        self.text = self.text[: i + len(s)] if self.include_stop else self.text[:i]
        self.stop_reason = s
        return True


# -- events ------------------------------------------------------------------------------------------------------


@dataclass
class ChatEvent:
    """Something new in one chat choice."""

    index: int
    role: str | None = None  # "assistant" on the first event of a choice
    deltas: list[DeltaMessage] = field(default_factory=list)
    logprobs: list[common_pb2.TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None  # on the last event of a choice
    stop_reason: str | int | None = None


@dataclass
class CompletionEvent:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[common_pb2.TokenLogprob] = field(default_factory=list)
    text_offset: int = 0  # characters of this choice sent before `text`
    logprob_offset: int = 0  # text offset of the first token in `logprobs` (after an echoed prompt)
    finish_reason: str | None = None
    stop_reason: str | int | None = None


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


@dataclass(frozen=True)
class ChatPlan:
    """Everything decided about a chat request before it reaches the mesh."""

    request: ChatCompletionRequest
    prompt: RenderedPrompt
    sampling: common_pb2.SamplingParams
    tool_parser: str | None  # parser names (gateway.parsers); both None: the text is the content
    reasoning_parser: str | None

    @property
    def prompt_ids(self) -> list[int]:
        return self.prompt.token_ids


# -- telemetry of one request ------------------------------------------------------------------------------------


class RequestTrace:
    """One API request's request id, root span and access line (see the module docstring)."""

    def __init__(self, core: "GatewayCore", endpoint: str, request_id: str,
                 headers: Mapping[str, str] | None = None):
        self.core = core
        self.endpoint = endpoint  # e.g. "/v1/chat/completions", "kdamesh.v1.Generation/Chat"
        self.request_id = request_id
        self.headers = headers  # REST headers (a `traceparent` is continued); None: the current context's span
        self.started = time.monotonic()
        self.model = core.config.model_name
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
            self.core.tracer, operation, self.model, self.headers,
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

    def finish(self, run: "_Run | None" = None) -> None:
        """Ends the root span and writes the access line (once)."""
        if self._done:
            return
        self._done = True
        usage = run.usage() if run is not None else Usage(0, 0, 0)
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


def api_error_type(exc: ApiError) -> str:
    """The `error.type` of a refused or failed request: the error's code, else its type."""
    return exc.code or exc.type


# -- runs --------------------------------------------------------------------------------------------------------


class _Run:
    """Common lifecycle of one admitted request: open (first mesh item), events, close (accounting)."""

    endpoint = ""

    def __init__(self, core: "GatewayCore", principal: Principal, lease: Lease, request_id: str,
                 prompt_tokens: int, api: str, trace: RequestTrace | None = None):
        self.core = core
        self.trace = trace
        self.principal = principal
        self.lease = lease
        self.id = request_id
        # the mesh's request id: unique even when a client reuses its own `request_id`
        self.mesh_id = f"{request_id}-{uuid.uuid4().hex[:8]}"
        self.created = int(time.time())
        self.model = core.config.model_name
        self.api = api
        self.prompt_tokens = prompt_tokens
        self.start = time.monotonic()
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.cached_tokens = 0
        self.route = ""
        self._source: AsyncIterator | None = None
        self._first = None
        self._closed = False

    def _items(self) -> AsyncIterator:
        raise NotImplementedError

    def completion_tokens(self) -> int:
        raise NotImplementedError

    def usage(self) -> Usage:
        return Usage(self.prompt_tokens, self.completion_tokens(), self.cached_tokens)

    def finish_reasons(self) -> list[str]:
        """The finish reasons of the choices that finished, by choice index."""
        raise NotImplementedError

    async def _step(self):
        """The next mesh item, with the request's span and id current while the mesh works (gRPC calls and tasks
        started here carry them); attached and detached within this one step, never across a `yield`."""
        if self.trace is None:
            return await self._source.__anext__()
        with self.trace.scope():
            try:
                return await self._source.__anext__()
            except StopAsyncIteration:
                raise
            except MeshError as exc:
                self.trace.fail(api_error_type(mesh_api_error(exc.code, exc.message, self.prompt_param)))
                raise
            except BaseException as exc:
                self.trace.fail(tracing.error_type_of(exc))
                raise

    async def open(self) -> None:
        """Starts the mesh request and waits for its first item; raises ApiError when it fails before any."""
        self._source = self._items()
        try:
            self._first = await self._step()
        except StopAsyncIteration:
            self._first = None
        except MeshError as exc:
            error = mesh_api_error(exc.code, exc.message, self.prompt_param)
            if self.trace is not None:
                self.trace.fail(api_error_type(error), error.status)
            await self.close()
            raise error from None
        except BaseException as exc:
            if self.trace is not None:  # cancelled: the client went away (or the server is stopping)
                self.trace.fail(tracing.error_type_of(exc), 499 if isinstance(exc, asyncio.CancelledError) else 500)
            await self.close()
            raise

    prompt_param = "prompt"

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
                self.core.metrics.routes.labels(event.route).inc()

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._source is not None:
            await self._source.aclose()
        usage = self.usage()
        self.lease.release(usage.prompt_tokens + usage.completion_tokens)
        metrics = self.core.metrics
        metrics.running.labels(self.api).dec()
        metrics.observe_tokens(self.principal.tenant, usage.prompt_tokens, usage.completion_tokens,
                               usage.cached_tokens)
        metrics.observe_timing(self.endpoint, self.start, self.first_token_at, self.last_token_at,
                               self._longest_choice())
        if self.trace is not None:
            self.trace.finish(self)

    def _longest_choice(self) -> int:
        return self.completion_tokens()


class _ChatChoice:
    def __init__(self, index: int, tokenizer: KimiTokenizer, plan: ChatPlan, markers: frozenset[int]):
        self.index = index
        self.text = ChoiceText(tokenizer, TextRules.of(plan.sampling, markers))
        parser = build_output_parser(plan.tool_parser, plan.reasoning_parser,
                                     start_in_reasoning=plan.prompt.starts_in_reasoning)
        self.stream = parser.stream() if parser is not None else None
        self.pending_logprobs: list[common_pb2.TokenLogprob] = []
        self.has_tool_calls = False
        self.done = False  # the last event was produced

    def feed(self, text: str, finished: bool) -> list[DeltaMessage]:
        if self.stream is None:
            deltas = [DeltaMessage(content=text)] if text else []
        else:
            deltas = self.stream.feed(text) if text else []
            if finished:
                deltas += self.stream.finish()
        if any(d.tool_calls for d in deltas):
            self.has_tool_calls = True
        return deltas

    def finish_reason(self) -> str:
        reason = self.text.finish_reason or "abort"
        return "tool_calls" if reason == "stop" and self.has_tool_calls else reason


class ChatRun(_Run):
    """One chat completion request (all its choices) through the mesh."""

    endpoint = "chat"
    prompt_param = "messages"

    def __init__(self, core: "GatewayCore", principal: Principal, lease: Lease, plan: ChatPlan, request_id: str,
                 salt: bytes, api: str, trace: RequestTrace | None = None):
        super().__init__(core, principal, lease, request_id, len(plan.prompt_ids), api, trace)
        self.plan = plan
        self.salt = salt
        self.choices = [_ChatChoice(i, core.tokenizer, plan, core.marker_ids) for i in range(plan.request.n)]

    def completion_tokens(self) -> int:
        return sum(len(c.text.token_ids) for c in self.choices)

    def finish_reasons(self) -> list[str]:
        return [c.finish_reason() for c in self.choices if c.done]

    def _longest_choice(self) -> int:
        return max((len(c.text.token_ids) for c in self.choices), default=0)

    async def _items(self) -> AsyncIterator[TokenEvent]:
        request = MeshRequest(request_id=self.mesh_id, prompt_token_ids=tuple(self.plan.prompt_ids),
                              sampling=self.plan.sampling, model=self.model, tenant_salt=self.salt,
                              priority=self.plan.request.priority, timeout_s=self.core.config.request_timeout_s)
        async with aclosing(self.core.mesh.generate(request)) as events:
            async for event in events:
                yield event

    async def events(self) -> AsyncIterator[ChatEvent]:
        for choice in self.choices:
            yield ChatEvent(choice.index, role="assistant")
        try:
            async for event in self._mesh_items():
                self._saw_tokens(event)
                if not 0 <= event.index < len(self.choices):
                    continue
                choice = self.choices[event.index]
                if choice.done:
                    continue
                text = choice.text.add(event)
                choice.pending_logprobs.extend(event.logprobs[: len(event.token_ids)])
                finished = choice.text.finished
                deltas = choice.feed(text, finished)
                for item in self._choice_events(choice, deltas, finished):
                    yield item
                if all(c.done for c in self.choices):
                    break  # e.g. a stop string matched: cancel what the mesh still generates
        except MeshError as exc:
            raise mesh_api_error(exc.code, exc.message, self.prompt_param) from None
        for choice in self.choices:  # the mesh ended without finishing a choice (should not happen): abort it
            if not choice.done:
                if choice.text.finish_reason is None:
                    choice.text.finish_reason = "abort"
                for item in self._choice_events(choice, choice.feed("", True), True):
                    yield item

    def _choice_events(self, choice: _ChatChoice, deltas: list[DeltaMessage], finished: bool):
        if self.plan.request.logprobs:
            logprobs, choice.pending_logprobs = choice.pending_logprobs, []
        else:
            logprobs = []
        for i, delta in enumerate(deltas):
            yield ChatEvent(choice.index, deltas=[delta], logprobs=logprobs if i == 0 else [])
        if finished:
            choice.done = True
            yield ChatEvent(choice.index, logprobs=logprobs if not deltas else [],
                            finish_reason=choice.finish_reason(), stop_reason=choice.text.stop_reason)
        elif not deltas and logprobs:
            choice.pending_logprobs = logprobs + choice.pending_logprobs  # no event now: keep them for the next


class CompletionRun(_Run):
    """One /v1/completions request: its prompts through the mesh (concurrently), merged into choices."""

    endpoint = "completions"

    def __init__(self, core: "GatewayCore", principal: Principal, lease: Lease, job: CompletionJob,
                 request_id: str, salt: bytes, api: str, trace: RequestTrace | None = None):
        super().__init__(core, principal, lease, request_id, sum(len(p) for p in job.prompts), api, trace)
        self.job = job
        self.salt = salt
        rules = TextRules.of(job.sampling)
        self.choices = {p * job.n + i: ChoiceText(core.tokenizer, rules) for p in range(len(job.prompts))
                        for i in range(job.n)}
        self.sent_text = {i: 0 for i in self.choices}
        self.echoed: set[int] = set()
        self.done: set[int] = set()

    def completion_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.choices.values())

    def finish_reasons(self) -> list[str]:
        return [self.choices[i].finish_reason for i in sorted(self.choices) if self.choices[i].finish_reason]

    def _longest_choice(self) -> int:
        return max((len(c.token_ids) for c in self.choices.values()), default=0)

    def prompt_echo(self, p: int) -> str:
        text = self.job.prompt_texts[p]
        return text if text is not None else self.core.tokenizer.decode(self.job.prompts[p])

    async def _items(self) -> AsyncIterator[tuple[int, TokenEvent]]:
        """(prompt index, event) from every prompt's mesh request, merged as they come."""
        queue: asyncio.Queue = asyncio.Queue()
        end = object()
        job = self.job

        async def pump(p: int) -> None:
            request = MeshRequest(request_id=f"{self.mesh_id}-{p}", prompt_token_ids=tuple(job.prompts[p]),
                                  sampling=job.sampling, model=self.model, tenant_salt=self.salt,
                                  priority=job.priority, timeout_s=self.core.config.request_timeout_s)
            try:
                async with aclosing(self.core.mesh.generate(request)) as events:
                    async for event in events:
                        await queue.put((p, event))
                        if all(self.choices[p * job.n + i].finished for i in range(job.n)):
                            break  # e.g. a stop string matched here: cancel the rest
            except MeshError as exc:
                await queue.put(exc)
            finally:
                await queue.put(end)

        tasks = [asyncio.create_task(pump(p)) for p in range(len(job.prompts))]
        try:
            remaining = len(tasks)
            while remaining:
                item = await queue.get()
                if item is end:
                    remaining -= 1
                elif isinstance(item, MeshError):
                    raise item
                else:
                    yield item
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def events(self) -> AsyncIterator[CompletionEvent]:
        try:
            async for p, event in self._mesh_items():
                self._saw_tokens(event)
                index = p * self.job.n + event.index
                choice = self.choices.get(index)
                if choice is None or index in self.done:
                    continue
                n_before, lp_before = len(choice.token_ids), len(choice.logprobs)
                delta = choice.add(event)
                echo = ""
                if self.job.echo and index not in self.echoed:
                    self.echoed.add(index)
                    echo = self.prompt_echo(p)
                    delta = echo + delta
                if not delta and not choice.finished and not event.token_ids:
                    continue
                out = CompletionEvent(index, delta, choice.token_ids[n_before:], choice.logprobs[lp_before:],
                                      self.sent_text[index], self.sent_text[index] + len(echo))
                self.sent_text[index] += len(delta)
                if choice.finished:
                    self.done.add(index)
                    out.finish_reason, out.stop_reason = choice.finish_reason, choice.stop_reason
                yield out
        except MeshError as exc:
            raise mesh_api_error(exc.code, exc.message, self.prompt_param) from None
        for index, choice in sorted(self.choices.items()):
            if index not in self.done:
                self.done.add(index)
                yield CompletionEvent(index, text_offset=self.sent_text[index],
                                      logprob_offset=self.sent_text[index], finish_reason="abort")


# -- the core ----------------------------------------------------------------------------------------------------


def _chat_param(message: str) -> str | None:
    head = message.split(":", 1)[0].split("[", 1)[0].split(".", 1)[0].strip()
    return head if head in CHAT_FIELDS else "messages"


def _has_images(messages: list) -> bool:
    for message in messages:
        content = message.get("content") if isinstance(message, Mapping) else None
        if isinstance(content, list):
            for part in content:
                if isinstance(part, Mapping) and part.get("type") in ("image_url", "image", "input_image"):
                    return True
    return False


def model_max_len(model_dir: str | Path) -> int:
    """The context length a checkpoint declares (config.json, or its text_config)."""
    config = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    text = config.get("text_config") or config
    return int(text.get("model_max_length") or text.get("max_position_embeddings") or 1 << 20)


class GatewayCore:
    def __init__(self, config: GatewayConfig, *, mesh: MeshClient | None = None,
                 tokenizer: KimiTokenizer | None = None, tenants: TenantDirectory | None = None,
                 salter: CacheSalter | None = None, metrics: GatewayMetrics | None = None,
                 env: Mapping[str, str] | None = None):
        self.config = config
        self.mesh = mesh
        self.tokenizer = tokenizer
        self.renderer: ChatRenderer | None = None
        self.marker_ids: frozenset[int] = frozenset()  # special ids the output parsers read (others are dropped)
        self.metrics = metrics or GatewayMetrics()
        self.tracer = tracing.get_tracer("kdamesh.gateway")
        env = os.environ if env is None else env
        self.tenants = tenants if tenants is not None else TenantDirectory.from_config(
            config.api_keys, config.api_keys_file, config.tenant_limits())
        self.salter = salter if salter is not None else CacheSalter.from_env(env)
        self.limiter = RateLimiter(self.tenants.limits())
        self.family = read_family(config.model)
        self.max_model_len = config.max_model_len or model_max_len(config.model)
        self.created = int(time.time())
        self._own_mesh = mesh is None
        self._health_task: asyncio.Task | None = None
        self._started = False

    async def start(self) -> None:
        if self._started:
            return
        self._started = True
        if self.tokenizer is None:
            self.tokenizer = KimiTokenizer.from_pretrained(self.config.model)
        self.renderer = ChatRenderer.from_pretrained(self.config.model, self.tokenizer)
        specials = self.tokenizer.special_tokens
        self.marker_ids = frozenset(specials[m] for m in K3_MARKERS + K2_MARKERS if m in specials)
        if self.mesh is None:
            self.mesh = self.config.make_mesh()
        self.mesh.on_health_change = self._health_changed
        for address in list(self.mesh.decoders) + list(self.mesh.prefillers):
            pool = "decode" if address in self.mesh.decoders else "prefill"
            self.metrics.worker_healthy.labels(pool, address).set(1)
        self._health_task = asyncio.create_task(self.mesh.run_health_checks(self.config.health_check_interval_s))
        log.info(self.tenants.describe())
        if self.salter.ephemeral:
            log.info("cache salts use a per-process secret (set KDAMESH_CACHE_SALT_SECRET to share prefix-cache "
                     "hits across gateway replicas and restarts)")
        parsers = self.config.tool_call_parser or self.config.reasoning_parser
        expected = self.renderer.output_format
        if parsers and parsers != expected:
            log.warning("the configured output parser %r does not match this model's output format %r", parsers,
                        expected)
        log.info("gateway serving %s (%s, %s mode) over decode %s, prefill %s", self.config.model_name, self.family,
                 self.config.mode, list(self.config.decode_addresses), list(self.config.prefill_addresses))

    async def close(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
            await asyncio.gather(self._health_task, return_exceptions=True)
            self._health_task = None
        if self._own_mesh and self.mesh is not None:
            await self.mesh.close()
            self.mesh = None
        self._started = False

    def _health_changed(self, address: str, healthy: bool) -> None:
        pool = "decode" if address in self.mesh.decoders else "prefill"
        self.metrics.worker_healthy.labels(pool, address).set(1 if healthy else 0)

    @property
    def served(self) -> set[str]:
        return self.config.served_names

    # -- tenancy -----------------------------------------------------------------------------------------------

    def authenticate(self, authorization: str | None) -> Principal:
        try:
            return self.tenants.authenticate(authorization)
        except AuthError as exc:
            raise ApiError(401, exc.message, code="invalid_api_key" if exc.kind == "invalid_key" else
                           "missing_api_key", type_="authentication_error",
                           headers={"WWW-Authenticate": "Bearer"}) from None

    def tenant_salt(self, principal: Principal, client_salt: str | None) -> bytes:
        return bytes.fromhex(self.salter.cache_salt(principal, client_salt))

    def _admit(self, principal: Principal, prompt_tokens: int, max_tokens: int | None, n: int) -> Lease:
        budget = max_tokens if max_tokens is not None else max(0, self.max_model_len - prompt_tokens)
        try:
            return self.limiter.acquire(principal.tenant, prompt_tokens, budget * n)
        except RateLimitExceeded as exc:
            self.metrics.rate_limited.labels(principal.tenant, exc.limit_kind).inc()
            raise ApiError(429, str(exc), code="rate_limit_exceeded", type_="rate_limit_error",
                           headers={"Retry-After": exc.retry_after_header()}) from None

    # -- chat --------------------------------------------------------------------------------------------------

    def plan_chat(self, request: ChatCompletionRequest) -> ChatPlan:
        config = self.config
        if _has_images(request.messages):
            raise ApiError(400, "image inputs are not supported by this deployment yet", param="messages")
        tool_choice = request.effective_tool_choice
        forced = tool_choice == "required" or isinstance(tool_choice, dict)
        if tool_choice == "auto" and not (config.enable_auto_tool_choice and config.tool_call_parser):
            raise ApiError(400, '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be '
                                "set", param="tool_choice")
        response_format = request.response_format_json()
        try:
            prompt = self.renderer.render(request.messages, request.tools_json(), request.add_generation_prompt,
                                          request.chat_template_kwargs, tool_choice=tool_choice,
                                          response_format=response_format)
        except ChatFormatError as exc:
            raise ApiError(400, str(exc), param=_chat_param(str(exc))) from None
        self.check_prompt_length(len(prompt.token_ids), request.completion_limit, "messages")
        family_format = self.renderer.output_format
        json_kind = response_format is not None and response_format["type"] in ("json_object", "json_schema")
        tool_parser = None
        if request.tools and tool_choice != "none":
            tool_parser = config.tool_call_parser if tool_choice == "auto" else (
                config.tool_call_parser or family_format)
        reasoning_parser = config.reasoning_parser
        if (forced or json_kind) and reasoning_parser is None:
            reasoning_parser = tool_parser or family_format  # the grammar's wrapping must be read back
        if tool_parser is not None and reasoning_parser is not None and tool_parser != reasoning_parser:
            reasoning_parser = tool_parser
        parsed = tool_parser is not None or reasoning_parser is not None
        sampling = sampling_from_chat(request, skip_special_tokens=False if parsed else request.skip_special_tokens)
        structured = self._structured(request, tool_choice, response_format, family_format,
                                      prompt.starts_in_reasoning)
        if structured is not None:
            sampling.structured_output.CopyFrom(structured)
        return ChatPlan(request, prompt, sampling, tool_parser, reasoning_parser)

    @staticmethod
    def _structured(request: ChatCompletionRequest, tool_choice, response_format: dict | None, output_format: str,
                    starts_in_reasoning: bool) -> StructuredOutput | None:
        common = dict(output_format=output_format, starts_in_reasoning=starts_in_reasoning)
        if tool_choice == "required" or isinstance(tool_choice, dict):
            tools = [StructuredOutput.Tool(name=t.function.name, parameters_json=json.dumps(t.function.parameters)
                                           if t.function.parameters is not None else "") for t in request.tools]
            if tool_choice == "required":
                out = StructuredOutput(kind=StructuredOutput.KIND_TOOL_CALL, tools=tools,
                                       tool_mode=StructuredOutput.TOOL_MODE_REQUIRED, **common)
                if request.parallel_tool_calls is not None:
                    out.parallel_tool_calls = request.parallel_tool_calls
                return out
            return StructuredOutput(kind=StructuredOutput.KIND_TOOL_CALL, tools=tools,
                                    tool_mode=StructuredOutput.TOOL_MODE_NAMED,
                                    tool_name=tool_choice["function"]["name"], **common)
        if response_format is None or response_format["type"] == "text":
            return None
        if response_format["type"] == "json_object":
            return StructuredOutput(kind=StructuredOutput.KIND_JSON_OBJECT, **common)
        schema = response_format["json_schema"]["schema"]
        return StructuredOutput(kind=StructuredOutput.KIND_JSON_SCHEMA, json_schema=json.dumps(schema), **common)

    def check_prompt_length(self, prompt_tokens: int, max_tokens: int | None, param: str) -> None:
        limit = self.max_model_len
        need = prompt_tokens + (max_tokens or 0)
        if prompt_tokens >= limit or need > limit:
            asked = f" + {max_tokens} completion tokens" if max_tokens else ""
            raise ApiError(400, f"this model's maximum context length is {limit} tokens; the request has "
                                f"{prompt_tokens} prompt tokens{asked}", param=param,
                           code="context_length_exceeded")

    def chat(self, principal: Principal, plan: ChatPlan, *, api: str = "rest",
             trace: RequestTrace | None = None) -> ChatRun:
        request = plan.request
        if trace is not None:
            trace.start_span("chat", principal.tenant, plan.sampling, request.n, request.stream)
        lease = self._admit(principal, len(plan.prompt_ids), request.completion_limit, request.n)
        self.metrics.running.labels(api).inc()
        salt = self.tenant_salt(principal, request.cache_salt)
        request_id = f"chatcmpl-{request.request_id or uuid.uuid4().hex}"
        return ChatRun(self, principal, lease, plan, request_id, salt, api, trace)

    # -- completions -------------------------------------------------------------------------------------------

    def complete(self, principal: Principal, job: CompletionJob, *, api: str = "rest",
                 trace: RequestTrace | None = None) -> CompletionRun:
        if trace is not None:
            trace.start_span("text_completion", principal.tenant, job.sampling, job.n, job.stream)
        for prompt in job.prompts:
            self.check_prompt_length(len(prompt), job.max_tokens, "prompt")
        lease = self._admit(principal, sum(len(p) for p in job.prompts), job.max_tokens, job.n * len(job.prompts))
        self.metrics.running.labels(api).inc()
        salt = self.tenant_salt(principal, job.cache_salt)
        request_id = f"cmpl-{job.request_id or uuid.uuid4().hex}"
        return CompletionRun(self, principal, lease, job, request_id, salt, api, trace)

    # -- tokenizer and models ----------------------------------------------------------------------------------

    def tokenize(self, request: TokenizeCompletionRequest | TokenizeChatRequest) -> list[int]:
        if isinstance(request, TokenizeCompletionRequest):
            return self.tokenizer.encode(request.prompt)  # what /v1/completions feeds the model
        if _has_images(request.messages):
            raise ApiError(400, "image inputs are not supported by this deployment yet", param="messages")
        try:
            return self.renderer.render(request.messages, request.tools_json(), request.add_generation_prompt,
                                        request.chat_template_kwargs).token_ids
        except ChatFormatError as exc:
            raise ApiError(400, str(exc), param=_chat_param(str(exc))) from None

    def detokenize(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def model_cards(self) -> list[dict]:
        return [{"id": self.config.model_name, "object": "model", "created": self.created, "owned_by": "kdamesh",
                 "root": self.config.model, "parent": None, "max_model_len": self.max_model_len,
                 "family": self.family}]
