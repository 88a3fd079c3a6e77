"""Structured output: grammar-constrained decoding with xgrammar (JSON, JSON Schema, forced tool calls).

Contract
--------
* `StructuredOutputParams` (frozen, validated on construction: `InvalidRequestError`) says what the output must be:
  - `kind="json_object"`: any JSON object; `kind="json_schema"`: a JSON value valid against `json_schema`;
  - `kind="tool_call"`: one or more tool calls (`mode="required"`: any of `tools`; `mode="named"`: the tool
    `name`, exactly once) whose arguments are valid against the tool's `parameters` schema, in the syntax of
    `output_format` (`"kimi_k3"`: XTML `tools`/`call`/`argument` blocks; `"kimi_k2"`: the tool-call section with
    `functions.NAME:IDX` ids and JSON arguments), which the gateway's parser of that family reads back.
  The grammar starts where the generation prompt ends. `output_format=None` (JSON kinds only) means the whole
  output is the bare JSON. With a family, the JSON is wrapped the way that family's parser reads content: K3 closes
  `response` and the message after it (`<|close|>response<|sep|><|close|>message<|sep|>`); K2 needs nothing.
  `starts_in_reasoning=True` says the prompt opened the reasoning block (K3 `<|open|>think<|sep|>`, K2 `<think>`):
  the output first holds at most `max_reasoning_tokens` tokens of reasoning (0, the default: none; None:
  unbounded), then the block is closed (K3 also opens `response`). A forced K3 call comes after an empty
  `response` block; the message then closes. After the grammar ends only the request's stop tokens may follow
  (end-of-message / `<|im_end|>`), so the sequence finishes with "stop".
* K3 arguments: one `argument` block per property (declared order; required ones always, optional ones may be
  left out; strings raw, other types JSON with `type="number|boolean|null|object|array"`), when every property has
  one JSON type (or a list of types) and its strings need no JSON-only keywords; otherwise (anyOf, $ref,
  minLength, pattern, …) the call holds one `<|open|>json type="object"<|sep|>{…}<|close|>json<|sep|>` block,
  which the K3 parser also reads. Raw string values are at most `max_string_tokens` tokens (None: unbounded).
* Special tokens: the control markers of the format (`<|open|>`, `<|close|>`, `<|sep|>`; the K2 tool-call
  markers and `<think>`/`</think>`) can only be produced as their special ids, and only where the grammar puts a
  marker; every other special id is never allowed except the stop tokens once the grammar is complete. (In the
  vocabulary given to xgrammar a marker is a backslash, a NUL byte and its name — text that no JSON string, regex
  or literal of these grammars can hold — and grammars match it by id; other specials are empty, which xgrammar
  never matches.)
* `GrammarBackend` (one per engine, built lazily on the first structured request — xgrammar is imported only
  then): compiles grammars for one tokenizer with an LRU cache, makes one `GrammarState` (matcher) per sequence,
  and masks logits rows: `fill(states, tokens_left) -> bitmask` (CPU), `apply(logits, bitmask, rows)` (in place, on
  the logits' device).
* Finishing within max_tokens (`finish_within_budget`, on by default). The *steered way* to the end takes, at each
  step, one allowed token: the first allowed of a fixed order — stop tokens, closing markers (`<|close|>`,
  `</think>`, `<|tool_call_end|>`, …), then inside free text (a row allowing more than half the vocabulary: a
  string, reasoning) the `"` that ends a JSON string, elsewhere `]`, `}`, `,`, `"`, `0`, `{`, `[`, then opening
  markers — or else the longest allowed token (the biggest step through a literal). Its length is measured on a
  forked matcher whenever an upper bound on it (the last measurement plus `STEER_GROWTH` per token since) says
  the budget may be close. At the first step where the tokens left (`min(max_tokens, max_model_len)` bound) are
  just enough, the sequence follows the steered way to the end; a way longer than the tokens left is not taken
  (the model goes on, so a one-token prefill samples as usual). Near the end (`GUARD_WINDOW` spare tokens), a
  choice between a few different continuations — a tool name, a key, an enum value, `,` or `}` — keeps only the
  tokens after which the steered way still fits, so picking a long tool or an optional argument late cannot
  overrun the budget. Strings, numbers, arrays, optional arguments and extra calls are thus cut short and the
  output still parses and validates, even from a model that never ends them by itself (random weights), instead
  of stopping at the length limit mid-structure. Decisions depend only on the matcher state and the tokens left
  (up to the growth bound), so an imported request continues as the original would have.
* JSON whitespace is limited to one character between tokens (`JSON_MAX_WHITESPACE`) so that a model cannot pad
  forever. Strings with `minLength`/`maxLength` (and no `pattern`/`format`) are given an equivalent `pattern` that
  also excludes control characters and UTF-16 surrogates, which xgrammar 0.2.9 would otherwise allow there
  (invalid JSON; surrogates decode to three U+FFFD and break the length).
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from engine.errors import InvalidRequestError

if TYPE_CHECKING:  # xgrammar (and the transformers it imports) loads only when a structured request arrives
    import torch

logger = logging.getLogger(__name__)

KINDS = ("json_object", "json_schema", "tool_call")
MODES = ("required", "named")
OUTPUT_FORMATS = ("kimi_k3", "kimi_k2")
DEFAULT_MAX_REASONING_TOKENS = 0
DEFAULT_MAX_STRING_TOKENS: int | None = None
JSON_MAX_WHITESPACE = 1
GRAMMAR_CACHE_SIZE = 256
FREE_TEXT_FRACTION = 0.5  # a row allowing more than this share of the vocabulary is inside free text
STEER_GROWTH = 8  # assumed bound on how much one sampled token can lengthen the way to the end
STEER_SLACK = STEER_GROWTH  # steer once a free token could leave too few tokens for the way to the end
STEER_MAX_MEASURE = 4096  # the way to the end is measured up to this many tokens
GUARD_MAX_CANDIDATES = 32  # choices among at most this many tokens are checked one by one near the budget
GUARD_WINDOW = 256  # … when fewer than this many tokens would be spare after the steered way
K3_INDEX_PATTERN = r"[1-9][0-9]{0,2}"
K2_INDEX_PATTERN = r"(0|[1-9][0-9]{0,3})"

# the family's control markers (special tokens), matched by id only
K3_OPEN, K3_CLOSE, K3_SEP = "<|open|>", "<|close|>", "<|sep|>"
K2_SECTION_BEGIN, K2_SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
K2_CALL_BEGIN, K2_ARGUMENT_BEGIN = "<|tool_call_begin|>", "<|tool_call_argument_begin|>"
K2_CALL_END = "<|tool_call_end|>"
K2_THINK_OPEN, K2_THINK_CLOSE = "<think>", "</think>"
FAMILY_MARKERS = {
    "kimi_k3": (K3_OPEN, K3_CLOSE, K3_SEP),
    "kimi_k2": (K2_SECTION_BEGIN, K2_SECTION_END, K2_CALL_BEGIN, K2_ARGUMENT_BEGIN, K2_CALL_END, K2_THINK_OPEN,
                K2_THINK_CLOSE),
}
# steering order of the markers: closing ones before opening ones
CLOSING_MARKERS = (K3_CLOSE, K3_SEP, K2_THINK_CLOSE, K2_CALL_END, K2_SECTION_END)
OPENING_MARKERS = (K3_OPEN, K2_ARGUMENT_BEGIN, K2_CALL_BEGIN, K2_SECTION_BEGIN, K2_THINK_OPEN)
MARKER_PREFIX = b"\\\x00"  # a backslash then NUL: impossible inside JSON, regexes and our literals

_NAME_RE = re.compile(r"^[^\s<>\"&]{1,256}$")
_JSON_TYPES = ("string", "number", "integer", "boolean", "null", "object", "array")
_XTML_TYPE = {"string": "string", "number": "number", "integer": "number", "boolean": "boolean", "null": "null",
              "object": "object", "array": "array"}
# keywords a string property may carry and still be written raw in a K3 argument block
_RAW_STRING_KEYS = {"type", "description", "title", "enum", "const", "default", "examples", "deprecated",
                    "readOnly", "writeOnly", "$comment"}
# keywords of an arguments object that the per-argument (tag) encoding represents exactly
_TAG_OBJECT_KEYS = {"type", "properties", "required", "additionalProperties", "description", "title", "$schema",
                    "$comment", "default", "examples", "strict"}


# ----------------------------------------------------------------------------------------------------------------
# Parameters


@dataclass(frozen=True)
class ToolSpec:
    """A function tool: its name and the JSON Schema of its arguments, an object (None: any JSON object; a schema
    without "type" gets "type": "object")."""

    name: str
    parameters: Mapping[str, Any] | None = None

    def __post_init__(self):
        if not isinstance(self.name, str) or not _NAME_RE.match(self.name):
            raise InvalidRequestError(f"tool name must be 1-256 characters without whitespace, quotes or <>, got "
                                      f"{self.name!r}", param="tools")
        if self.parameters is not None:
            what = f"tool {self.name!r} parameters"
            schema = dict(self.parameters) if isinstance(self.parameters, Mapping) else self.parameters
            if isinstance(schema, dict) and "type" not in schema:
                schema["type"] = "object"  # arguments are always an object
            if isinstance(schema, dict) and schema["type"] != "object":
                raise InvalidRequestError(f"{what} must describe an object, got type {schema['type']!r}",
                                          param="tools")
            object.__setattr__(self, "parameters", _check_schema(schema, what, "tools"))

    def to_json(self) -> dict:
        return {"name": self.name, "parameters": self.parameters}


@dataclass(frozen=True)
class StructuredOutputParams:
    """What the output must look like; see the module docstring. Schemas are deep-copied on construction."""

    kind: str
    json_schema: Mapping[str, Any] | None = None  # kind "json_schema"
    tools: tuple[ToolSpec, ...] = ()  # kind "tool_call"
    mode: str = "required"  # "required": >= 1 call of any tool; "named": exactly one call of `name`
    name: str | None = None
    parallel_tool_calls: bool = True  # False: exactly one call
    output_format: str | None = None  # None: bare JSON; "kimi_k3" | "kimi_k2"
    starts_in_reasoning: bool = False  # the generation prompt opened the reasoning block
    max_reasoning_tokens: int | None = DEFAULT_MAX_REASONING_TOKENS  # None: unbounded
    max_string_tokens: int | None = DEFAULT_MAX_STRING_TOKENS  # K3 raw string arguments; None: unbounded
    finish_within_budget: bool = True  # steer to the end when the tokens left are just enough (see below)
    key: str = field(init=False, repr=False, compare=False)  # canonical JSON: the grammar cache key

    def __post_init__(self):
        param = "tools" if self.kind == "tool_call" else "response_format"

        def bad(why: str, which: str = param) -> InvalidRequestError:
            return InvalidRequestError(f"structured output: {why}", param=which)

        if self.kind not in KINDS:
            raise bad(f"kind must be one of {KINDS}, got {self.kind!r}", "response_format")
        if self.output_format is not None and self.output_format not in OUTPUT_FORMATS:
            raise bad(f"output_format must be None or one of {OUTPUT_FORMATS}, got {self.output_format!r}")
        for name in ("starts_in_reasoning", "parallel_tool_calls", "finish_within_budget"):
            if not isinstance(getattr(self, name), bool):
                raise bad(f"{name} must be a bool")
        for name in ("max_reasoning_tokens", "max_string_tokens"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
                raise bad(f"{name} must be None or an integer >= 0, got {value!r}")
        if self.starts_in_reasoning and self.output_format is None:
            raise bad("starts_in_reasoning needs an output_format (the family's reasoning syntax)")
        if self.kind == "json_schema":
            if self.json_schema is None:
                raise bad("kind 'json_schema' needs json_schema")
            object.__setattr__(self, "json_schema", _check_schema(self.json_schema, "json_schema", param))
        elif self.json_schema is not None:
            raise bad(f"json_schema is only for kind 'json_schema', not {self.kind!r}")
        if self.kind == "tool_call":
            self._check_tools(bad)
        elif self.tools or self.name is not None:
            raise bad(f"tools are only for kind 'tool_call', not {self.kind!r}")
        object.__setattr__(self, "key", json.dumps(self._spec(), sort_keys=True, separators=(",", ":")))

    def _check_tools(self, bad) -> None:
        tools = tuple(self.tools) if isinstance(self.tools, (list, tuple)) else None
        if not tools or not all(isinstance(t, ToolSpec) for t in tools):
            raise bad("kind 'tool_call' needs a non-empty sequence of ToolSpec")
        object.__setattr__(self, "tools", tools)
        names = [t.name for t in tools]
        if len(set(names)) != len(names):
            raise bad(f"tool names must be unique, got {names}")
        if self.output_format is None:
            raise bad("kind 'tool_call' needs an output_format (the family's tool-call syntax)")
        if self.mode not in MODES:
            raise bad(f"mode must be one of {MODES}, got {self.mode!r}", "tool_choice")
        if self.mode == "named" and self.name not in names:
            raise bad(f"tool_choice names {self.name!r}, which is not among the tools {names}", "tool_choice")
        if self.mode == "required" and self.name is not None:
            raise bad("name is only for mode 'named'", "tool_choice")

    def _spec(self) -> dict:
        return {"kind": self.kind, "json_schema": self.json_schema, "tools": [t.to_json() for t in self.tools],
                "mode": self.mode, "name": self.name, "parallel_tool_calls": self.parallel_tool_calls,
                "output_format": self.output_format, "starts_in_reasoning": self.starts_in_reasoning,
                "max_reasoning_tokens": self.max_reasoning_tokens, "max_string_tokens": self.max_string_tokens}

    @property
    def allowed_tools(self) -> tuple[ToolSpec, ...]:
        return tuple(t for t in self.tools if t.name == self.name) if self.mode == "named" else self.tools


def _check_schema(schema: Any, what: str, param: str) -> dict:
    """A deep copy of `schema` after checking it is a JSON Schema object that xgrammar can compile."""
    if not isinstance(schema, Mapping):
        raise InvalidRequestError(f"{what} must be a JSON Schema object, got {type(schema).__name__}", param=param)
    try:
        schema = json.loads(json.dumps(schema, allow_nan=False))
    except (TypeError, ValueError) as exc:
        raise InvalidRequestError(f"{what} is not JSON: {exc}", param=param) from None
    try:
        from jsonschema.exceptions import SchemaError
        from jsonschema.validators import validator_for
    except ImportError:  # optional: xgrammar's converter below catches most invalid schemas too
        pass
    else:
        try:
            validator_for(schema).check_schema(schema)
        except SchemaError as exc:
            raise InvalidRequestError(f"{what} is not a valid JSON Schema: {exc.message}", param=param) from None
    import xgrammar as xgr

    try:
        xgr.Grammar.from_json_schema(_json_safe_schema(schema))
    except Exception as exc:  # xgrammar raises RuntimeError/ValueError with the converter's message
        message = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
        raise InvalidRequestError(f"{what} is not supported: {message}", param=param) from None
    return schema


def _json_safe_schema(schema: Any) -> Any:
    """A copy where every length-bounded string without pattern/format gets an equivalent pattern that keeps out
    control characters, UTF-16 surrogates, quotes and backslashes (xgrammar's length-bounded strings would let raw
    control characters and surrogates through: not JSON, and a surrogate decodes to three characters)."""
    if isinstance(schema, list):
        return [_json_safe_schema(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: _json_safe_schema(value) for key, value in schema.items()}
    types = out.get("type")
    is_string = types == "string" or (isinstance(types, list) and types == ["string"])
    if is_string and ("minLength" in out or "maxLength" in out) and "pattern" not in out and "format" not in out:
        low = out.get("minLength", 0)
        high = out.get("maxLength")
        if isinstance(low, int) and (high is None or isinstance(high, int)):
            out["pattern"] = "^[^\\x00-\\x1f\"\\\\\\ud800-\\udfff]{%d,%s}$" % (low, "" if high is None else high)
            out.pop("minLength", None)
            out.pop("maxLength", None)
    return out


# ----------------------------------------------------------------------------------------------------------------
# Grammars (xgrammar structural tags)


class _Builder:
    """Builds the structural tag of one `StructuredOutputParams` for a tokenizer's marker ids."""

    def __init__(self, params: StructuredOutputParams, marker_ids: Mapping[str, int]):
        import xgrammar.structural_tag as st

        self.st = st
        self.p = params
        self.family = params.output_format
        if self.family is not None:
            missing = [m for m in FAMILY_MARKERS[self.family] if m not in marker_ids]
            if missing:
                raise InvalidRequestError(f"output_format {self.family!r} needs the special tokens {missing}, which "
                                          "this model's tokenizer does not have", param="response_format")
        self.ids = marker_ids
        self.excluded = sorted(marker_ids.values())

    # -- pieces ----------------------------------------------------------------------------------------------

    def token(self, marker: str):
        return self.st.TokenFormat(token=self.ids[marker])

    def text(self, value: str):
        return self.st.ConstStringFormat(value=value)

    def seq(self, *elements):
        flat = [e for e in elements if e is not None]
        return flat[0] if len(flat) == 1 else self.st.SequenceFormat(elements=flat)

    def free_tokens(self, max_tokens: int | None):
        """Any tokens but the markers (and never a special), at most `max_tokens` of them; None when 0."""
        if max_tokens == 0:
            return None
        return self.st.AnyTokensFormat(exclude_tokens=self.excluded, max_tokens=max_tokens)

    def json(self, schema: Any):
        return self.st.JSONSchemaFormat(json_schema=_json_safe_schema(schema), max_whitespace_cnt=JSON_MAX_WHITESPACE)

    def k3_open(self, header: str):
        return self.seq(self.token(K3_OPEN), self.text(header), self.token(K3_SEP))

    def k3_close(self, tag: str):
        return self.seq(self.token(K3_CLOSE), self.text(tag), self.token(K3_SEP))

    # -- the whole output ------------------------------------------------------------------------------------

    def build(self):
        p = self.p
        body = self.tool_calls() if p.kind == "tool_call" else self.json(
            p.json_schema if p.kind == "json_schema" else {"type": "object"})
        if self.family is None:
            return self.st.StructuralTag(format=body)
        if self.family == "kimi_k3":
            if p.starts_in_reasoning:
                head = self.seq(self.free_tokens(p.max_reasoning_tokens), self.k3_close("think"),
                                self.k3_open("response"))
            else:
                head = None
            if p.kind == "tool_call":  # an empty response, then the tools block
                fmt = self.seq(head, self.k3_close("response"), body, self.k3_close("message"))
            else:
                fmt = self.seq(head, body, self.k3_close("response"), self.k3_close("message"))
        else:
            head = self.seq(self.free_tokens(p.max_reasoning_tokens), self.token(K2_THINK_CLOSE)) \
                if p.starts_in_reasoning else None
            fmt = self.seq(head, body)
        return self.st.StructuralTag(format=fmt)

    def tool_calls(self):
        calls = [self.k3_call(t) if self.family == "kimi_k3" else self.k2_call(t) for t in self.p.allowed_tools]
        one = calls[0] if len(calls) == 1 else self.st.OrFormat(elements=calls)
        several = one if self.p.mode == "named" or not self.p.parallel_tool_calls else self.st.PlusFormat(content=one)
        if self.family == "kimi_k3":
            return self.seq(self.k3_open("tools"), several, self.k3_close("tools"))
        return self.seq(self.token(K2_SECTION_BEGIN), several, self.token(K2_SECTION_END))

    # -- K2: functions.NAME:IDX + JSON arguments -------------------------------------------------------------

    def k2_call(self, tool: ToolSpec):
        return self.seq(self.token(K2_CALL_BEGIN), self.text(f"functions.{tool.name}:"),
                        self.st.RegexFormat(pattern=K2_INDEX_PATTERN), self.token(K2_ARGUMENT_BEGIN),
                        self.json(tool.parameters if tool.parameters is not None else {"type": "object"}),
                        self.token(K2_CALL_END))

    # -- K3: <|open|>call tool="NAME" index="k"<|sep|> arguments <|close|>call<|sep|> -----------------------

    def k3_call(self, tool: ToolSpec):
        head = self.seq(self.token(K3_OPEN), self.text(f'call tool="{_escape_attr(tool.name)}" index="'),
                        self.st.RegexFormat(pattern=K3_INDEX_PATTERN), self.text('"'), self.token(K3_SEP))
        return self.seq(head, self.k3_arguments(tool.parameters), self.k3_close("call"))

    def k3_arguments(self, schema: Mapping | None):
        plan = _argument_plan(schema)
        if plan is None:  # one JSON block holds the whole arguments object
            return self.seq(self.k3_open('json type="object"'),
                            self.json(schema if schema is not None else {"type": "object"}), self.k3_close("json"))
        parts = []
        for key, branches, required in plan:
            options = [self.k3_argument(key, xtml_type, sub) for xtml_type, sub in branches]
            one = options[0] if len(options) == 1 else self.st.OrFormat(elements=options)
            parts.append(one if required else self.st.OptionalFormat(content=one))
        if not parts:
            return None
        return self.seq(*parts)

    def k3_argument(self, key: str, xtml_type: str, schema: dict):
        header = self.k3_open(f'argument key="{_escape_attr(key)}" type="{xtml_type}"')
        return self.seq(header, self.k3_value(xtml_type, schema), self.k3_close("argument"))

    def k3_value(self, xtml_type: str, schema: dict):
        if xtml_type != "string":
            return self.json(schema)
        values = schema.get("enum", [schema["const"]] if "const" in schema else None)
        if values is not None:
            literals = [self.text(v) for v in values if isinstance(v, str)]
            return literals[0] if len(literals) == 1 else self.st.OrFormat(elements=literals)
        return self.st.AnyTokensFormat(exclude_tokens=self.excluded, max_tokens=self.p.max_string_tokens)


