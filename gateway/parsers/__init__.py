"""Output parsers, registered by name as `vllm serve` names them: `--tool-call-parser kimi_k3|kimi_k2` and
`--reasoning-parser kimi_k3|kimi_k2`.

Contract
--------
* Each format has one parser that reads the whole assistant message (its reasoning, content and tool calls are one
  grammar): `K3OutputParser` (XTML) and `K2OutputParser` (`<think>` + tool-call section). The two registries map the
  flag values to these classes.
* `build_output_parser(tool_call_parser, reasoning_parser, start_in_reasoning=..., make_call_id=...,
  skip_special_tokens=...)` returns the
  parser for the flags, or None when both are None (the gateway then returns the text as content). The flags must
  name the same format. With only a reasoning parser, tool-call sections stay in the content verbatim; with only a
  tool-call parser, reasoning is reported as content.
* Parsers: `parse(text) -> ParsedOutput(reasoning, content, tool_calls)`; `stream()` -> an object with
  `feed(text_delta) -> list[DeltaMessage]` and `finish() -> list[DeltaMessage]`. Input is text decoded with special
  tokens kept (`skip_special_tokens=False`). They never raise on model output. See `gateway.parsers.base`.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Callable

from gateway.parsers.base import (
    DeltaMessage,
    OutputParser,
    ParsedOutput,
    ParserOptions,
    ToolCall,
    ToolCallDelta,
    fold,
    random_call_id,
)
from gateway.parsers.k2 import K2OutputParser
from gateway.parsers.k3 import K3OutputParser

TOOL_CALL_PARSERS = MappingProxyType({"kimi_k3": K3OutputParser, "kimi_k2": K2OutputParser})
REASONING_PARSERS = MappingProxyType({"kimi_k3": K3OutputParser, "kimi_k2": K2OutputParser})

__all__ = [
    "DeltaMessage",
    "K2OutputParser",
    "K3OutputParser",
    "OutputParser",
    "ParsedOutput",
    "ParserOptions",
    "REASONING_PARSERS",
    "TOOL_CALL_PARSERS",
    "ToolCall",
    "ToolCallDelta",
    "build_output_parser",
    "fold",
]


def _lookup(registry: MappingProxyType, flag: str, name: str | None) -> type | None:
    if name is None:
        return None
    if name not in registry:
        raise ValueError(f"{flag} {name!r} is not registered; choose one of {sorted(registry)}")
    return registry[name]


def build_output_parser(
    tool_call_parser: str | None,
    reasoning_parser: str | None,
    start_in_reasoning: bool | None = None,
    make_call_id: Callable[[int, str], str] = random_call_id,
    skip_special_tokens: bool = True,
) -> OutputParser | None:
    """The parser for the `--tool-call-parser` / `--reasoning-parser` values (None: no parsing)."""
    tool_cls = _lookup(TOOL_CALL_PARSERS, "--tool-call-parser", tool_call_parser)
    reasoning_cls = _lookup(REASONING_PARSERS, "--reasoning-parser", reasoning_parser)
    if tool_cls is not None and reasoning_cls is not None and tool_cls is not reasoning_cls:
        raise ValueError(f"--tool-call-parser {tool_call_parser} and --reasoning-parser {reasoning_parser} "
                         "name different output formats")
    parser_cls = tool_cls or reasoning_cls
    if parser_cls is None:
        return None
    options = ParserOptions(
        start_in_reasoning=start_in_reasoning,
        separate_reasoning=reasoning_cls is not None,
        parse_tool_calls=tool_cls is not None,
        make_call_id=make_call_id,
        skip_special_tokens=skip_special_tokens,
    )
    return parser_cls(options)
