"""One chat completion request (all its `n` choices) through the mesh, as `ChatEvent`s.

Contract (the lifecycle is `gateway.run.Run`'s):
- `events()` yields, per choice, a first event with the role, then the output parsers' deltas (`gateway.parsers`,
  chosen by the plan; without parsers the text is the content; control tokens reach neither unless the request
  has `skip_special_tokens: false`, which keeps every special token in the parsed text), each carrying the logprobs of the tokens since the
  previous event of that choice, and a last event with the finish reason — "tool_calls" when a turn that stopped
  held parsed calls.
- A choice ends at its stop string, stop token, length or the mesh's finish; once every choice ended the mesh call
  is left (a stop string matched: what the mesh still generates is cancelled). A choice the mesh never finished
  ends with "abort".
"""

from __future__ import annotations

import bisect
from collections.abc import AsyncIterator
from contextlib import aclosing
from gateway.events import ChatEvent
from gateway.mesh_client import MeshRequest, TokenEvent
from gateway.parsers import DeltaMessage, build_output_parser
from gateway.plan import ChatPlan
from gateway.ratelimit import Lease
from gateway.request_trace import RequestTrace
from gateway.run import Run, RunContext
from gateway.tenancy import Principal
from gateway.text import TextRules
from protos import common_pb2


class _ChatChoice:
    def __init__(self, index: int, context: RunContext, plan: ChatPlan):
        self.index = index
        skip = plan.request.skip_special_tokens  # the parsers read the markers; the client may want to see them
        self.text = context.choice_text(TextRules.of(plan.sampling, context.marker_ids if skip else None))
        parser = build_output_parser(plan.tool_parser, plan.reasoning_parser,
                                     start_in_reasoning=plan.prompt.starts_in_reasoning, skip_special_tokens=skip)
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

    def reasoning_tokens(self) -> int:
        """Tokens whose text began inside the reasoning block as the parser read it (its closing markup too)."""
        if self.stream is None:
            return 0
        return bisect.bisect_left(self.text.text_starts, self.stream.reasoning_chars)

    def finish_reason(self) -> str:
        reason = self.text.finish_reason or "abort"
        return "tool_calls" if reason == "stop" and self.has_tool_calls else reason


class ChatRun(Run):
    """One chat completion request (all its choices) through the mesh."""

    endpoint = "chat"
    prompt_param = "messages"

    def __init__(self, context: RunContext, principal: Principal, lease: Lease, plan: ChatPlan, request_id: str,
                 salt: bytes, api: str, trace: RequestTrace | None = None):
        super().__init__(context, principal, lease, request_id, len(plan.prompt_ids), api, trace)
        self.plan = plan
        self.sampling = plan.sampling
        self.salt = salt
        self.stream = plan.request.stream
        self.include_usage = plan.request.include_usage
        self.continuous_usage = plan.request.continuous_usage
        self.choices = [_ChatChoice(i, context, plan) for i in range(plan.request.n)]
        self.prompt_logprobs: list = []  # `prompt_logprobs`: tokens 2..N of the rendered prompt, once the mesh sent them

    def choice_token_counts(self) -> list[int]:
        return [len(c.text.token_ids) for c in self.choices]

    def finish_reasons(self) -> list[str]:
        return [c.finish_reason() for c in self.choices if c.done]

    def reasoning_token_count(self) -> int:
        return sum(c.reasoning_tokens() for c in self.choices)

    async def _items(self) -> AsyncIterator[TokenEvent]:
        request = MeshRequest(request_id=self.mesh_id, prompt_token_ids=tuple(self.plan.prompt_ids),
                              sampling=self.plan.sampling, model=self.model, tenant_salt=self.salt, tenant=self.tenant_share,
                              priority=self.plan.request.priority, timeout_s=self.context.request_timeout_s,
                              media=self.plan.media, snapshot_hints=self.plan.snapshot_hints,
                              streamed=self.stream)
        async with aclosing(self.context.generate(request)) as events:
            async for event in events:
                yield event

    async def events(self) -> AsyncIterator[ChatEvent]:
        for choice in self.choices:
            yield ChatEvent(choice.index, role="assistant")
        async for event in self._mesh_items():
            self._saw_tokens(event)
            self.prompt_logprobs = event.prompt_logprobs or self.prompt_logprobs
            if not 0 <= event.index < len(self.choices) or self.choices[event.index].done:
                continue
            choice = self.choices[event.index]
            text = choice.text.add(event)
            choice.pending_logprobs.extend(event.logprobs[: len(event.token_ids)])
            finished = choice.text.finished
            for item in self._choice_events(choice, choice.feed(text, finished), finished):
                yield item
            if all(c.done for c in self.choices):
                break  # e.g. a stop string matched: cancel what the mesh still generates
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
