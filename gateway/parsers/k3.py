"""Kimi K3 (XTML) output parser: `think` -> reasoning, `response` -> content, `tools` -> tool calls.

Contract (see `gateway.parsers.base` for the streaming rules)
--------
The model continues the generation prompt, so its output looks like
`REASONING<|close|>think<|sep|><|open|>response<|sep|>CONTENT<|close|>response<|sep|>` +
`[<|open|>tools<|sep|>CALL…<|close|>tools<|sep|>]<|close|>message<|sep|>[<|end_of_msg|>]`, where a CALL is
`<|open|>call tool="NAME" index="k"<|sep|>` + (`<|open|>argument key="K" type="T"<|sep|>VALUE<|close|>argument<|sep|>`)*
+ `<|close|>call<|sep|>`, or holds one `<|open|>json type="object"<|sep|>{…}<|close|>json<|sep|>` block instead.

* The parser starts inside `think` (`start_in_reasoning`, the default: a missing think-open marker means the prompt
  opened it) or inside `response` (thinking off). A redundant opening of that block as the very first thing is
  ignored. Blocks may be left implicitly (`response` or `tools` opening inside `think` ends it); unterminated
  reasoning stays reasoning (it has been streamed), an unterminated response stays content.
* Arguments: `type="string"` values are taken raw; `number`, `boolean`, `null`, `object`, `array` values must be JSON
  of that type. A call's arguments are emitted as `json.dumps(object, ensure_ascii=False)` in argument order; the
  call id comes from `ParserOptions.make_call_id`.
* Degrading, never raising: a call with a bad header, an unknown or mistyped argument, a duplicate key, text between
  its tags, or an unexpected marker is reported as content, verbatim. Unknown markers elsewhere are kept as text of
  the current block. Text after the message ends is content. "Verbatim" keeps the control markers only with
  `skip_special_tokens=False` (base.ParserOptions); by default they are removed and the text between them stays.
* Cut short (the output ends, e.g. at `max_tokens`): a call without its end, and a marker whose header never
  closed, are dropped — control markup never reaches `content`. Calls are emitted only when complete, so the
  stream and the whole-text parse agree (the finish reason then stays "length").
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from engine.formats.markers import (K3_CLOSE as CLOSE, K3_CONTROL_MARKERS as MARKERS, K3_END_OF_MSG as END_OF_MSG,
                                    K3_OPEN as OPEN, K3_SEP as SEP)
from gateway.parsers.base import (DeltaBuilder, DeltaMessage, MarkerSplitter, OutputParser, ParserOptions,
                                   ReasoningExtent)

THINK, RESPONSE, BETWEEN, TOOLS, CALL, ARG, DONE, RAW_TOOLS = (
    "think", "response", "between", "tools", "call", "arg", "done", "raw_tools"
)
HEADER_RE = re.compile(r'^\s*(?P<tag>[A-Za-z_][\w.-]*)(?P<attrs>(?:\s+[\w.-]+="[^"]*")*)\s*$')
ATTR_RE = re.compile(r'([\w.-]+)="([^"]*)"')
ENTITY_RE = re.compile(r"&(amp|quot);")
VALUE_TYPES = {
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "null": lambda v: v is None,
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
}
# state -> {(token kind, tag) -> next state}: the block structure of an assistant message
TRANSITIONS = {
    THINK: {("close", "think"): BETWEEN, ("open", "response"): RESPONSE, ("open", "tools"): TOOLS},
    RESPONSE: {("close", "response"): BETWEEN, ("open", "tools"): TOOLS},
    BETWEEN: {("open", "think"): THINK, ("open", "response"): RESPONSE, ("open", "tools"): TOOLS},
    TOOLS: {("close", "tools"): BETWEEN, ("open", "think"): THINK, ("open", "response"): RESPONSE},
}
MESSAGE_END = {("close", "message"), ("eom", None)}


# ----------------------------------------------------------------------------------------------------------------
# Lexer: text -> tags


@dataclass(frozen=True)
class Token:
    """kind: text | open | close | eom | bad (a stray or unterminated marker). `raw` is the exact source text."""

    kind: str
    raw: str
    tag: str | None = None
    attrs: dict = field(default_factory=dict)


def _unescape(value: str) -> str:
    return ENTITY_RE.sub(lambda m: "&" if m.group(1) == "amp" else '"', value)


def _tag_token(kind: str, header: str, raw: str) -> Token:
    match = HEADER_RE.match(header)
    if match is None:
        return Token("bad", raw)
    attrs = {key: _unescape(value) for key, value in ATTR_RE.findall(match.group("attrs"))}
    if kind == "close" and attrs:
        return Token("bad", raw)
    return Token(kind, raw, match.group("tag"), attrs)


class XtmlLexer:
    """Streams `Token`s out of text: `<|open|>HEADER<|sep|>`, `<|close|>HEADER<|sep|>`, `<|end_of_msg|>`, text."""

    def __init__(self) -> None:
        self._splitter = MarkerSplitter(MARKERS)
        self._marker: str | None = None  # OPEN or CLOSE while its header is being read
        self._header = ""

    def feed(self, text: str) -> list[Token]:
        return self._tokens(self._splitter.feed(text))

    def finish(self) -> list[Token]:
        tokens = self._tokens(self._splitter.finish())
        if self._marker is not None:
            tokens.append(Token("bad", self._marker + self._header))
            self._marker = None
        return tokens

    def _tokens(self, pieces: list[tuple[str, bool]]) -> list[Token]:
        tokens: list[Token] = []
        for piece, is_marker in pieces:
            if self._marker is not None:
                if not is_marker:
                    self._header += piece
                    continue
                raw = self._marker + self._header
                kind = "open" if self._marker == OPEN else "close"
                self._marker = None
                if piece == SEP:
                    tokens.append(_tag_token(kind, self._header, raw + SEP))
                    continue
                tokens.append(Token("bad", raw))
            if not is_marker:
                tokens.append(Token("text", piece))
            elif piece in (OPEN, CLOSE):
                self._marker, self._header = piece, ""
            else:
                tokens.append(Token("eom", piece) if piece == END_OF_MSG else Token("bad", piece))
        return tokens


# ----------------------------------------------------------------------------------------------------------------
# Tool calls


@dataclass
class _CallBuffer:
    """A call being read: everything is kept raw so that a malformed call can become content verbatim."""

    name: str
    raw: list[str]
    arguments: list[tuple[str, str, str]] = field(default_factory=list)  # (kind "argument"|"json", key|"", type)
    values: list[str] = field(default_factory=list)
    stray: str = ""
    ok: bool = True
    closing: str = ""  # tag that ends the value being read ("argument" or "json")

    def text(self) -> str:
        return "".join(self.raw)


def _argument_value(kind: str, value: str) -> object:
    if kind == "string":
        return value
    parsed = json.loads(value, parse_constant=_reject_constant)
    if not VALUE_TYPES[kind](parsed):
        raise ValueError(f"not a {kind}")
    return parsed


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


def call_arguments(call: _CallBuffer) -> str | None:
    """The call's arguments as JSON object text, or None when the call is malformed."""
    if not call.ok or call.stray.strip():
        return None
    kinds = [kind for kind, _, _ in call.arguments]
    try:
        if "json" in kinds:
            if len(kinds) != 1:
                return None
            parsed = json.loads(call.values[0], parse_constant=_reject_constant)
            return json.dumps(parsed, ensure_ascii=False) if isinstance(parsed, dict) else None
        arguments: dict = {}
        for (_, key, value_type), value in zip(call.arguments, call.values):
            if key in arguments:
                return None
            arguments[key] = _argument_value(value_type, value)
        return json.dumps(arguments, ensure_ascii=False)
    except (ValueError, RecursionError):
        return None


