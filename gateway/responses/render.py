"""A chat run's output as an OpenAI Responses API response: the whole `response` object, or its stream of events.

Contract:
- `ResponseRendering(request, run, ...)` renders one run (`gateway.rest_translated.Rendering` via `rendering()`).
  Output items follow the run's blocks (gateway/output_blocks.py), in order: reasoning → a `reasoning` item (its
  text as one `reasoning_text` content part, `summary` empty), text → an assistant `message` with one
  `output_text` part, a tool call → a `function_call` item (`call_id`, `name`, `arguments`). Item ids are the
  response's id with a kind prefix and the item's index.
- `status`: "completed" when the turn ended (stop, or tool calls), "incomplete" with `incomplete_details.reason`
  "max_output_tokens" at the token limit (another end, e.g. an abort: "incomplete", no reason). `usage`: input /
  cached / output tokens as the run counted them; `output_tokens_details.reasoning_tokens` counts the reasoning
  text re-encoded by the tokenizer.
- Streams, each event with `type` and a rising `sequence_number` (SSE `event:` = the type): `response.created`,
  `response.in_progress`; per item `response.output_item.added`, (`response.content_part.added`), the deltas
  (`response.reasoning_text.delta`, `response.output_text.delta`, `response.function_call_arguments.delta`), their
  `.done` events, (`response.content_part.done`), `response.output_item.done`; finally `response.completed`, or
  `response.incomplete`, with the whole response. An error after the stream started is an `error` event (code,
  message, param) and the stream ends.
- A response with `store` is put into the store (gateway/responses/store.py) when it is complete, with the
  conversation a follow-up continues from.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from gateway.chat_run import ChatRun
from gateway.events import ChatEvent
from gateway.output_blocks import REASONING, TEXT, Block, BlockEvent, BlockSplitter
from gateway.protocol import ApiError
from gateway.responses.protocol import ResponsesRequest
from gateway.responses.store import ResponseStore
from gateway.rest_translated import Rendering, sse_event

ITEM_PREFIX = {REASONING: "rs", TEXT: "msg", "tool_call": "fc"}
COMPLETE = ("stop", "tool_calls")


def response_id(run: ChatRun) -> str:
    return "resp_" + run.id.removeprefix("chatcmpl-")


class ResponseRendering:
    def __init__(self, request: ResponsesRequest, run: ChatRun, store: ResponseStore | None, tenant: str,
                 conversation: list[dict]):
        self.request, self.run, self.store, self.tenant = request, run, store, tenant
        self.conversation = conversation  # the chat messages of the request, without the instructions
        self.id = response_id(run)
        self.created_at = int(time.time())
        self.splitter = BlockSplitter()
        self.finish: str | None = None
        self.sequence = 0

    def rendering(self) -> Rendering:
        return Rendering(self.collect, self.stream, self.error_event)

    # -- the response object -------------------------------------------------------------------------------------

    def item(self, block: Block, status: str = "completed") -> dict:
        item_id = f"{ITEM_PREFIX[block.kind]}_{self.id.removeprefix('resp_')}_{block.index}"
        if block.kind == REASONING:
            return {"id": item_id, "type": "reasoning", "summary": [], "status": status,
                    "content": [{"type": "reasoning_text", "text": block.text}]}
        if block.kind == TEXT:
            return {"id": item_id, "type": "message", "role": "assistant", "status": status,
                    "content": [_output_text(block.text)]}
        return {"id": item_id, "type": "function_call", "call_id": block.call_id, "name": block.name,
                "arguments": block.text, "status": status}

    def body(self, status: str, blocks: list[Block]) -> dict:
        request = self.request
        fmt = request.text.format.model_dump(by_alias=True, exclude_none=True) if (
            request.text and request.text.format) else {"type": "text"}
        reasoning = request.reasoning.model_dump() if request.reasoning else {"effort": None, "summary": None}
        tool_choice = request.tool_choice.model_dump() if hasattr(request.tool_choice, "model_dump") else (
            request.tool_choice or "auto")
        body = {"id": self.id, "object": "response", "created_at": self.created_at, "status": status,
                "completed_at": int(time.time()) if status != "in_progress" else None, "error": None,
                "incomplete_details": None, "instructions": request.instructions,
                "max_output_tokens": request.max_output_tokens, "model": self.run.model,
                "output": [self.item(b) for b in blocks],
                "parallel_tool_calls": request.parallel_tool_calls is not False,
                "previous_response_id": request.previous_response_id, "reasoning": reasoning,
                "store": self.stores, "temperature": request.temperature, "text": {"format": fmt},
                "tool_choice": tool_choice, "tools": [t.model_dump(exclude_none=True) for t in request.function_tools()],
                "top_p": request.top_p, "truncation": "disabled", "usage": None, "user": request.user,
                "metadata": request.metadata or {}}
        if status == "incomplete" and self.finish == "length":
            body["incomplete_details"] = {"reason": "max_output_tokens"}
        if status != "in_progress":
            body["usage"] = self.usage(blocks)
        return body

    @property
    def stores(self) -> bool:
        return self.store is not None and self.store.enabled and self.request.store is not False

    def usage(self, blocks: list[Block]) -> dict:
        usage = self.run.usage()
        reasoning = "".join(b.text for b in blocks if b.kind == REASONING)
        reasoning_tokens = len(self.run.context.tokenizer.encode(reasoning)) if reasoning else 0
        return {"input_tokens": usage.prompt_tokens, "input_tokens_details": {"cached_tokens": usage.cached_tokens},
                "output_tokens": usage.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": min(reasoning_tokens, usage.completion_tokens)},
                "total_tokens": usage.prompt_tokens + usage.completion_tokens}

    def final(self) -> dict:
        """The finished response (stored when asked)."""
        blocks = self.splitter.blocks
        body = self.body("completed" if self.finish in COMPLETE else "incomplete", blocks)
        if self.stores:
            self.store.put(self.tenant, body, self.conversation + [_assistant_message(blocks)])
        return body

    # -- whole and streamed ---------------------------------------------------------------------------------------

    def _take(self, event: ChatEvent) -> list[BlockEvent]:
        if event.finish_reason is not None:
            self.finish = event.finish_reason
        return [e for delta in event.deltas for e in self.splitter.feed(delta)]

    async def collect(self, run: ChatRun) -> dict:
        async for event in run.events():
            self._take(event)
        self.splitter.close()
        return self.final()

    def _sse(self, body: dict) -> str:
        body["sequence_number"] = self.sequence
        self.sequence += 1
        return sse_event(body["type"], body)

    async def stream(self, run: ChatRun, events: AsyncIterator[ChatEvent]) -> AsyncIterator[str]:
        yield self._sse({"type": "response.created", "response": self.body("in_progress", [])})
        yield self._sse({"type": "response.in_progress", "response": self.body("in_progress", [])})
        async for event in events:
            for block_event in self._take(event):
                for body in self._block_events(block_event):
                    yield self._sse(body)
        for block_event in self.splitter.close():
            for body in self._block_events(block_event):
                yield self._sse(body)
        final = self.final()
        yield self._sse({"type": f"response.{final['status']}", "response": final})

    def error_event(self, exc: ApiError) -> str:
        return self._sse({"type": "error", "code": exc.code or exc.type, "message": exc.message, "param": exc.param})

    def _block_events(self, event: BlockEvent) -> list[dict]:
        block = event.block
        where = {"item_id": self.item(block)["id"], "output_index": block.index}
        if event.type == "delta":
            if block.kind == REASONING:
                return [{"type": "response.reasoning_text.delta", **where, "content_index": 0, "delta": event.delta}]
            if block.kind == TEXT:
                return [{"type": "response.output_text.delta", **where, "content_index": 0, "delta": event.delta,
                         "logprobs": []}]
            return [{"type": "response.function_call_arguments.delta", **where, "delta": event.delta}]
        if event.type == "start":
            return _started(self.item(Block(block.kind, block.index, "", block.call_id, block.name), "in_progress"),
                            where)
        return _stopped(block, self.item(block), where)


def _output_text(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _started(item: dict, where: dict) -> list[dict]:
    events = [{"type": "response.output_item.added", "output_index": where["output_index"], "item": item}]
    if item["type"] == "message":
        item["content"] = []
        events.append({"type": "response.content_part.added", **where, "content_index": 0, "part": _output_text("")})
    elif item["type"] == "reasoning":
        item["content"] = []
        events.append({"type": "response.content_part.added", **where, "content_index": 0,
                       "part": {"type": "reasoning_text", "text": ""}})
    return events


def _stopped(block: Block, item: dict, where: dict) -> list[dict]:
    done = {"type": "response.output_item.done", "output_index": where["output_index"], "item": item}
    if block.kind == REASONING:
        part = {"type": "reasoning_text", "text": block.text}
        return [{"type": "response.reasoning_text.done", **where, "content_index": 0, "text": block.text},
                {"type": "response.content_part.done", **where, "content_index": 0, "part": part}, done]
    if block.kind == TEXT:
        return [{"type": "response.output_text.done", **where, "content_index": 0, "text": block.text,
                 "logprobs": []},
                {"type": "response.content_part.done", **where, "content_index": 0, "part": _output_text(block.text)},
                done]
    return [{"type": "response.function_call_arguments.done", **where, "name": block.name,
             "arguments": block.text}, done]


def _assistant_message(blocks: list[Block]) -> dict[str, Any]:
    """The output as the assistant chat message a follow-up's conversation holds."""
    text = "".join(b.text for b in blocks if b.kind == TEXT)
    reasoning = "".join(b.text for b in blocks if b.kind == REASONING)
    message: dict[str, Any] = {"role": "assistant", "content": text or None}
    if reasoning:
        message["reasoning_content"] = reasoning
    calls = [{"id": b.call_id, "type": "function", "function": {"name": b.name, "arguments": b.text}}
             for b in blocks if b.kind == "tool_call"]
    if calls:
        message["tool_calls"] = calls
    elif message["content"] is None:
        message["content"] = ""
    return message