def _int32_bit(bit: int) -> int:
    """The int32 value with only `bit` set (bit 31 is the sign bit)."""
    return (1 << bit) - (1 << 32) if bit == 31 else 1 << bit


def _escape_attr(value: str) -> str:
    return value.replace("&", "&amp;").replace('"', "&quot;")


def _argument_plan(schema: Mapping | None) -> list[tuple[str, list[tuple[str, dict]], bool]] | None:
    """[(key, [(xtml type, value schema), …], required)] for the per-argument encoding, or None when the schema
    needs the JSON block (see the module docstring)."""
    if schema is None or not isinstance(schema, Mapping) or not set(schema) <= _TAG_OBJECT_KEYS:
        return None
    if schema.get("type", "object") != "object" or not isinstance(schema.get("properties", {}), Mapping):
        return None
    properties = schema.get("properties", {})
    required = schema.get("required", [])
    if not isinstance(required, list) or not set(required) <= set(properties):
        return None
    plan = []
    for key, sub in properties.items():
        branches = _value_branches(sub)
        if branches is None or not key:
            return None
        plan.append((key, branches, key in required))
    return plan


def _value_branches(schema: Any) -> list[tuple[str, dict]] | None:
    """[(xtml type, schema of the value for that type)], or None when a value has no single-type encoding."""
    if not isinstance(schema, Mapping) or any(k in schema for k in ("anyOf", "oneOf", "allOf", "not", "$ref", "if")):
        return None
    schema = dict(schema)
    values = schema["enum"] if "enum" in schema else [schema["const"]] if "const" in schema else None
    if values is not None:
        kinds = {_json_type_of(v) for v in values}
        if len(kinds) != 1 or None in kinds:
            return None
        (kind,) = kinds
        types = [kind]
    else:
        declared = schema.get("type")
        types = [declared] if isinstance(declared, str) else declared
        if not isinstance(types, list) or not types or not all(t in _JSON_TYPES for t in types):
            return None
        if "number" in types and "integer" in types:
            types = [t for t in types if t != "integer"]
    branches = []
    for t in types:
        sub = dict(schema, type=t) if values is None else schema
        if t == "string" and not set(sub) <= _RAW_STRING_KEYS:
            return None  # minLength, pattern, format, …: only JSON strings express them exactly
        branches.append((_XTML_TYPE[t], sub))
    if len({x for x, _ in branches}) != len(branches):
        return None
    return branches


