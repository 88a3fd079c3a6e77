"""Types shared by the output parsers: OpenAI-style deltas, the parsed message, options, and the marker splitter.

Contract
--------
* Parsers read generated text decoded WITH special-token strings (`IncrementalDetokenizer(tokenizer,
  skip_special_tokens=False)`): the formats' structure is made of special tokens, so they must appear in the text. A
  model that spells a marker with ordinary tokens is indistinguishable from one that emits the special token — the
  same trade-off as vLLM's and SGLang's text-level parsers. The stop token (`<|end_of_msg|>` / `<|im_end|>`) may or
  may not be included; both are handled.
* An `OutputStream` takes text deltas of any size (token boundaries, single characters, anything) through `feed` and
  `finish` and returns `DeltaMessage`s; `fold(all deltas)` equals the non-streaming `parse(whole text)` however the
  text was split. A parser never raises on model output.
* Tool calls are emitted when complete: the first delta of a call carries `index`, `id`, `type: "function"`,
  `function.name` and `function.arguments: ""`; the next carries the arguments (a JSON object text). Holding a call
  back until its end marker is what lets a truncated or malformed call degrade to content in the stream as in the
  non-streaming parse (a delta once sent cannot be withdrawn).
* Reasoning and content are streamed as they come, except text that may be the start of a marker (held until the
  next delta decides it).
* Control tokens never reach `content` or `reasoning` unless the request kept special tokens
  (`ParserOptions.skip_special_tokens=False`): what a parser reports verbatim (a malformed call, an unknown marker,
  the text after the message ends) loses the format's marker strings, as `skip_special_tokens` removes special
  tokens from a completion's text; the text between them stays.
"""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass, field
from typing import Callable, Iterable, Protocol, Sequence


# ----------------------------------------------------------------------------------------------------------------
# Results


