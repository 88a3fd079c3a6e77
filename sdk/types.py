"""Typed values of the kdamesh SDK: what you pass (`Sampling`, `RetryPolicy`) and what you get back (chunks,
completions, models), plus the conversions to and from the protos of `protos/gateway.proto`.

Messages, tools, `tool_choice` and `response_format` are given in the OpenAI shape (plain dicts), exactly as to the
REST API; `chat_request` / `generate_request` turn them into protos and refuse what cannot be expressed
(`ValueError`, before any network call).
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from protos import common_pb2, gateway_pb2

FINISH_NAMES = {common_pb2.FINISH_REASON_STOP: "stop", common_pb2.FINISH_REASON_LENGTH: "length",
                common_pb2.FINISH_REASON_TOOL_CALLS: "tool_calls", common_pb2.FINISH_REASON_ABORT: "abort",
                common_pb2.FINISH_REASON_ERROR: "error"}
TOOL_MODES = {"auto": gateway_pb2.ToolChoice.MODE_AUTO, "none": gateway_pb2.ToolChoice.MODE_NONE,
              "required": gateway_pb2.ToolChoice.MODE_REQUIRED}
FORMAT_TYPES = {"text": gateway_pb2.ResponseFormat.TYPE_TEXT,
                "json_object": gateway_pb2.ResponseFormat.TYPE_JSON_OBJECT,
                "json_schema": gateway_pb2.ResponseFormat.TYPE_JSON_SCHEMA}


# -- inputs ------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sampling:
    """How to pick output tokens (vLLM's sampling parameters). None: the server's default."""

    max_tokens: int | None = None  # chat: max_completion_tokens; None: up to the context length
    min_tokens: int = 0
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float | None = None
    stop: Sequence[str] = ()
    stop_token_ids: Sequence[int] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    n: int = 1
    skip_special_tokens: bool = True

    def to_proto(self) -> common_pb2.SamplingParams:
        msg = common_pb2.SamplingParams(
            min_tokens=self.min_tokens, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, stop=list(self.stop), stop_token_ids=list(self.stop_token_ids),
            ignore_eos=self.ignore_eos, include_stop_str_in_output=self.include_stop_str_in_output,
            logprobs=self.logprobs, top_logprobs=self.top_logprobs, n=self.n,
            skip_special_tokens=self.skip_special_tokens)
        for name in ("max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
            value = getattr(self, name)
            if value is not None:
                setattr(msg, name, value)
        if self.seed is not None:
            msg.seed = self.seed % (1 << 64)
        return msg


@dataclass(frozen=True)
class RetryPolicy:
    """Retries of calls that fail with UNAVAILABLE before any response arrived: at most `max_attempts` attempts in
    all, waiting `initial_backoff_s * multiplier**k` (capped at `max_backoff_s`, with ±`jitter` relative noise)
    between them, never past the call's deadline."""

    max_attempts: int = 4
    initial_backoff_s: float = 0.1
    max_backoff_s: float = 2.0
    multiplier: float = 2.0
    jitter: float = 0.2

    def __post_init__(self):
        if self.max_attempts < 1:
            raise ValueError("max_attempts must be >= 1")
        if self.initial_backoff_s < 0 or self.max_backoff_s < 0 or self.multiplier < 1 or not 0 <= self.jitter < 1:
            raise ValueError("backoffs must be >= 0, multiplier >= 1, jitter in [0, 1)")

    def backoff(self, retry: int, rand: float) -> float:
        """Seconds to wait before retry number `retry` (1-based); `rand` is uniform in [0, 1)."""
        base = min(self.max_backoff_s, self.initial_backoff_s * self.multiplier ** (retry - 1))
        return base * (1 + self.jitter * (2 * rand - 1))


# -- outputs -----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens served from the prefix cache

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class Logprob:
    token: str
    token_bytes: bytes
    token_id: int
    logprob: float
    top_logprobs: tuple["Logprob", ...] = ()


@dataclass(frozen=True)
class ToolCallDelta:
    """A fragment of a tool call: the first carries `id` and `name`, later ones argument text."""

    index: int
    id: str | None
    name: str | None
    arguments: str


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text of an object

    def parsed_arguments(self) -> Any:
        return json.loads(self.arguments)


@dataclass(frozen=True)
class ChatChunkChoice:
    index: int
    role: str | None
    content: str
    reasoning_content: str
    tool_calls: tuple[ToolCallDelta, ...]
    logprobs: tuple[Logprob, ...]
    finish_reason: str | None
    stop_reason: str | None


@dataclass(frozen=True)
class ChatChunk:
    id: str
    model: str
    created: int
    choices: tuple[ChatChunkChoice, ...]
    usage: Usage | None


@dataclass
class ChatMessage:
    role: str = "assistant"
    content: str = ""
    reasoning_content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)


