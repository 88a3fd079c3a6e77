"""What a structured output must look like: `StructuredOutputParams` and its `ToolSpec`s, validated on construction.

Contract:
- `StructuredOutputParams` (frozen; invalid values raise `InvalidRequestError` with the OpenAI `param` they come
  from) says what the output must be:
  - `kind="json_object"`: any JSON object; `kind="json_schema"`: a JSON value valid against `json_schema`;
  - `kind="text"`: a message of free text (reasoning, then the answer) in the syntax of `output_format` that
    never opens a tool block and holds no control marker in its text (OpenAI `tool_choice: "none"`);
  - `kind="tool_call"`: one or more tool calls (`mode="required"`: any of `tools`; `mode="named"`: the tool
    `name`, exactly once; `parallel_tool_calls=False`: exactly one call) whose arguments are valid against the
    tool's `parameters` schema, in the syntax of `output_format` (`"kimi_k3"` | `"kimi_k2"`, engine/structured/
    grammar.py), which the gateway's parser of that family reads back.
  `output_format=None` (JSON kinds only) means the whole output is the bare JSON. `starts_in_reasoning=True` says
  the prompt opened the family's reasoning block: the output first holds at most `max_reasoning_tokens` tokens of
  reasoning (0, the default: none; None: unbounded). `max_string_tokens` bounds K3's raw string arguments (None:
  unbounded). `finish_within_budget` steers to the end when the tokens left are just enough (engine/structured/
  budget.py).
- Schemas are checked (JSON, a valid JSON Schema, compilable by xgrammar) and deep-copied on construction: the
  grammar uses `schema` / `ToolSpec.schema`, never the caller's object (which the fields keep, as given).
  A tool's schema without "type" gets "type": "object" (arguments are always an object).
- `key` is the canonical JSON of everything the grammar depends on: the grammar cache key.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from engine.errors import InvalidRequestError
from engine.structured.schema import check_schema

KINDS = ("json_object", "json_schema", "tool_call", "text")
MODES = ("required", "named")
OUTPUT_FORMATS = ("kimi_k3", "kimi_k2")
DEFAULT_MAX_REASONING_TOKENS = 0
DEFAULT_MAX_STRING_TOKENS: int | None = None

_NAME_RE = re.compile(r"^[^\s<>\"&]{1,256}$")


@dataclass(frozen=True)
class ToolSpec:
    """A function tool: its name and the JSON Schema of its arguments, an object (None: any JSON object)."""

    name: str
    parameters: Mapping[str, Any] | None = None

    def __post_init__(self):
        if not isinstance(self.name, str) or not _NAME_RE.match(self.name):
            raise InvalidRequestError(f"tool name must be 1-256 characters without whitespace, quotes or <>, got "
                                      f"{self.name!r}", param="tools")
        _ = self.schema  # checked (and copied) now

    @cached_property
    def schema(self) -> dict | None:
        """The checked deep copy of `parameters`, "type": "object" added when absent."""
        if self.parameters is None:
            return None
        what = f"tool {self.name!r} parameters"
        schema = dict(self.parameters) if isinstance(self.parameters, Mapping) else self.parameters
        if isinstance(schema, dict) and "type" not in schema:
            schema["type"] = "object"
        if isinstance(schema, dict) and schema["type"] != "object":
            raise InvalidRequestError(f"{what} must describe an object, got type {schema['type']!r}", param="tools")
        return check_schema(schema, what, "tools")

    def to_json(self) -> dict:
        return {"name": self.name, "parameters": self.schema}


@dataclass(frozen=True)
class StructuredOutputParams:
    """What the output must look like; see the module docstring."""

    kind: str
    json_schema: Mapping[str, Any] | None = None  # kind "json_schema"
    tools: Sequence[ToolSpec] = ()  # kind "tool_call"
    mode: str = "required"  # "required": >= 1 call of any tool; "named": exactly one call of `name`
    name: str | None = None
    parallel_tool_calls: bool = True  # False: exactly one call
    output_format: str | None = None  # None: bare JSON; "kimi_k3" | "kimi_k2"
    starts_in_reasoning: bool = False  # the generation prompt opened the reasoning block
    max_reasoning_tokens: int | None = DEFAULT_MAX_REASONING_TOKENS  # None: unbounded
    max_string_tokens: int | None = DEFAULT_MAX_STRING_TOKENS  # K3 raw string arguments; None: unbounded
    finish_within_budget: bool = True  # steer to the end when the tokens left are just enough

    def __post_init__(self):
        if self.kind not in KINDS:
            raise self._bad(f"kind must be one of {KINDS}, got {self.kind!r}", "response_format")
        self._check_options()
        if self.kind == "json_schema":
            if self.json_schema is None:
                raise self._bad("kind 'json_schema' needs json_schema")
            _ = self.schema  # checked (and copied) now
        elif self.json_schema is not None:
            raise self._bad(f"json_schema is only for kind 'json_schema', not {self.kind!r}")
        if self.kind == "tool_call":
            self._check_tools()
        elif self.tools or self.name is not None:
            raise self._bad(f"tools are only for kind 'tool_call', not {self.kind!r}")
        if self.kind == "text" and self.output_format is None:
            raise self._bad("kind 'text' needs an output_format (the family's message syntax)", "tool_choice")
        _ = self.key  # fixed now

    def _bad(self, why: str, param: str | None = None) -> InvalidRequestError:
        default = "tools" if self.kind == "tool_call" else "response_format"
        return InvalidRequestError(f"structured output: {why}", param=param or default)

    def _check_options(self) -> None:
        if self.output_format is not None and self.output_format not in OUTPUT_FORMATS:
            raise self._bad(f"output_format must be None or one of {OUTPUT_FORMATS}, got {self.output_format!r}")
        for name in ("starts_in_reasoning", "parallel_tool_calls", "finish_within_budget"):
            if not isinstance(getattr(self, name), bool):
                raise self._bad(f"{name} must be a bool")
        for name in ("max_reasoning_tokens", "max_string_tokens"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
                raise self._bad(f"{name} must be None or an integer >= 0, got {value!r}")
        if self.starts_in_reasoning and self.output_format is None:
            raise self._bad("starts_in_reasoning needs an output_format (the family's reasoning syntax)")

    def _check_tools(self) -> None:
        tools = self.tools
        if not isinstance(tools, (list, tuple)) or not tools or not all(isinstance(t, ToolSpec) for t in tools):
            raise self._bad("kind 'tool_call' needs a non-empty sequence of ToolSpec")
        names = [t.name for t in tools]
        if len(set(names)) != len(names):
            raise self._bad(f"tool names must be unique, got {names}")
        if self.output_format is None:
            raise self._bad("kind 'tool_call' needs an output_format (the family's tool-call syntax)")
        if self.mode not in MODES:
            raise self._bad(f"mode must be one of {MODES}, got {self.mode!r}", "tool_choice")
        if self.mode == "named" and self.name not in names:
            raise self._bad(f"tool_choice names {self.name!r}, which is not among the tools {names}", "tool_choice")
        if self.mode == "required" and self.name is not None:
            raise self._bad("name is only for mode 'named'", "tool_choice")

    @cached_property
    def schema(self) -> dict | None:
        """The checked deep copy of `json_schema` (kind "json_schema"; else None)."""
        if self.kind != "json_schema":
            return None
        return check_schema(self.json_schema, "json_schema", "response_format")

    @cached_property
    def key(self) -> str:
        spec = {"kind": self.kind, "json_schema": self.schema, "tools": [t.to_json() for t in self.tools],
                "mode": self.mode, "name": self.name, "parallel_tool_calls": self.parallel_tool_calls,
                "output_format": self.output_format, "starts_in_reasoning": self.starts_in_reasoning,
                "max_reasoning_tokens": self.max_reasoning_tokens, "max_string_tokens": self.max_string_tokens}
        return json.dumps(spec, sort_keys=True, separators=(",", ":"))

    @property
    def allowed_tools(self) -> tuple[ToolSpec, ...]:
        return tuple(t for t in self.tools if t.name == self.name) if self.mode == "named" else tuple(self.tools)