@dataclass(frozen=True)
class ToolCall:
    """A complete tool call: `arguments` is the JSON text of an object."""

    index: int
    id: str
    name: str
    arguments: str

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ToolCallDelta:
    """One OpenAI `delta.tool_calls[]` entry; fields left None are omitted."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str | None = None

    def to_openai(self) -> dict:
        out: dict = {"index": self.index}
        if self.id is not None:
            out.update(id=self.id, type="function")
        function = {}
        if self.name is not None:
            function["name"] = self.name
        if self.arguments is not None:
            function["arguments"] = self.arguments
        if function:
            out["function"] = function
        return out


@dataclass(frozen=True)
class DeltaMessage:
    """One streamed delta: reasoning text, content text, or tool-call entries (one kind per delta)."""

    reasoning: str | None = None
    content: str | None = None
    tool_calls: tuple[ToolCallDelta, ...] = ()

    def to_openai(self) -> dict:
        """The `choices[].delta` fields (reasoning under both `reasoning_content` and `reasoning`)."""
        out: dict = {}
        if self.reasoning is not None:
            out.update(reasoning_content=self.reasoning, reasoning=self.reasoning)
        if self.content is not None:
            out["content"] = self.content
        if self.tool_calls:
            out["tool_calls"] = [call.to_openai() for call in self.tool_calls]
        return out


@dataclass(frozen=True)
class ParsedOutput:
    """A whole generation, parsed: None where a part is absent."""

    reasoning: str | None
    content: str | None
    tool_calls: tuple[ToolCall, ...] = ()

    def to_openai_message(self) -> dict:
        """The `choices[].message` of a non-streaming chat completion."""
        message: dict = {"role": "assistant", "content": self.content}
        if self.reasoning is not None:
            message.update(reasoning_content=self.reasoning, reasoning=self.reasoning)
        if self.tool_calls:
            message["tool_calls"] = [call.to_openai() for call in self.tool_calls]
        return message


def fold(deltas: Iterable[DeltaMessage]) -> ParsedOutput:
    """Reassemble streamed deltas into the message they describe."""
    reasoning: list[str] = []
    content: list[str] = []
    calls: dict[int, dict] = {}
    for delta in deltas:
        if delta.reasoning is not None:
            reasoning.append(delta.reasoning)
        if delta.content is not None:
            content.append(delta.content)
        for entry in delta.tool_calls:
            call = calls.setdefault(entry.index, {"id": None, "name": None, "arguments": ""})
            call["id"] = entry.id if entry.id is not None else call["id"]
            call["name"] = entry.name if entry.name is not None else call["name"]
            call["arguments"] += entry.arguments or ""
    tool_calls = tuple(ToolCall(i, c["id"], c["name"], c["arguments"]) for i, c in sorted(calls.items()))
    return ParsedOutput("".join(reasoning) or None, "".join(content) or None, tool_calls)


# ----------------------------------------------------------------------------------------------------------------
# Options and interfaces


def random_call_id(index: int, name: str) -> str:
    """OpenAI-style opaque tool-call id (`call_` + 24 hex digits)."""
    return f"call_{secrets.token_hex(12)}"


@dataclass(frozen=True)
class ParserOptions:
    """How an output parser reads one generation.

    start_in_reasoning: the prompt left the model inside its reasoning block (`RenderedPrompt.starts_in_reasoning`);
        None takes the format's default (K3: True — a missing think-open marker means "already inside think";
        K2: False — reasoning only after a leading `<think>`).
    separate_reasoning: a reasoning parser is enabled; otherwise reasoning text is reported as content.
    parse_tool_calls: a tool-call parser is enabled; otherwise a tool-call section is reported verbatim as content.
    make_call_id: (index, function name) -> id, for formats whose output carries no id (K3).
    skip_special_tokens: the request's `skip_special_tokens`: True removes the format's markers from the text a
        parser reports verbatim (see the module docstring); False keeps them.
    """

    start_in_reasoning: bool | None = None
    separate_reasoning: bool = True
    parse_tool_calls: bool = True
    make_call_id: Callable[[int, str], str] = field(default=random_call_id)
    skip_special_tokens: bool = True


class OutputStream(Protocol):
    def feed(self, text: str) -> list[DeltaMessage]: ...

    def finish(self) -> list[DeltaMessage]: ...

    @property
    def reasoning_chars(self) -> int:
        """Characters of the fed text that the (first) reasoning block took, its closing markup included; 0 when
        reasoning is not separated."""
        ...


class ReasoningExtent:
    """Where the first reasoning block of a stream ends, in characters of the text fed to the parser.

    `reasoning`: the parser state inside reasoning; `undecided`: states that may still enter it (K2's start).
    `advance(size, before, after)` after each piece of `size` characters moved the parser from `before` to `after`.
    """

    def __init__(self, state: str, reasoning: str, undecided: tuple[str, ...] = ()) -> None:
        self._reasoning = reasoning
        self._open = (reasoning, *undecided)
        self.fed = 0
        self.end: int | None = None if state in self._open else 0

    def advance(self, size: int, before: str, after: str) -> None:
        self.fed += size
        if self.end is None and after not in self._open:
            self.end = self.fed if before == self._reasoning else self.fed - size

    def chars(self, separated: bool) -> int:
        if not separated:
            return 0
        return self.end if self.end is not None else self.fed


class OutputParser:
    """One format's parser with its options. Immutable; `stream()` starts one generation, `parse()` reads a whole
    one. A format subclasses it naming its `stream_type` (built from the options)."""

    stream_type: Callable[[ParserOptions], OutputStream]

    def __init__(self, options: ParserOptions | None = None) -> None:
        self.options = options or ParserOptions()

    def stream(self) -> OutputStream:
        return self.stream_type(self.options)

    def parse(self, text: str) -> ParsedOutput:
        return parse_with(self.stream(), text)


def parse_with(stream: OutputStream, text: str) -> ParsedOutput:
    """The non-streaming parse: the whole text as one delta."""
    return fold(stream.feed(text) + stream.finish())


# ----------------------------------------------------------------------------------------------------------------
# Building deltas


class DeltaBuilder:
    """Collects parser events into deltas; consecutive text of one kind merges into one delta. Text loses every
    string of `strip` (the format's markers when special tokens are skipped)."""

    def __init__(self, make_call_id: Callable[[int, str], str], strip: Sequence[str] = ()) -> None:
        self._make_call_id = make_call_id
        self._deltas: list[DeltaMessage] = []
        self._strip = re.compile("|".join(re.escape(m) for m in strip)) if strip else None
        self.num_calls = 0

    def reasoning(self, text: str) -> None:
        self._text("reasoning", text)

    def content(self, text: str) -> None:
        self._text("content", text)

    def text(self, text: str, as_reasoning: bool) -> None:
        """Reasoning or content text, as the parser's state says."""
        self._text("reasoning" if as_reasoning else "content", text)

    def _text(self, kind: str, text: str) -> None:
        """Appends `text` to the last delta when it holds text of this kind, else starts a delta."""
        if self._strip is not None:
            text = self._strip.sub("", text)
        if not text:
            return
        before = getattr(self._deltas[-1], kind) if self._deltas else None
        if before is not None:
            text = before + text
            self._deltas.pop()
        self._deltas.append(DeltaMessage(reasoning=text) if kind == "reasoning" else DeltaMessage(content=text))

    def call(self, name: str, arguments: str, call_id: str | None = None) -> None:
        index = self.num_calls
        self.num_calls += 1
        call_id = call_id if call_id is not None else self._make_call_id(index, name)
        self._deltas.append(DeltaMessage(tool_calls=(ToolCallDelta(index, call_id, name, ""),)))
        self._deltas.append(DeltaMessage(tool_calls=(ToolCallDelta(index, arguments=arguments),)))

    def take(self) -> list[DeltaMessage]:
        deltas, self._deltas = self._deltas, []
        return deltas


# ----------------------------------------------------------------------------------------------------------------
# Splitting a text stream at markers


class MarkerSplitter:
    """Cuts a text stream into `(text, is_marker)` pieces at the given marker strings.

    The pieces of any split of a text, joined in order, are the pieces of the whole text (adjacent text pieces may be
    cut differently): a suffix that could still grow into a marker is held until the next `feed` or `finish`.
    """

    def __init__(self, markers: Sequence[str]) -> None:
        self._re = re.compile("|".join(re.escape(m) for m in sorted(markers, key=len, reverse=True)))
        self._prefixes = {m[:k] for m in markers for k in range(1, len(m))}
        self._longest = max(len(m) for m in markers)
        self._buffer = ""

    def feed(self, text: str) -> list[tuple[str, bool]]:
        buffer = self._buffer + text
        pieces: list[tuple[str, bool]] = []
        at = 0
        for match in self._re.finditer(buffer):
            if match.start() > at:
                pieces.append((buffer[at : match.start()], False))
            pieces.append((match.group(0), True))
            at = match.end()
        cut = len(buffer) - self._held_suffix(buffer, at)
        if cut > at:
            pieces.append((buffer[at:cut], False))
        self._buffer = buffer[cut:]
        return pieces

    def finish(self) -> list[tuple[str, bool]]:
        rest, self._buffer = self._buffer, ""
        return [(rest, False)] if rest else []

    def _held_suffix(self, buffer: str, start: int) -> int:
        for size in range(min(len(buffer) - start, self._longest - 1), 0, -1):
            if buffer[-size:] in self._prefixes:
                return size
        return 0
