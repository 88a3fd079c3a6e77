"""`/v1/messages` and `/v1/messages/count_tokens` request bodies (the Anthropic Messages API) and its error envelope.

Contract:
- `parse_messages(body, served)` / `parse_count_tokens(body, served)` validate a decoded body (`MessagesRequest` /
  `CountTokensRequest`, strict JSON types) or raise `ApiError` (400 naming the first bad field as `param`, 404 for
  a model not served); `error_body(exc, request_id)` is the Anthropic envelope `{"type": "error", "error": {"type",
  "message"}, "request_id"}` of any `ApiError`, its `error.type` by status (`ERROR_TYPES`: 400
  invalid_request_error, 401 authentication_error, 403 permission_error, 404 not_found_error, 413
  request_too_large, 429 rate_limit_error, 503 overloaded_error, 504 timeout_error, else api_error).
- Served: `system` (a string or text blocks), `messages` (text, image — base64 or URL —, tool_use / tool_result,
  thinking), `max_tokens`, `stop_sequences`, `temperature` (0..1), `top_p`, `top_k`, custom `tools`
  (`input_schema`), `tool_choice` (auto / any / tool / none, `disable_parallel_tool_use`), `thinking` (enabled /
  adaptive: the model thinks; disabled: it does not; absent: the model's default — K3 thinks; `display: "omitted"`
  returns thinking blocks without their text), `output_config.effort` (K3's `thinking_effort`: low → low,
  medium / high → high, xhigh / max → max), `output_config.format` (or the older `output_format`: a JSON schema the
  engine's grammar enforces), `metadata.user_id`, `stream`. `thinking.budget_tokens` is checked as Anthropic does
  (at least 1024, below `max_tokens`); the model's thinking is bounded by `max_tokens` only. `cache_control` is
  accepted (prefix caching is automatic here).
- Refused with 400 when set: server tools (tool types other than `custom`), `mcp_servers`, `container`,
  `context_management`, `speed: "fast"`.
"""

from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import Field

from gateway.protocol import ApiError
from gateway.protocol.common import UINT32_MAX, RequestModel, check_served, validate_body

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 415: "invalid_request_error",
               429: "rate_limit_error", 503: "overloaded_error", 504: "timeout_error"}
MIN_THINKING_BUDGET = 1024
REFUSED = ("mcp_servers", "container", "context_management")
EFFORTS = {"low": "low", "medium": "high", "high": "high", "xhigh": "max", "max": "max"}  # -> K3 thinking_effort


def error_type(status: int) -> str:
    return ERROR_TYPES.get(status, "api_error")


def error_body(exc: ApiError, request_id: str | None = None) -> dict:
    message = exc.message if not exc.param or exc.param in exc.message else f"{exc.param}: {exc.message}"
    body: dict[str, Any] = {"type": "error", "error": {"type": error_type(exc.status), "message": message}}
    if request_id is not None:
        body["request_id"] = request_id
    return body


class CustomTool(RequestModel):
    type: Literal["custom"] | None = None
    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    input_schema: dict[str, Any]
    cache_control: Any = None  # accepted: prompt caching is automatic here


class ToolChoice(RequestModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class ThinkingConfig(RequestModel):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(default=None, ge=1, le=UINT32_MAX)
    display: Literal["summarized", "omitted"] | None = None


class JsonOutputFormat(RequestModel):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(RequestModel):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: JsonOutputFormat | None = None


class Metadata(RequestModel):
    user_id: str | None = None


class CountTokensRequest(RequestModel):
    model: str = Field(min_length=1)
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: Union[str, list[dict[str, Any]], None] = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None

    @property
    def omits_thinking(self) -> bool:
        return self.thinking is not None and self.thinking.display == "omitted"

    def custom_tools(self) -> list[CustomTool]:
        out = []
        for i, tool in enumerate(self.tools or ()):
            if tool.get("type") not in (None, "custom"):
                raise ApiError(400, f"tools[{i}]: tool type {tool.get('type')!r} is not supported by this server "
                                    "(only custom tools with an input_schema)", param=f"tools.{i}.type")
            out.append(validate_body(CustomTool, tool))
        return out

    def check(self) -> None:
        tools = self.custom_tools()
        choice = self.tool_choice
        if choice is not None and choice.type == "tool":
            if not choice.name or choice.name not in {t.name for t in tools}:
                raise ApiError(400, f"tool_choice names {choice.name!r}, which is not among the tools",
                               param="tool_choice.name")
        elif choice is not None and choice.type in ("auto", "any") and not tools:
            raise ApiError(400, "tool_choice needs tools", param="tool_choice")


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1, le=UINT32_MAX)
    stop_sequences: list[str] | None = Field(default=None, max_length=16)
    stream: bool = False
    temperature: float | None = Field(default=None, ge=0, le=1)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=1, le=(1 << 31) - 1)
    metadata: Metadata | None = None
    service_tier: str | None = None
    speed: Literal["standard", "fast"] | None = None
    cache_control: Any = None  # accepted: prefix caching is automatic here
    output_format: JsonOutputFormat | None = None  # the older name of output_config.format
    mcp_servers: Any = None
    container: Any = None
    context_management: Any = None

    def output_schema(self) -> dict | None:
        fmt = self.output_config.format if self.output_config and self.output_config.format else self.output_format
        return fmt.schema_ if fmt is not None else None

    def check(self) -> None:
        for name in REFUSED:
            if getattr(self, name) is not None:
                raise ApiError(400, f"'{name}' is not supported by this server", param=name)
        if self.speed == "fast":
            raise ApiError(400, "'speed': 'fast' is not supported by this server", param="speed")
        thinking = self.thinking
        if thinking is not None and thinking.type == "enabled":
            budget = thinking.budget_tokens
            if budget is None or not MIN_THINKING_BUDGET <= budget < self.max_tokens:
                raise ApiError(400, f"thinking.budget_tokens must be at least {MIN_THINKING_BUDGET} and less than "
                                    f"max_tokens ({self.max_tokens})", param="thinking.budget_tokens")
        super().check()


def parse_messages(body: Any, served: set[str]) -> MessagesRequest:
    request = validate_body(MessagesRequest, body)
    check_served(request.model, served)
    request.check()
    return request


def parse_count_tokens(body: Any, served: set[str]) -> CountTokensRequest:
    request = validate_body(CountTokensRequest, body)
    check_served(request.model, served)
    request.check()
    return request