def _json_type_of(value: Any) -> str | None:
    if isinstance(value, bool):
        return "boolean"
    if value is None:
        return "null"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number" if math.isfinite(value) else None
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object" if isinstance(value, dict) else None


# ----------------------------------------------------------------------------------------------------------------
# The backend: compiler, cache, matchers, masks


class GrammarState:
    """One sequence's matcher. `fill` before sampling, `accept` every sampled token; not thread-safe."""

    def __init__(self, matcher, stop_token_ids: tuple[int, ...], finish_within_budget: bool):
        self._matcher = matcher
        self.stop_token_ids = stop_token_ids
        self.finish_within_budget = finish_within_budget
        self.steering = False  # latched once the tokens left are just enough to finish
        self.measured: tuple[int, int] | None = None  # (tokens left, steered way's length) when last measured

    def need_bound(self, tokens_left: int) -> float:
        """An upper bound on the steered way's length now (each sampled token adds at most STEER_GROWTH)."""
        if self.measured is None:
            return math.inf
        left, need = self.measured
        return need + (left - tokens_left) * STEER_GROWTH

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token_id: int) -> bool:
        """Advances past `token_id`; False (nothing changes) when the grammar does not allow it."""
        return self._matcher.accept_token(token_id)

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and a stop token has been accepted."""
        return self._matcher.is_terminated()

    @property
    def is_completed(self) -> bool:
        """The grammar is complete: only stop tokens may follow."""
        return self._matcher.is_completed()


class GrammarBackend:
    """Compiles `StructuredOutputParams` for one tokenizer and masks logits. Built lazily (imports xgrammar)."""

    def __init__(self, tokenizer, vocab_size: int, max_threads: int | None = None):
        import xgrammar as xgr

        self._xgr = xgr
        self.vocab_size = vocab_size
        vocab: list[bytes] = []
        self.marker_ids: dict[str, int] = {}
        markers = {m for family in FAMILY_MARKERS.values() for m in family}
        for token_id in range(vocab_size):
            if token_id >= tokenizer.vocab_size:
                vocab.append(b"")  # padding rows of the model's vocabulary: never allowed
            elif tokenizer.is_special(token_id):
                content = tokenizer.id_to_bytes(token_id)
                name = content.decode("utf-8", errors="replace")
                if name in markers:
                    self.marker_ids[name] = token_id
                    vocab.append(MARKER_PREFIX + content)
                else:
                    vocab.append(b"")  # xgrammar treats empty tokens as special: never allowed
            else:
                vocab.append(tokenizer.id_to_bytes(token_id))
        self.eos_token_ids = tuple(tokenizer.stop_token_ids)
        info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=vocab_size,
                                 stop_token_ids=list(self.eos_token_ids) or None)
        self._compiler = xgr.GrammarCompiler(info, max_threads=max_threads or min(8, os.cpu_count() or 1),
                                             cache_enabled=False)
        self._cache: OrderedDict[str, Any] = OrderedDict()
        self._lock = threading.Lock()
        # steering orders (ids): end the message, close blocks/strings/containers, then the shortest values
        closers = [self.marker_ids[m] for m in CLOSING_MARKERS if m in self.marker_ids]
        openers = [self.marker_ids[m] for m in OPENING_MARKERS if m in self.marker_ids]
        text = {c: tokenizer.token_to_id(c) for c in '"]},0{['}
        text = {c: t for c, t in text.items() if t is not None}
        stops = list(self.eos_token_ids)
        self._free_text_order = stops + closers + [text[c] for c in '"' if c in text]
        self._token_lengths = np.array([len(b) for b in vocab], dtype=np.int32)
        self._token_bytes = vocab
        self._structure_order = stops + closers + [text[c] for c in ']},"0{[' if c in text] + openers

    def compile(self, params: StructuredOutputParams):
        """The compiled grammar (cached by `params.key`); InvalidRequestError when it cannot be built."""
        with self._lock:
            compiled = self._cache.get(params.key)
            if compiled is not None:
                self._cache.move_to_end(params.key)
                return compiled
        tag = _Builder(params, self.marker_ids).build()
        try:
            compiled = self._compiler.compile_structural_tag(tag)
        except Exception as exc:
            message = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
            raise InvalidRequestError(f"structured output: the grammar cannot be built: {message}",
                                      param="tools" if params.kind == "tool_call" else "response_format") from None
        with self._lock:
            self._cache[params.key] = compiled
            while len(self._cache) > GRAMMAR_CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def new_state(self, params: StructuredOutputParams, stop_token_ids: Sequence[int]) -> GrammarState:
        """A fresh matcher; after the grammar completes only `stop_token_ids` are allowed."""
        stops = tuple(sorted(set(stop_token_ids))) or self.eos_token_ids
        if not stops:
            raise InvalidRequestError("structured output needs a stop token (the model declares none)",
                                      param="stop_token_ids")
        matcher = self._xgr.GrammarMatcher(self.compile(params), override_stop_tokens=list(stops))
        return GrammarState(matcher, stops, params.finish_within_budget)

    def fill(self, states: Sequence[GrammarState | None], tokens_left: Sequence[int]) -> torch.Tensor:
        """A bitmask [len(states), ceil(V/32)] int32 (CPU): row i allows what `states[i]` allows (all when None),
        narrowed so that the sequence still ends within `tokens_left[i]` (output tokens it may still produce, this
        one included; see "Finishing within max_tokens")."""
        bitmask = self._xgr.allocate_token_bitmask(len(states), self.vocab_size)
        for row, state in enumerate(states):
            if state is None:
                continue
            state.fill(bitmask, row)
            if state.finish_within_budget and not state.is_completed:
                self._fit_budget(bitmask, row, state, tokens_left[row])
        return bitmask

    # -- finishing within max_tokens ---------------------------------------------------------------------------

    def _fit_budget(self, bitmask: torch.Tensor, row: int, state: GrammarState, left: int) -> None:
        """Narrows `bitmask[row]`: to the steering token once steering is latched; near the budget, at a choice
        between a few different continuations (a tool, a key, an enum value, `,` or `}`), to the ones after which
        the steered way still fits; otherwise leaves the row alone. The way is measured only when its bound
        (`need_bound`) says the budget may be close, so the steps where this acts do not depend on when measuring
        started (an imported request, which starts afresh, acts where the original would have)."""
        if state.steering:
            return self._keep(bitmask, row, [self._steer_token(bitmask[row])])
        ids = self._allowed_ids(bitmask[row])
        branching = len(ids) <= GUARD_MAX_CANDIDATES and not self._one_literal(ids)
        if left - state.need_bound(left) - STEER_SLACK > (GUARD_WINDOW if branching else 0):
            return None  # far from the end
        need = self._steered_length(state._matcher, limit=min(left, STEER_MAX_MEASURE))
        state.measured = (left, need)
        if need > left:  # it no longer fits (or, at prefill, max_tokens is 1): leave it to the model
            return None
        if left - need <= STEER_SLACK:
            state.steering = True
            return self._keep(bitmask, row, [self._steer_token(bitmask[row])])
        if branching and left - need - STEER_SLACK <= GUARD_WINDOW:
            fitting = [int(t) for t in ids if self._fits_after(state, int(t), left - 1)]
            if len(fitting) < len(ids):
                self._keep(bitmask, row, fitting)
        return None

    def _fits_after(self, state: GrammarState, token: int, budget: int) -> bool:
        matcher = state._matcher.fork()
        return matcher.accept_token(token) and self._steered_length(matcher, budget, fork=False) <= budget

    def _steered_length(self, matcher, limit: int, fork: bool = True) -> int:
        """Tokens (the stop token included) the steered way from `matcher`'s state takes to the end; `limit` + 1
        when it is longer than `limit`."""
        if fork:
            matcher = matcher.fork()
        bitmask = self._xgr.allocate_token_bitmask(1, self.vocab_size)
        count = 0
        while not matcher.is_completed():
            if count >= limit:
                return limit + 1
            matcher.fill_next_token_bitmask(bitmask, 0)
            if not matcher.accept_token(self._steer_token(bitmask[0])):
                return limit + 1
            count += 1
        return count + 1

    def _allowed_ids(self, row: torch.Tensor) -> np.ndarray:
        """The ids a bitmask row [ceil(V/32)] int32 allows, ascending."""
        words = row.numpy()
        nonzero = np.flatnonzero(words)  # [n] words with an allowed token
        bits = np.unpackbits(words[nonzero].view(np.uint8), bitorder="little").reshape(len(nonzero), 32)
        ids = (nonzero[:, None] * 32 + np.arange(32))[bits.astype(bool)]
        return ids[ids < self.vocab_size]

    def _one_literal(self, ids: np.ndarray) -> bool:
        """All allowed tokens are prefixes of the longest one: a literal, not a choice."""
        texts = [self._token_bytes[t] for t in ids]
        longest = max(texts, key=len, default=b"")
        return all(longest.startswith(t) for t in texts)

    def _steer_token(self, row: torch.Tensor) -> int:
        """The first allowed token of the steering order, else the longest allowed token (a literal's biggest
        step); `row` is one bitmask row [ceil(V/32)] int32."""
        words = row.numpy()
        ids = self._allowed_ids(row)
        order = self._free_text_order if len(ids) > FREE_TEXT_FRACTION * self.vocab_size else self._structure_order
        for token in order:
            if int(words[token >> 5]) & (1 << (token & 31)):
                return token
        return int(ids[np.argmax(self._token_lengths[ids])])

    @staticmethod
    def _keep(bitmask: torch.Tensor, row: int, tokens: Sequence[int]) -> None:
        bitmask[row].zero_()
        for token in tokens:
            bitmask[row, token >> 5] |= _int32_bit(token & 31)

    def apply(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int]) -> None:
        """Sets disallowed entries of `logits[rows]` ([L, V] fp32) to -inf, in place."""
        self._xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True),
                                              vocab_size=self.vocab_size, indices=list(rows))


# ----------------------------------------------------------------------------------------------------------------
# OpenAI-shaped helpers for the gateway


def tool_specs(tools: Sequence[Mapping[str, Any]]) -> tuple[ToolSpec, ...]:
    """OpenAI `tools` (`{"type": "function", "function": {"name", "parameters"}}`) -> ToolSpecs."""
    if not isinstance(tools, (list, tuple)):
        raise InvalidRequestError("tools must be a list", param="tools")
    specs = []
    for tool in tools:
        function = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(function, Mapping) or tool.get("type", "function") != "function":
            raise InvalidRequestError("each tool must be {'type': 'function', 'function': {...}}", param="tools")
        specs.append(ToolSpec(function.get("name"), function.get("parameters")))
    return tuple(specs)


def structured_from_openai(*, response_format: Mapping[str, Any] | None = None,
                           tools: Sequence[Mapping[str, Any]] | None = None, tool_choice: Any = None,
                           output_format: str | None, starts_in_reasoning: bool = False,
                           parallel_tool_calls: bool = True,
                           max_reasoning_tokens: int | None = DEFAULT_MAX_REASONING_TOKENS,
                           ) -> StructuredOutputParams | None:
    """The constraint an OpenAI chat request asks for, or None (free text).

    `tool_choice` "required" or `{"type": "function", "function": {"name": N}}` forces calls (and wins over
    `response_format`, whose content a forced call leaves empty); "auto", "none" or None force nothing — with
    "none" the gateway must simply not parse calls. `response_format` `{"type": "json_object"}` or
    `{"type": "json_schema", "json_schema": {"schema": {...}}}` constrains the content; "text" or None nothing."""
    common = dict(output_format=output_format, starts_in_reasoning=starts_in_reasoning,
                  max_reasoning_tokens=max_reasoning_tokens)
    if tool_choice == "required" or isinstance(tool_choice, Mapping):
        specs = tool_specs(tools or [])
        if not specs:
            raise InvalidRequestError("tool_choice forces a call but no tools are given", param="tool_choice")
        if tool_choice == "required":
            return StructuredOutputParams("tool_call", tools=specs, mode="required",
                                          parallel_tool_calls=parallel_tool_calls, **common)
        function = tool_choice.get("function")
        if tool_choice.get("type") != "function" or not isinstance(function, Mapping):
            raise InvalidRequestError("tool_choice must be 'none', 'auto', 'required' or "
                                      "{'type': 'function', 'function': {'name': ...}}", param="tool_choice")
        return StructuredOutputParams("tool_call", tools=specs, mode="named", name=function.get("name"), **common)
    if tool_choice not in (None, "auto", "none"):
        raise InvalidRequestError(f"tool_choice {tool_choice!r} is not supported", param="tool_choice")
    if response_format is None:
        return None
    kind = response_format.get("type") if isinstance(response_format, Mapping) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputParams("json_object", **common)
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema", {"type": "object"}) if isinstance(spec, Mapping) else None
        if schema is None:
            raise InvalidRequestError("response_format.json_schema must be an object with a `schema`",
                                      param="response_format")
        return StructuredOutputParams("json_schema", json_schema=schema, **common)
    raise InvalidRequestError(f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
                              param="response_format")