@dataclass
class ChatChoice:
    index: int
    message: ChatMessage
    finish_reason: str | None = None
    stop_reason: str | None = None
    logprobs: list[Logprob] = field(default_factory=list)


@dataclass
class ChatCompletion:
    id: str
    model: str
    created: int
    choices: list[ChatChoice]
    usage: Usage | None


@dataclass(frozen=True)
class CompletionChunkChoice:
    index: int
    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[Logprob, ...]
    finish_reason: str | None
    stop_reason: str | None


@dataclass(frozen=True)
class CompletionChunk:
    id: str
    model: str
    created: int
    choices: tuple[CompletionChunkChoice, ...]
    usage: Usage | None


@dataclass
class CompletionChoice:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Logprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | None = None


@dataclass
class Completion:
    id: str
    model: str
    created: int
    choices: list[CompletionChoice]
    usage: Usage | None


@dataclass(frozen=True)
class Model:
    id: str
    owned_by: str
    created: int
    max_model_len: int
    root: str
    family: str


# -- requests ----------------------------------------------------------------------------------------------------


def _content(content: Any) -> list[gateway_pb2.ContentPart]:
    if content is None:
        return []
    if isinstance(content, str):
        return [gateway_pb2.ContentPart(text=content)]
    parts = []
    for part in content:
        kind = part.get("type")
        if kind == "text":
            parts.append(gateway_pb2.ContentPart(text=part["text"]))
        elif kind == "image_url":
            url = part["image_url"]["url"] if isinstance(part["image_url"], Mapping) else part["image_url"]
            if url.startswith("data:") and ";base64," in url:
                mime, data = url[5:].split(";base64,", 1)
                parts.append(gateway_pb2.ContentPart(image_data=base64.b64decode(data), image_mime_type=mime))
            else:
                parts.append(gateway_pb2.ContentPart(image_url=url))
        else:
            raise ValueError(f"unsupported content part type {kind!r}")
    return parts


def message_proto(message: Mapping[str, Any]) -> gateway_pb2.ChatMessage:
    """An OpenAI-shaped message dict -> ChatMessage."""
    out = gateway_pb2.ChatMessage(role=message["role"], content=_content(message.get("content")),
                                  name=message.get("name") or "", tool_call_id=message.get("tool_call_id") or "",
                                  reasoning_content=message.get("reasoning_content") or message.get("reasoning")
                                  or "")
    for call in message.get("tool_calls") or ():
        function = call["function"]
        arguments = function.get("arguments", "{}")
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments)
        out.tool_calls.append(gateway_pb2.ToolCall(id=call.get("id", ""), type=call.get("type", "function"),
                                                   function=gateway_pb2.FunctionCall(name=function["name"],
                                                                                     arguments=arguments)))
    return out


def tool_proto(tool: Mapping[str, Any]) -> gateway_pb2.Tool:
    function = tool["function"]
    parameters = function.get("parameters")
    return gateway_pb2.Tool(type=tool.get("type", "function"), function=gateway_pb2.FunctionDefinition(
        name=function["name"], description=function.get("description") or "",
        parameters_json=json.dumps(parameters) if parameters is not None else "",
        strict=bool(function.get("strict"))))


