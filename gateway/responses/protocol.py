"""`/v1/responses` request bodies: the OpenAI Responses API, as far as the chat path can serve it.

Contract:
- `parse_response_request(body, served)` validates a decoded body with `ResponsesRequest` (strict JSON types, as
  the chat API) and returns it, or raises `ApiError` in the OpenAI envelope: 400 naming the first bad field as
  `param`, 404 `model_not_found` for a model not served.
- Served: `input` (a string, or a list of input items: messages with `input_text` / `input_image` / `output_text`
  parts, `function_call`, `function_call_output`, `reasoning`), `instructions`, function `tools`, `tool_choice`
  ("none" | "auto" | "required" | {"type": "function", "name"}), `parallel_tool_calls`, `max_output_tokens`,
  `temperature`, `top_p`, `stream`, `store` / `previous_response_id` (gateway/responses/store.py), `reasoning.effort`
  (none/minimal: no thinking; low → K3 `thinking_effort` low, medium → high, high/xhigh → max), `text.format`
  (text / json_object / json_schema, enforced by the engine's grammar), `metadata`, `user` (echoed).
- Refused with 400 `unsupported_parameter` when set to something that changes the result: tools other than
  `function`, `background`, `conversation`, `prompt`, `include`, `top_logprobs` > 0, `truncation: "auto"`,
  `max_tool_calls`, `text.verbosity` other than "medium". `reasoning.summary` is accepted: the reasoning comes back
  whole, as the `reasoning_text` content of a `reasoning` item, and its `summary` is empty.
"""

from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import Field, field_validator

from gateway.protocol import ApiError
from gateway.protocol.common import UINT32_MAX, RequestModel, check_served, validate_body

EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
# reasoning.effort -> K3's chat_template_kwargs (thinking, thinking_effort)
EFFORT_KWARGS = {"none": {"thinking": False}, "minimal": {"thinking": False},
                 "low": {"thinking": True, "thinking_effort": "low"},
                 "medium": {"thinking": True, "thinking_effort": "high"},
                 "high": {"thinking": True, "thinking_effort": "max"},
                 "xhigh": {"thinking": True, "thinking_effort": "max"}}


class FunctionTool(RequestModel):
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionChoice(RequestModel):
    type: Literal["function"]
    name: str


class ReasoningConfig(RequestModel):
    effort: Literal[EFFORTS] | None = None  # type: ignore[valid-type]
    summary: Literal["auto", "concise", "detailed"] | None = None


class TextFormat(RequestModel):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(RequestModel):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ResponsesRequest(RequestModel):
    model: str = Field(min_length=1)
    input: Union[str, list[dict[str, Any]]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Union[Literal["none", "auto", "required"], FunctionChoice, None] = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(default=None, ge=1, le=UINT32_MAX)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    stream: bool = False
    store: bool | None = None
    previous_response_id: str | None = None
    reasoning: ReasoningConfig | None = None
    text: TextConfig | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: Literal["auto", "disabled"] | None = None
    include: list[str] | None = None
    background: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    max_tool_calls: int | None = None
    conversation: Any = None
    prompt: Any = None

    @field_validator("input")
    @classmethod
    def _input_not_empty(cls, v):
        if isinstance(v, str) and not v:
            raise ValueError("must not be empty")
        return v

    def function_tools(self) -> list[FunctionTool]:
        """The tools, each a function tool (400 naming `tools[i]` otherwise)."""
        out = []
        for i, tool in enumerate(self.tools or ()):
            if tool.get("type") != "function":
                raise ApiError(400, f"tools[{i}]: tool type {tool.get('type')!r} is not supported by this server "
                                    "(only 'function' tools)", param=f"tools[{i}].type", code="unsupported_parameter")
            out.append(validate_body(FunctionTool, tool))
        names = [t.name for t in out]
        if len(set(names)) != len(names):
            raise ApiError(400, "tools: function names must be unique", param="tools")
        return out

    def check(self) -> None:
        refused = {"background": bool(self.background), "conversation": self.conversation is not None,
                   "prompt": self.prompt is not None, "include": bool(self.include),
                   "top_logprobs": bool(self.top_logprobs), "truncation": self.truncation == "auto",
                   "max_tool_calls": self.max_tool_calls is not None,
                   "text.verbosity": self.text is not None and self.text.verbosity not in (None, "medium")}
        for name, is_set in refused.items():
            if is_set:
                raise ApiError(400, f"'{name}' is not supported by this server", param=name,
                               code="unsupported_parameter")
        if self.text and self.text.format and self.text.format.type == "json_schema" and not self.text.format.schema_:
            raise ApiError(400, "text.format type 'json_schema' needs a 'schema'", param="text.format.schema")
        tools = self.function_tools()
        if self.tool_choice not in (None, "none") and not tools:
            raise ApiError(400, "'tool_choice' needs 'tools'", param="tool_choice")
        if isinstance(self.tool_choice, FunctionChoice) and self.tool_choice.name not in {t.name for t in tools}:
            raise ApiError(400, f"'tool_choice' names {self.tool_choice.name!r}, which is not among the tools",
                           param="tool_choice")


def parse_response_request(body: Any, served: set[str]) -> ResponsesRequest:
    request = validate_body(ResponsesRequest, body)
    check_served(request.model, served)
    request.check()
    return request
