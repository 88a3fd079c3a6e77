"""Kimi K2 / Kimi Linear output parser: `<think>…</think>` -> reasoning, the tool-call section -> tool calls.

Contract (see `gateway.parsers.base` for the streaming rules)
--------
Output: `[<think>]REASONING</think>CONTENT[<|tool_calls_section_begin|>` +
`(<|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{json}<|tool_call_end|>)*` +
`<|tool_calls_section_end|>]CONTENT[<|im_end|>]`.

* Reasoning: from the start when `start_in_reasoning` (the prompt ended with `<think>`), or after a `<think>` that
  is the very first thing in the output; it ends at `</think>` or where the tool-call section begins. Unterminated
  reasoning stays reasoning (it has been streamed). `<think>`/`</think>` anywhere else are content text.
* A call's id is the model's `functions.NAME:IDX` (whitespace trimmed; the `functions.` prefix may be missing); the
  name is the part before the last `:`. Its arguments must be a JSON object; they are passed on as the model wrote
  them (trimmed).
* Degrading, never raising: a call whose id does not parse, whose arguments are not a JSON object, or which meets
  an unexpected marker, is reported verbatim as content (its markers only with `skip_special_tokens=False`); one the output leaves unterminated (cut short by
  `max_tokens`) is dropped, so control markup never reaches `content`. Text inside the
  section but outside calls, and text after the section, are content. `<|im_end|>` ends the message; text after it
  is content.
"""

from __future__ import annotations

import json
import re

from engine.formats.markers import (K2_ARGUMENT_BEGIN as ARGUMENT_BEGIN, K2_CALL_BEGIN as CALL_BEGIN,
                                    K2_CALL_END as CALL_END, K2_IM_END as IM_END, K2_OUTPUT_MARKERS as MARKERS,
                                    K2_SECTION_BEGIN as SECTION_BEGIN, K2_SECTION_END as SECTION_END,
                                    K2_THINK_CLOSE as THINK_CLOSE, K2_THINK_OPEN as THINK_OPEN)
from gateway.parsers.base import (DeltaBuilder, DeltaMessage, MarkerSplitter, OutputParser, ParserOptions,
                                   ReasoningExtent)

CALL_ID_RE = re.compile(r"^(?:functions\.)?(?P<name>\S+):(?P<index>\d+)$")

START, THINK, CONTENT, SECTION, CALL_ID, CALL_ARGS, DONE, RAW_SECTION = (
    "start", "think", "content", "section", "call_id", "call_args", "done", "raw_section"
)


def call_from_text(call_id: str, arguments: str) -> tuple[str, str, str] | None:
    """(id, name, arguments) of a complete call, or None when it is malformed."""
    call_id, arguments = call_id.strip(), arguments.strip()
    match = CALL_ID_RE.match(call_id)
    if match is None:
        return None
    try:
        parsed = json.loads(arguments, parse_constant=_reject_constant)
    except (ValueError, RecursionError):
        return None
    return (call_id, match.group("name"), arguments) if isinstance(parsed, dict) else None


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


class K2Stream:
    """One generation's parser state. Not thread-safe; one per request."""

    def __init__(self, options: ParserOptions) -> None:
        self._options = options
        self._state = THINK if options.start_in_reasoning else START
        self._splitter = MarkerSplitter(MARKERS)
        self._out = DeltaBuilder(options.make_call_id, MARKERS if options.skip_special_tokens else ())
        self._raw: list[str] = []  # the call being read, verbatim
        self._call_id = ""
        self._arguments = ""
        self._extent = ReasoningExtent(self._state, THINK, undecided=(START,))

    @property
    def reasoning_chars(self) -> int:
        return self._extent.chars(self._options.separate_reasoning)

    def feed(self, text: str) -> list[DeltaMessage]:
        for piece, is_marker in self._splitter.feed(text):
            self._take(piece, is_marker)
        return self._out.take()

    def _take(self, piece: str, is_marker: bool) -> None:
        before = self._state
        self._on_piece(piece, is_marker)
        self._extent.advance(len(piece), before, self._state)

    def finish(self) -> list[DeltaMessage]:
        for piece, is_marker in self._splitter.finish():
            self._take(piece, is_marker)
        if self._state in (CALL_ID, CALL_ARGS):  # a call cut short by the end of the output: dropped, not content
            self._state = SECTION
        return self._out.take()

    # -- dispatch ------------------------------------------------------------------------------------------------

    def _on_piece(self, piece: str, is_marker: bool) -> None:
        if self._state == START:
            self._state = CONTENT
            if piece == THINK_OPEN:
                self._state = THINK
                return
        if self._state in (CALL_ID, CALL_ARGS):
            self._in_call(piece, is_marker)
        elif self._state == RAW_SECTION:
            self._out.content(piece)
            if piece == SECTION_END:
                self._state = CONTENT
        elif not is_marker:
            self._text(piece)
        else:
            self._marker(piece)

    def _text(self, text: str) -> None:
        self._out.text(text, as_reasoning=self._state == THINK and self._options.separate_reasoning)

    def _marker(self, marker: str) -> None:
        if self._state == DONE:
            if marker != IM_END:
                self._out.content(marker)
        elif marker == IM_END:
            self._state = DONE
        elif marker == THINK_CLOSE and self._state == THINK:
            self._state = CONTENT
        elif marker == SECTION_BEGIN and self._state in (THINK, CONTENT):
            self._enter_section(marker)
        elif marker == SECTION_END and self._state == SECTION:
            self._state = CONTENT
        elif marker == CALL_BEGIN and self._state == SECTION:
            self._raw, self._call_id, self._arguments = [marker], "", ""
            self._state = CALL_ID
        else:
            self._text(marker)

    def _enter_section(self, marker: str) -> None:
        if self._options.parse_tool_calls:
            self._state = SECTION
        else:
            self._state = RAW_SECTION
            self._out.content(marker)

    # -- calls ---------------------------------------------------------------------------------------------------

    def _in_call(self, piece: str, is_marker: bool) -> None:
        if not is_marker:
            self._raw.append(piece)
            if self._state == CALL_ID:
                self._call_id += piece
            else:
                self._arguments += piece
        elif piece == ARGUMENT_BEGIN and self._state == CALL_ID:
            self._raw.append(piece)
            self._state = CALL_ARGS
        elif piece == CALL_END and self._state == CALL_ARGS:
            self._raw.append(piece)
            self._finish_call()
        else:
            self._abandon_call()
            self._marker(piece)

    def _finish_call(self) -> None:
        self._state = SECTION
        call = call_from_text(self._call_id, self._arguments)
        if call is None:
            self._out.content("".join(self._raw))
        else:
            call_id, name, arguments = call
            self._out.call(name, arguments, call_id=call_id)

    def _abandon_call(self) -> None:
        self._state = SECTION
        self._out.content("".join(self._raw))


class K2OutputParser(OutputParser):
    """`--tool-call-parser kimi_k2` / `--reasoning-parser kimi_k2`. Immutable; `stream()` per generation."""

    stream_type = K2Stream