def tool_choice_proto(choice: str | Mapping[str, Any]) -> gateway_pb2.ToolChoice:
    if isinstance(choice, str):
        if choice in TOOL_MODES:
            return gateway_pb2.ToolChoice(mode=TOOL_MODES[choice])
        return gateway_pb2.ToolChoice(function_name=choice)  # a bare function name
    return gateway_pb2.ToolChoice(function_name=choice["function"]["name"])


def response_format_proto(fmt: Mapping[str, Any]) -> gateway_pb2.ResponseFormat:
    kind = fmt.get("type")
    if kind not in FORMAT_TYPES:
        raise ValueError(f"response_format type must be one of {sorted(FORMAT_TYPES)}, got {kind!r}")
    out = gateway_pb2.ResponseFormat(type=FORMAT_TYPES[kind])
    if kind == "json_schema":
        spec = fmt.get("json_schema") or {}
        out.json_schema.CopyFrom(gateway_pb2.ResponseFormat.JsonSchema(
            name=spec.get("name") or "", description=spec.get("description") or "",
            schema_json=json.dumps(spec.get("schema", {"type": "object"})), strict=bool(spec.get("strict"))))
    return out


@dataclass(frozen=True)
class ChatOptions:
    """Chat-only options (OpenAI shapes)."""

    tools: Sequence[Mapping[str, Any]] | None = None
    tool_choice: str | Mapping[str, Any] | None = None
    parallel_tool_calls: bool = True
    response_format: Mapping[str, Any] | None = None
    chat_template_kwargs: Mapping[str, Any] | None = None
    add_generation_prompt: bool = True


def chat_request(model: str, messages: Iterable[Mapping[str, Any]], sampling: Sampling, options: ChatOptions,
                 cache_salt: str | None, user: str | None, priority: int,
                 request_id: str | None) -> gateway_pb2.ChatRequest:
    request = gateway_pb2.ChatRequest(
        model=model, messages=[message_proto(m) for m in messages], sampling=sampling.to_proto(),
        tools=[tool_proto(t) for t in options.tools or ()], parallel_tool_calls=options.parallel_tool_calls,
        chat_template_kwargs_json=json.dumps(dict(options.chat_template_kwargs))
        if options.chat_template_kwargs is not None else "",
        add_generation_prompt=options.add_generation_prompt, cache_salt=cache_salt or "", user=user or "",
        priority=priority, request_id=request_id or "")
    if options.tool_choice is not None:
        request.tool_choice.CopyFrom(tool_choice_proto(options.tool_choice))
    if options.response_format is not None:
        request.response_format.CopyFrom(response_format_proto(options.response_format))
    return request


def generate_request(model: str, prompt: str | Sequence[int], sampling: Sampling, echo: bool,
                     return_token_ids: bool, cache_salt: str | None, user: str | None, priority: int,
                     request_id: str | None) -> gateway_pb2.GenerateRequest:
    request = gateway_pb2.GenerateRequest(model=model, sampling=sampling.to_proto(), echo=echo,
                                          return_token_ids=return_token_ids, cache_salt=cache_salt or "",
                                          user=user or "", priority=priority, request_id=request_id or "")
    if isinstance(prompt, str):
        request.text = prompt
    else:
        request.token_ids.CopyFrom(common_pb2.TokenIds(ids=list(prompt)))
    return request


# -- responses ---------------------------------------------------------------------------------------------------


def _usage(msg) -> Usage | None:
    if not msg.HasField("usage"):
        return None
    u = msg.usage
    return Usage(u.prompt_tokens, u.completion_tokens, u.cached_tokens)


def _logprob(entry: gateway_pb2.LogprobEntry) -> Logprob:
    return Logprob(entry.token, entry.token_bytes, entry.token_id, entry.logprob,
                   tuple(_logprob(t) for t in entry.top_logprobs))


