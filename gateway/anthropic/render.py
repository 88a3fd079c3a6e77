"""A chat run's output as an Anthropic Messages API message: the whole `message`, or its stream of events.

Contract:
- `MessageRendering(run)` renders one run (`rendering()` → `gateway.rest_translated.Rendering`). Content blocks
  follow the run's blocks (gateway/output_blocks.py) in order: reasoning → `thinking` (`signature` empty: nothing
  is signed here; with `omit_thinking` — `thinking.display: "omitted"` — its text is left out, streamed or not), text → `text`, a tool call → `tool_use` (`id` the call id, `input` the parsed arguments).
- `stop_reason`: a tool call turn "tool_use", the token limit "max_tokens", a stop sequence "stop_sequence" (with
  `stop_sequence`), another stop "end_turn"; a run the mesh ended without a finish has none (null). `usage`:
  `input_tokens` are the prompt tokens not read from the prefix cache, `cache_read_input_tokens` those read,
  `cache_creation_input_tokens` 0 (no explicit cache writes), `output_tokens` the generated tokens.
- Streams (SSE with `event:` names): `message_start` (the message with empty content; its usage is preliminary),
  `ping`, per block `content_block_start`, `content_block_delta` (`thinking_delta`, `text_delta`,
  `input_json_delta` — a call's arguments in one delta), `content_block_stop`, then `message_delta` (stop reason,
  final usage) and `message_stop`. An error after the stream started is an `error` event in Anthropic's envelope.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from gateway.anthropic.protocol import error_body
from gateway.chat_run import ChatRun
from gateway.events import ChatEvent
from gateway.output_blocks import REASONING, TEXT, Block, BlockEvent, BlockSplitter
from gateway.protocol import ApiError
from gateway.rest_translated import Rendering, sse_event

DELTA_TYPES = {REASONING: ("thinking_delta", "thinking"), TEXT: ("text_delta", "text"),
               "tool_call": ("input_json_delta", "partial_json")}


def message_id(run: ChatRun) -> str:
    return "msg_" + run.id.removeprefix("chatcmpl-")


def arguments_object(arguments: str) -> Any:
    """A call's arguments as JSON; text that is not a JSON object is kept under `"arguments"`."""
    try:
        value = json.loads(arguments) if arguments else {}
    except ValueError:
        value = None
    return value if isinstance(value, dict) else {"arguments": arguments}


def content_block(block: Block, empty: bool = False) -> dict:
    if block.kind == REASONING:
        return {"type": "thinking", "thinking": "" if empty else block.text, "signature": ""}
    if block.kind == TEXT:
        return {"type": "text", "text": "" if empty else block.text}
    return {"type": "tool_use", "id": block.call_id, "name": block.name,
            "input": {} if empty else arguments_object(block.text)}


class MessageRendering:
    def __init__(self, run: ChatRun, omit_thinking: bool = False):
        self.run = run
        self.omit_thinking = omit_thinking  # thinking.display "omitted": thinking blocks without their text
        self.id = message_id(run)
        self.splitter = BlockSplitter()
        self.finish: str | None = None
        self.stop: str | int | None = None

    def rendering(self) -> Rendering:
        return Rendering(self.collect, self.stream, self.error_event)

    def stop_reason(self) -> tuple[str | None, str | None]:
        """(stop_reason, stop_sequence)."""
        if self.finish == "tool_calls":
            return "tool_use", None
        if self.finish == "length":
            return "max_tokens", None
        if self.finish == "stop":
            return ("stop_sequence", self.stop) if isinstance(self.stop, str) else ("end_turn", None)
        return None, None

    def usage(self) -> dict:
        usage = self.run.usage()
        return {"input_tokens": usage.prompt_tokens - usage.cached_tokens, "output_tokens": usage.completion_tokens,
                "cache_read_input_tokens": usage.cached_tokens, "cache_creation_input_tokens": 0}

    def message(self, content: list[dict], final: bool) -> dict:
        stop_reason, stop_sequence = self.stop_reason() if final else (None, None)
        usage = self.usage() if final else {"input_tokens": self.run.prompt_tokens, "output_tokens": 0,
                                            "cache_read_input_tokens": 0, "cache_creation_input_tokens": 0}
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.run.model, "content": content,
                "stop_reason": stop_reason, "stop_sequence": stop_sequence, "usage": usage}

    def _take(self, event: ChatEvent) -> list[BlockEvent]:
        if event.finish_reason is not None:
            self.finish, self.stop = event.finish_reason, event.stop_reason
        return [e for delta in event.deltas for e in self.splitter.feed(delta)]

    async def collect(self, run: ChatRun) -> dict:
        async for event in run.events():
            self._take(event)
        self.splitter.close()
        blocks = self.splitter.blocks
        return self.message([content_block(b, empty=self.omit_thinking and b.kind == REASONING) for b in blocks],
                            final=True)

    async def stream(self, run: ChatRun, events: AsyncIterator[ChatEvent]) -> AsyncIterator[str]:
        yield sse_event("message_start", {"type": "message_start", "message": self.message([], final=False)})
        yield sse_event("ping", {"type": "ping"})
        async for event in events:
            for block_event in self._take(event):
                if self._shown(block_event):
                    yield _block_event(block_event)
        for block_event in self.splitter.close():
            yield _block_event(block_event)
        stop_reason, stop_sequence = self.stop_reason()
        yield sse_event("message_delta", {"type": "message_delta", "usage": self.usage(),
                                          "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence}})
        yield sse_event("message_stop", {"type": "message_stop"})

    def _shown(self, event: BlockEvent) -> bool:
        return not (self.omit_thinking and event.type == "delta" and event.block.kind == REASONING)

    def error_event(self, exc: ApiError) -> str:
        return sse_event("error", error_body(exc, self.run.id))


def _block_event(event: BlockEvent) -> str:
    index = event.block.index
    if event.type == "start":
        return sse_event("content_block_start", {"type": "content_block_start", "index": index,
                                                 "content_block": content_block(event.block, empty=True)})
    if event.type == "stop":
        return sse_event("content_block_stop", {"type": "content_block_stop", "index": index})
    kind, field = DELTA_TYPES[event.block.kind]
    return sse_event("content_block_delta", {"type": "content_block_delta", "index": index,
                                             "delta": {"type": kind, field: event.delta}})
