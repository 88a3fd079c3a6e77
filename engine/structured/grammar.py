"""The grammar of a structured output: an xgrammar structural tag built from `StructuredOutputParams`.

Contract (`GrammarBuilder(params, marker_ids).build()`; xgrammar is imported only here and in the backend):
- The grammar starts where the generation prompt ends. `output_format=None` (JSON kinds only): the whole output is
  the bare JSON. With a family, the JSON is wrapped the way that family's parser reads content: K3 closes
  `response` and the message after it (`<|close|>response<|sep|><|close|>message<|sep|>`); K2 needs nothing.
- `starts_in_reasoning`: the output first holds at most `max_reasoning_tokens` free tokens, then the reasoning
  block is closed (K3 `<|close|>think<|sep|>` and `<|open|>response<|sep|>`, K2 `</think>`).
- Tool calls: K3 writes an empty `response` block, then `<|open|>tools<|sep|>`, each call as
  `<|open|>call tool="NAME" index="k"<|sep|>` + its arguments + `<|close|>call<|sep|>` (k = 1, 2, … the call's
  position in the turn, as gateway/chat/k3.py and the official encoding number them; a forced or single call is
  `index="1"`; at most `K3_MAX_PARALLEL_CALLS` calls), `<|close|>tools<|sep|>`,
  and closes the message; the arguments follow `schema.argument_plan` (`argument` blocks, strings raw and at most
  `max_string_tokens` tokens) or one `<|open|>json type="object"<|sep|>{…}<|close|>json<|sep|>` block. K2 writes
  `<|tool_calls_section_begin|>` + `<|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{json}
  <|tool_call_end|>` … + `<|tool_calls_section_end|>`. After the grammar only the stop tokens may follow.
- Text (`kind="text"`, tool_choice "none"): after the reasoning head, free tokens without any marker; K3 then
  closes `response` and the message, K2 ends at a stop token. No tool block can open.
- Markers (`FAMILY_MARKERS`) are matched by their special ids only (`marker_ids`), and free text never holds one;
  a family whose markers the tokenizer lacks raises `InvalidRequestError`. JSON whitespace is limited to
  `JSON_MAX_WHITESPACE` characters between tokens, so that a model cannot pad forever.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from engine.errors import InvalidRequestError
from engine.structured.params import StructuredOutputParams, ToolSpec
from engine.structured.schema import argument_plan, json_safe_schema
from engine.formats.markers import (K2_ARGUMENT_BEGIN, K2_CALL_BEGIN, K2_CALL_END, K2_SECTION_BEGIN,
                                    K2_SECTION_END, K2_THINK_CLOSE, K2_THINK_OPEN, K3_CLOSE, K3_OPEN, K3_SEP)

JSON_MAX_WHITESPACE = 1
K3_MAX_PARALLEL_CALLS = 8  # K3 calls one turn may hold under parallel_tool_calls (each index is spelled out)
K2_INDEX_PATTERN = r"(0|[1-9][0-9]{0,3})"

# the family's control markers (special tokens), matched by id only
FAMILY_MARKERS = {
    "kimi_k3": (K3_OPEN, K3_CLOSE, K3_SEP),
    "kimi_k2": (K2_SECTION_BEGIN, K2_SECTION_END, K2_CALL_BEGIN, K2_ARGUMENT_BEGIN, K2_CALL_END, K2_THINK_OPEN,
                K2_THINK_CLOSE),
}


class GrammarBuilder:
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
        return self.st.JSONSchemaFormat(json_schema=json_safe_schema(schema), max_whitespace_cnt=JSON_MAX_WHITESPACE)

    def k3_open(self, header: str):
        return self.seq(self.token(K3_OPEN), self.text(header), self.token(K3_SEP))

    def k3_close(self, tag: str):
        return self.seq(self.token(K3_CLOSE), self.text(tag), self.token(K3_SEP))

    # -- the whole output ------------------------------------------------------------------------------------

    def body(self):
        p = self.p
        if p.kind == "tool_call":
            return self.tool_calls()
        if p.kind == "text":
            return self.free_tokens(None)
        return self.json(p.schema if p.kind == "json_schema" else {"type": "object"})

    def build(self):
        p = self.p
        body = self.body()
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
        single = self.p.mode == "named" or not self.p.parallel_tool_calls
        if self.family == "kimi_k3":
            return self.seq(self.k3_open("tools"), self.k3_calls(1 if single else K3_MAX_PARALLEL_CALLS),
                            self.k3_close("tools"))
        calls = [self.k2_call(t) for t in self.p.allowed_tools]
        one = calls[0] if len(calls) == 1 else self.st.OrFormat(elements=calls)
        several = one if single else self.st.PlusFormat(content=one)
        return self.seq(self.token(K2_SECTION_BEGIN), several, self.token(K2_SECTION_END))

    def k3_calls(self, count: int):
        """Calls 1 … at most `count`, the k-th with `index="k"` (K3 numbers a turn's calls from 1, as the chat
        template renders them): call 1, then optionally call 2 and what follows it, and so on."""
        rest = None
        for k in range(count, 0, -1):
            calls = [self.k3_call(t, k) for t in self.p.allowed_tools]
            one = calls[0] if len(calls) == 1 else self.st.OrFormat(elements=calls)
            rest = one if rest is None else self.seq(one, self.st.OptionalFormat(content=rest))
        return rest

    # -- K2: functions.NAME:IDX + JSON arguments -------------------------------------------------------------

    def k2_call(self, tool: ToolSpec):
        return self.seq(self.token(K2_CALL_BEGIN), self.text(f"functions.{tool.name}:"),
                        self.st.RegexFormat(pattern=K2_INDEX_PATTERN), self.token(K2_ARGUMENT_BEGIN),
                        self.json(tool.schema if tool.schema is not None else {"type": "object"}),
                        self.token(K2_CALL_END))

    # -- K3: <|open|>call tool="NAME" index="k"<|sep|> arguments <|close|>call<|sep|> -----------------------

    def k3_call(self, tool: ToolSpec, index: int):
        head = self.k3_open(f'call tool="{_escape_attr(tool.name)}" index="{index}"')
        return self.seq(head, self.k3_arguments(tool.schema), self.k3_close("call"))

    def k3_arguments(self, schema: Mapping | None):
        plan = argument_plan(schema)
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


def _escape_attr(value: str) -> str:
    return value.replace("&", "&amp;").replace('"', "&quot;")