def chat_chunk(msg: gateway_pb2.ChatResponse) -> ChatChunk:
    choices = tuple(ChatChunkChoice(
        index=c.index, role=c.delta.role or None, content=c.delta.content,
        reasoning_content=c.delta.reasoning_content,
        tool_calls=tuple(ToolCallDelta(t.index, t.id or None, t.name or None, t.arguments) for t in c.delta.tool_calls),
        logprobs=tuple(_logprob(lp) for lp in c.logprobs), finish_reason=FINISH_NAMES.get(c.finish_reason),
        stop_reason=c.stop_reason or None) for c in msg.choices)
    return ChatChunk(msg.id, msg.model, msg.created, choices, _usage(msg))


def completion_chunk(msg: gateway_pb2.GenerateResponse) -> CompletionChunk:
    choices = tuple(CompletionChunkChoice(
        index=c.index, text=c.text, token_ids=tuple(c.token_ids), logprobs=tuple(_logprob(lp) for lp in c.logprobs),
        finish_reason=FINISH_NAMES.get(c.finish_reason), stop_reason=c.stop_reason or None) for c in msg.choices)
    return CompletionChunk(msg.id, msg.model, msg.created, choices, _usage(msg))


class ChatAccumulator:
    """Folds chat chunks into a `ChatCompletion` (what a non-streaming call returns)."""

    def __init__(self) -> None:
        self.id, self.model, self.created = "", "", 0
        self.usage: Usage | None = None
        self._choices: dict[int, ChatChoice] = {}
        self._calls: dict[int, dict[int, dict]] = {}

    def add(self, chunk: ChatChunk) -> None:
        self.id, self.model, self.created = chunk.id, chunk.model, chunk.created
        if chunk.usage is not None:
            self.usage = chunk.usage
        for c in chunk.choices:
            choice = self._choices.setdefault(c.index, ChatChoice(c.index, ChatMessage()))
            choice.message.content += c.content
            choice.message.reasoning_content += c.reasoning_content
            choice.logprobs.extend(c.logprobs)
            for t in c.tool_calls:
                call = self._calls.setdefault(c.index, {}).setdefault(t.index, {"id": "", "name": "",
                                                                                 "arguments": ""})
                call["id"] = t.id or call["id"]
                call["name"] = t.name or call["name"]
                call["arguments"] += t.arguments
            if c.finish_reason is not None:
                choice.finish_reason, choice.stop_reason = c.finish_reason, c.stop_reason

    def result(self) -> ChatCompletion:
        for index, calls in self._calls.items():
            self._choices[index].message.tool_calls = [ToolCall(c["id"], c["name"], c["arguments"])
                                                       for _, c in sorted(calls.items())]
        return ChatCompletion(self.id, self.model, self.created, [c for _, c in sorted(self._choices.items())],
                              self.usage)


class CompletionAccumulator:
    """Folds completion chunks into a `Completion`."""

    def __init__(self) -> None:
        self.id, self.model, self.created = "", "", 0
        self.usage: Usage | None = None
        self._choices: dict[int, CompletionChoice] = {}

    def add(self, chunk: CompletionChunk) -> None:
        self.id, self.model, self.created = chunk.id, chunk.model, chunk.created
        if chunk.usage is not None:
            self.usage = chunk.usage
        for c in chunk.choices:
            choice = self._choices.setdefault(c.index, CompletionChoice(c.index))
            choice.text += c.text
            choice.token_ids.extend(c.token_ids)
            choice.logprobs.extend(c.logprobs)
            if c.finish_reason is not None:
                choice.finish_reason, choice.stop_reason = c.finish_reason, c.stop_reason

    def result(self) -> Completion:
        return Completion(self.id, self.model, self.created, [c for _, c in sorted(self._choices.items())],
                          self.usage)


def model_of(card: gateway_pb2.ModelCard) -> Model:
    return Model(card.id, card.owned_by, card.created, card.max_model_len, card.root, card.family)
