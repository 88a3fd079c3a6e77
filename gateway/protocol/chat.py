"""`/v1/chat/completions` requests: OpenAI chat completions with vLLM's extra sampling fields.

Contract:
- `parse_chat(body, served)` validates a decoded body with `ChatCompletionRequest` and returns it, or raises
  `ApiError` (400 naming the first bad field as `param`; 404 `model_not_found` for a model not in `served`).
  `prompt_logprobs` k (vLLM's) returns the rendered prompt's logprobs (top-level `prompt_logprobs`).
  Fields this gateway cannot honour (`continue_final_message`, `echo`) are refused
  with 400 when set to something that matters, rather than silently dropped. An assistant tool call's
  `function.arguments` must be a string of JSON text (or absent / null): anything else is a 400 naming it.
- `ChatCompletionRequest.effective_tool_choice` is vLLM's reading of `tool_choice` (tools without a choice: "auto");
  `completion_limit` is `max_completion_tokens`, else `max_tokens`.
- `sampling_from_chat(request, skip_special_tokens)` builds the mesh `SamplingParams` (structured output is added
  by the planner, gateway/plan.py).
"""

from __future__ import annotations

import json
from typing import Any, ClassVar, Literal, Union

from pydantic import Field

from gateway.protocol.common import (MAX_LOGPROBS, UINT32_MAX, RequestModel, SamplingRequest, ToolDefinition,
                                     check_served, tools_json, validate_body)
from gateway.protocol.errors import ApiError
from protos import common_pb2

__all__ = ["ChatCompletionRequest", "NamedToolChoice", "parse_chat", "sampling_from_chat"]


class FunctionName(RequestModel):
    name: str


class NamedToolChoice(RequestModel):
    type: Literal["function"] = "function"
    function: FunctionName


class ChatCompletionRequest(SamplingRequest):
    """OpenAI chat completions request, with vLLM's extra sampling fields."""

    messages: list[dict[str, Any]] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=UINT32_MAX)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[ToolDefinition] | None = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
    parallel_tool_calls: bool | None = None
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)  # vLLM's: of the rendered prompt

    # `{"continue_final_message": false}` etc. are fine; only values that change the result are refused.
    UNSUPPORTED: ClassVar[tuple] = SamplingRequest.UNSUPPORTED + (
        ("continue_final_message", bool), ("echo", bool))

    def check(self) -> None:
        """Checks across fields (`ApiError` naming the field)."""
        if self.top_logprobs is not None and self.top_logprobs > 0 and not self.logprobs:
            raise ApiError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
        if self.tool_choice is not None and self.tool_choice != "none" and not self.tools:
            raise ApiError(400, "'tool_choice' needs 'tools'", param="tool_choice")
        if isinstance(self.tool_choice, NamedToolChoice):
            names = [t.function.name for t in self.tools or ()]
            if self.tool_choice.function.name not in names:
                raise ApiError(400, f"'tool_choice' names {self.tool_choice.function.name!r}, which is not among "
                                    f"the tools {names}", param="tool_choice")
        _check_tool_call_arguments(self.messages)
        super().check()

    @property
    def completion_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def effective_tool_choice(self) -> str | dict | None:
        """"none" | "auto" | "required" | {"type": "function", ...}; None when no tools (vLLM: tools default to
        "auto")."""
        if not self.tools:
            return None
        if self.tool_choice is None:
            return "auto"
        if isinstance(self.tool_choice, NamedToolChoice):
            return self.tool_choice.model_dump()
        return self.tool_choice

    def tools_json(self) -> list[dict] | None:
        return tools_json(self.tools)

    def response_format_json(self) -> dict | None:
        if self.response_format is None:
            return None
        return self.response_format.model_dump(by_alias=True, exclude_none=True)


def _check_tool_call_arguments(messages: list[dict[str, Any]]) -> None:
    """400 (param `messages`) unless every assistant tool call's `function.arguments` is absent, null or a string
    of JSON text, as OpenAI's format has it (the chat renderer reads the rest of the message)."""
    for i, message in enumerate(messages):
        calls = message.get("tool_calls") if message.get("role") == "assistant" else None
        for j, call in enumerate(calls if isinstance(calls, list) else ()):
            function = call.get("function") if isinstance(call, dict) else None
            arguments = function.get("arguments") if isinstance(function, dict) else None
            where = f"messages[{i}].tool_calls[{j}].function.arguments"
            if arguments is None:
                continue
            if not isinstance(arguments, str):
                raise ApiError(400, f"{where} must be a string of JSON text, got {type(arguments).__name__}",
                               param="messages")
            try:
                if arguments.strip():
                    json.loads(arguments)
            except ValueError:
                raise ApiError(400, f"{where} is not valid JSON", param="messages") from None


def parse_chat(body: Any, served: set[str]) -> ChatCompletionRequest:
    request = validate_body(ChatCompletionRequest, body)
    check_served(request.model, served)
    request.check()
    return request


def sampling_from_chat(request: ChatCompletionRequest, skip_special_tokens: bool) -> common_pb2.SamplingParams:
    """The mesh sampling parameters of a chat request (structured output is added by the caller)."""
    logprobs = (request.top_logprobs or 0) if request.logprobs else None
    sampling = request.sampling_params(logprobs, skip_special_tokens)
    if request.prompt_logprobs is not None:
        sampling.prompt_logprobs = request.prompt_logprobs
    return sampling
