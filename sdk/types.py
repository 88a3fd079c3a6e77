"""Typed values of the kdamesh SDK: what you pass (`Sampling`, `RetryPolicy`, `ChatOptions`) and what you get back
(chunks, completions, models). The conversions to and from the protos of `protos/gateway.proto` are in
`sdk.requests` and `sdk.responses`.

Messages, tools, `tool_choice` and `response_format` are given in the OpenAI shape (plain dicts), exactly as to the
REST API.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from protos import common_pb2

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
    logit_bias: Mapping[int, float] | None = None  # token id -> added to its logit ([-100, 100])

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
        msg.logit_bias.update(self.logit_bias or {})
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


@dataclass(frozen=True)
class ChatOptions:
    """Chat-only options (OpenAI shapes)."""

    tools: Sequence[Mapping[str, Any]] | None = None
    tool_choice: str | Mapping[str, Any] | None = None
    parallel_tool_calls: bool = True
    response_format: Mapping[str, Any] | None = None
    chat_template_kwargs: Mapping[str, Any] | None = None
    add_generation_prompt: bool = True


# -- outputs -----------------------------------------------------------------------------------------------------


# Token counts of a request: the mesh's one `Usage` message (protos/common.proto: prompt_tokens, completion_tokens,
# cached_tokens, reasoning_tokens), the same type the gateway and the workers use; total = prompt + completion.
Usage = common_pb2.Usage


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


C = TypeVar("C")


@dataclass(frozen=True)
class _Chunk(Generic[C]):
    """One streamed message: its response's id, model and creation time, its choices, and `usage` on the last."""

    id: str
    model: str
    created: int
    choices: tuple[C, ...]
    usage: Usage | None


@dataclass
class _Whole(Generic[C]):
    """A whole response: the stream folded (`ChatAccumulator`, `CompletionAccumulator`)."""

    id: str
    model: str
    created: int
    choices: list[C]
    usage: Usage | None


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
class ChatChunk(_Chunk[ChatChunkChoice]):
    """One message of a chat stream."""


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
class ChatCompletion(_Whole[ChatChoice]):
    """A whole chat completion."""


@dataclass(frozen=True)
class CompletionChunkChoice:
    index: int
    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[Logprob, ...]
    finish_reason: str | None
    stop_reason: str | None


@dataclass(frozen=True)
class CompletionChunk(_Chunk[CompletionChunkChoice]):
    """One message of a completion stream."""


@dataclass
class CompletionChoice:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Logprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | None = None


@dataclass
class Completion(_Whole[CompletionChoice]):
    """A whole completion."""


@dataclass(frozen=True)
class Model:
    id: str
    owned_by: str
    created: int
    max_model_len: int
    root: str
    family: str
