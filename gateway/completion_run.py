"""One /v1/completions request through the mesh: each prompt a mesh request, run concurrently, merged into choices.

Contract (the lifecycle is `gateway.run.Run`'s):
- Choice `p * n + i` is the i-th of the `n` choices of prompt p. `events()` yields `CompletionEvent`s as the mesh
  produces them (text deltas under the choice's stop rules, token ids, logprobs, offsets), with the prompt's text
  first when `echo`; a choice's first event carries the prompt's logprobs when they were asked (`echo` with
  `logprobs`, or `prompt_logprobs`); with `max_tokens` 0 (echo only) the token the mesh ran is dropped and the
  choice ends "length" with no completion tokens; a choice's last event carries its finish reason. A prompt whose choices all ended is left
  (its mesh call cancelled); a choice the mesh never finished ends with "abort".
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import aclosing

from gateway.events import CompletionEvent, PromptLogprobs
from gateway.mesh_client import MeshError, MeshRequest, TokenEvent
from gateway.protocol import CompletionJob
from gateway.ratelimit import Lease
from gateway.request_trace import RequestTrace
from gateway.run import Run, RunContext
from gateway.stall import WorkerStalled
from gateway.tenancy import Principal
from gateway.text import TextRules


class CompletionRun(Run):
    """One /v1/completions request: its prompts through the mesh (concurrently), merged into choices."""

    endpoint = "completions"

    def __init__(self, context: RunContext, principal: Principal, lease: Lease, job: CompletionJob,
                 request_id: str, salt: bytes, api: str, trace: RequestTrace | None = None):
        super().__init__(context, principal, lease, request_id, sum(len(p) for p in job.prompts), api, trace)
        self.job = job
        self.sampling = job.sampling
        self.salt = salt
        self.n = job.request.n  # choices per prompt
        self.stream = job.request.stream
        self.include_usage = job.request.include_usage
        self.continuous_usage = job.request.continuous_usage
        rules = TextRules.of(job.sampling)
        self.choices = {p * self.n + i: context.choice_text(rules) for p in range(len(job.prompts))
                        for i in range(self.n)}
        self.sent_text = {i: 0 for i in self.choices}
        self.echoed: set[int] = set()
        self.done: set[int] = set()
        self.prompt_logprobs: dict[int, list] = {}  # prompt index -> its prompt logprobs (when asked)
        self.prompt_sent: set[int] = set()  # choices whose first event went out

    def choice_token_counts(self) -> list[int]:
        return [len(c.token_ids) for c in self.choices.values()]

    def finish_reasons(self) -> list[str]:
        return [self.choices[i].finish_reason for i in sorted(self.choices) if self.choices[i].finish_reason]

    def prompt_echo(self, p: int) -> str:
        text = self.job.prompt_texts[p]
        return text if text is not None else self.context.tokenizer.decode(self.job.prompts[p])

    async def _pump(self, p: int, queue: asyncio.Queue, end: object) -> None:
        """Puts prompt p's mesh events on `queue` as (p, event), then a `MeshError` if it failed, then `end`."""
        job = self.job
        request = MeshRequest(request_id=f"{self.mesh_id}-{p}", prompt_token_ids=tuple(job.prompts[p]),
                              sampling=job.sampling, model=self.model, tenant_salt=self.salt, tenant=self.tenant_share,
                              priority=job.request.priority, timeout_s=self.context.request_timeout_s,
                              snapshot_hints=job.snapshot_hints, streamed=self.stream)
        try:
            async with aclosing(self.context.generate(request)) as events:
                async for event in events:
                    await queue.put((p, event))
                    if all(self.choices[p * self.n + i].finished for i in range(self.n)):
                        break  # e.g. a stop string matched here: cancel the rest
        except (MeshError, WorkerStalled) as exc:
            await queue.put(exc)
        finally:
            await queue.put(end)

    async def _items(self) -> AsyncIterator[tuple[int, TokenEvent]]:
        """(prompt index, event) from every prompt's mesh request, merged as they come."""
        queue: asyncio.Queue = asyncio.Queue()
        end = object()
        tasks = [asyncio.create_task(self._pump(p, queue, end)) for p in range(len(self.job.prompts))]
        try:
            remaining = len(tasks)
            while remaining:
                item = await queue.get()
                if item is end:
                    remaining -= 1
                elif isinstance(item, (MeshError, WorkerStalled)):
                    raise item
                else:
                    yield item
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def events(self) -> AsyncIterator[CompletionEvent]:
        async for p, event in self._mesh_items():
            self._saw_tokens(event)
            index = p * self.n + event.index
            if index in self.choices and index not in self.done:
                out = self._event(p, index, event)
                if out is not None:
                    yield out
        for index in sorted(self.choices):
            if index not in self.done:
                self.done.add(index)
                yield CompletionEvent(index, text_offset=self.sent_text[index],
                                      logprob_offset=self.sent_text[index], finish_reason="abort")

    def _event(self, p: int, index: int, event: TokenEvent) -> CompletionEvent | None:
        """What a mesh event adds to choice `index` (of prompt p); None when nothing."""
        choice = self.choices[index]
        if event.prompt_logprobs:
            self.prompt_logprobs[p] = event.prompt_logprobs
        if self.job.echo_only:  # max_tokens 0: the one token the mesh ran is not part of the answer
            event = TokenEvent(event.index, [], finish_reason="length" if event.finish_reason else None)
        n_before, lp_before = len(choice.token_ids), len(choice.logprobs)
        delta = choice.add(event)
        echo = ""
        if self.job.request.echo and index not in self.echoed:
            self.echoed.add(index)
            echo = self.prompt_echo(p)
            delta = echo + delta
        if not delta and not choice.finished and not event.token_ids:
            return None
        out = CompletionEvent(index, delta, choice.token_ids[n_before:], choice.logprobs[lp_before:],
                              self.sent_text[index], self.sent_text[index] + len(echo))
        if index not in self.prompt_sent:
            self.prompt_sent.add(index)
            if self.job.sampling.HasField("prompt_logprobs"):
                out.prompt = PromptLogprobs(self.job.prompts[p], self.prompt_logprobs.get(p, []))
        self.sent_text[index] += len(delta)
        if choice.finished:
            self.done.add(index)
            out.finish_reason, out.stop_reason = choice.finish_reason, choice.stop_reason
        return out