# ----------------------------------------------------------------------------------------------------------------
# The state machine


class K3Stream:
    """One generation's parser state. Not thread-safe; one per request."""

    def __init__(self, options: ParserOptions) -> None:
        self._options = options
        start_in_reasoning = True if options.start_in_reasoning is None else options.start_in_reasoning
        self._state = THINK if start_in_reasoning else RESPONSE
        self._first = True
        self._lexer = XtmlLexer()
        self._out = DeltaBuilder(options.make_call_id, MARKERS if options.skip_special_tokens else ())
        self._call: _CallBuffer | None = None
        self._extent = ReasoningExtent(self._state, THINK)

    @property
    def reasoning_chars(self) -> int:
        return self._extent.chars(self._options.separate_reasoning)

    def feed(self, text: str) -> list[DeltaMessage]:
        for token in self._lexer.feed(text):
            self._take(token)
        return self._out.take()

    def _take(self, token: Token) -> None:
        before = self._state
        self._on_token(token)
        self._extent.advance(len(token.raw), before, self._state)

    def finish(self) -> list[DeltaMessage]:
        for token in self._lexer.finish():
            if token.kind != "bad":  # a marker the output ended inside (max_tokens): markup, never content
                self._take(token)
        if self._call is not None:  # a call cut short by the end of the output: dropped, never content
            self._call = None
            self._state = TOOLS
        return self._out.take()

    # -- dispatch ------------------------------------------------------------------------------------------------

    def _on_token(self, token: Token) -> None:
        first, self._first = self._first, False
        if first and token.kind == "open" and token.tag == self._state:
            return  # the block the prompt already opened, opened again
        if self._state == CALL:
            self._in_call(token)
        elif self._state == ARG:
            self._in_argument(token)
        elif self._state == RAW_TOOLS:
            self._in_raw_tools(token)
        else:
            self._in_block(token)

    def _text(self, text: str) -> None:
        self._out.text(text, as_reasoning=self._state == THINK and self._options.separate_reasoning)

    def _in_block(self, token: Token) -> None:
        key = (token.kind, token.tag)
        if token.kind == "text":
            self._text(token.raw)
        elif self._state == DONE:
            if token.kind != "eom":
                self._out.content(token.raw)
        elif key in MESSAGE_END:
            self._state = DONE
        elif key in TRANSITIONS[self._state]:
            self._enter(TRANSITIONS[self._state][key], token)
        elif self._state == TOOLS and key == ("open", "call"):
            self._start_call(token)
        else:
            self._text(token.raw)

    def _enter(self, state: str, token: Token) -> None:
        if state == TOOLS and not self._options.parse_tool_calls:
            self._state = RAW_TOOLS
            self._out.content(token.raw)
        else:
            self._state = state

    def _in_raw_tools(self, token: Token) -> None:
        self._out.content(token.raw)
        if (token.kind, token.tag) == ("close", "tools"):
            self._state = BETWEEN

    # -- calls ---------------------------------------------------------------------------------------------------

    def _start_call(self, token: Token) -> None:
        name = token.attrs.get("tool")
        if not name:
            self._out.content(token.raw)
            return
        self._call = _CallBuffer(name=name, raw=[token.raw])
        self._state = CALL

    def _in_call(self, token: Token) -> None:
        call = self._call
        if token.kind == "text":
            call.raw.append(token.raw)
            call.stray += token.raw
        elif token.kind == "open" and token.tag in ("argument", "json"):
            call.raw.append(token.raw)
            self._start_value(call, token)
        elif (token.kind, token.tag) == ("close", "call"):
            call.raw.append(token.raw)
            self._finish_call()
        else:
            self._abandon_call()
            self._on_token(token)

    def _start_value(self, call: _CallBuffer, token: Token) -> None:
        if token.tag == "json":
            call.ok &= token.attrs.get("type", "object") == "object"
            call.arguments.append(("json", "", "object"))
        else:
            key, value_type = token.attrs.get("key"), token.attrs.get("type")
            call.ok &= key is not None and (value_type == "string" or value_type in VALUE_TYPES)
            call.arguments.append(("argument", key or "", value_type or ""))
        call.values.append("")
        call.closing = token.tag
        self._state = ARG

    def _in_argument(self, token: Token) -> None:
        call = self._call
        if token.kind == "text":
            call.raw.append(token.raw)
            call.values[-1] += token.raw
        elif (token.kind, token.tag) == ("close", call.closing):
            call.raw.append(token.raw)
            self._state = CALL
        else:
            self._abandon_call()
            self._on_token(token)

    def _finish_call(self) -> None:
        call, self._call = self._call, None
        self._state = TOOLS
        arguments = call_arguments(call)
        if arguments is None:
            self._out.content(call.text())
        else:
            self._out.call(call.name, arguments)

    def _abandon_call(self) -> None:
        call, self._call = self._call, None
        self._state = TOOLS
        self._out.content(call.text())


class K3OutputParser(OutputParser):
    """`--tool-call-parser kimi_k3` / `--reasoning-parser kimi_k3`. Immutable; `stream()` per generation."""

    stream_type = K3Stream
