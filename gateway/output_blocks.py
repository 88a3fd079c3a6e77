"""A chat choice's parser deltas as a sequence of output blocks: what the Responses API (output items) and the
Anthropic Messages API (content blocks) stream, where chat completions stream flat deltas.

Contract:
- `BlockSplitter().feed(delta)` takes one `gateway.parsers.DeltaMessage` of a choice, in order, and returns the
  `BlockEvent`s it causes: a block opens ("start") when the kind of output changes — reasoning, text, or a new tool
  call —, the previous one closes ("stop") first, and text / reasoning / tool arguments arrive as "delta"s of the
  open block. Empty text opens nothing. `close()` closes the open block (at the end of the choice). `blocks` holds
  every block so far, in order, with its whole text (reasoning / text) or arguments (a tool call).
- Block indexes count from 0 in the order blocks open; a tool call keeps the parser's call id and function name.
Pure (no I/O); unit-tested in tests/unit/gateway/test_output_blocks.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gateway.parsers import DeltaMessage

REASONING, TEXT, TOOL_CALL = "reasoning", "text", "tool_call"


@dataclass
class Block:
    kind: str  # REASONING | TEXT | TOOL_CALL
    index: int
    text: str = ""  # the reasoning or the text; a tool call's arguments (a JSON object text)
    call_id: str | None = None  # tool calls only
    name: str | None = None


@dataclass(frozen=True)
class BlockEvent:
    type: str  # "start" | "delta" | "stop"
    block: Block
    delta: str = ""


@dataclass
class BlockSplitter:
    blocks: list[Block] = field(default_factory=list)
    _open: Block | None = None
    _calls: dict[int, Block] = field(default_factory=dict)  # the parser's call index -> its block

    def feed(self, delta: DeltaMessage) -> list[BlockEvent]:
        events: list[BlockEvent] = []
        if delta.reasoning:
            events += self._text(REASONING, delta.reasoning)
        if delta.content:
            events += self._text(TEXT, delta.content)
        for entry in delta.tool_calls:
            block = self._calls.get(entry.index)
            if block is None:
                events += self._start(Block(TOOL_CALL, len(self.blocks), call_id=entry.id, name=entry.name))
                block = self._calls[entry.index] = self._open
            if entry.arguments:
                block.text += entry.arguments
                events.append(BlockEvent("delta", block, entry.arguments))
        return events

    def close(self) -> list[BlockEvent]:
        if self._open is None:
            return []
        block, self._open = self._open, None
        return [BlockEvent("stop", block)]

    def _text(self, kind: str, text: str) -> list[BlockEvent]:
        events = [] if self._open is not None and self._open.kind == kind else self._start(
            Block(kind, len(self.blocks)))
        self._open.text += text
        return events + [BlockEvent("delta", self._open, text)]

    def _start(self, block: Block) -> list[BlockEvent]:
        events = self.close()
        self.blocks.append(block)
        self._open = block
        return events + [BlockEvent("start", block)]
