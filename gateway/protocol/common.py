"""What the two OpenAI generation requests share: the pydantic base, tools and response formats, and the sampling
fields with their checks (`SamplingRequest`), validated once here for chat and completions alike.

Contract:
- `validate_body(model_type, body)` validates a decoded JSON body with a pydantic model: `ApiError` 400 for a body
  that is not an object or a bad field (the first one, as `param`). Unknown top-level fields are ignored (as vLLM
  does), except the vLLM/OpenAI fields this server does not implement (`UNIMPLEMENTED_FIELDS`): set, they are a
  400 naming them. Types are strict (no string-to-number or string-to-boolean coercion; an integer is a valid float), and every
  number has a range that fits the mesh's protobuf field (uint32 token counts and ids, int32 `top_k`, finite float32
  sampling floats), so no value reaches a proto it cannot be stored in; strings are bounded too: at most
  `MAX_STOP_STRINGS` stop strings of `MAX_STOP_STRING_CHARS` characters each, `user` / `cache_salt` / `request_id`
  of `MAX_ID_CHARS`.
- `check_served(model, served)`: `ApiError` 404 `model_not_found` for a model this gateway does not serve.
- `SamplingRequest` holds vLLM's sampling fields with their ranges (`stream_options`: `include_usage`, and vLLM's
  `continuous_usage_stats`, usage so far on every chunk); `check()` raises `ApiError` for what spans
  fields (`stream_options` without `stream`, `min_tokens` above the completion limit) and for fields this gateway
  cannot honour when set to something that matters (`UNSUPPORTED`); `sampling_params(logprobs,
  skip_special_tokens)` builds the mesh `SamplingParams` (`seed` taken modulo 2^64; `logprobs` None: none, k: the
  sampled token's plus the top k; `logit_bias` keys, token ids as strings, become the proto map's ids; ids beyond the
  vocabulary are the workers' 400). `kdamesh_snapshot_hints` (kdamesh's extension, a list of integers) is checked
  against the prompt length where that is known (`gateway.hints.check_client_hints`).
"""

from __future__ import annotations

import math
import struct
from collections.abc import Iterable, Sequence
from typing import Any, ClassVar, Literal, TypeVar, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from gateway.protocol.errors import ApiError, not_found_model, validation_error
from protos import common_pb2

MAX_LOGPROBS = 20
MAX_N = 128
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 2048  # one stop string (the detokeniser matches each against the output's tail)
MAX_ID_CHARS = 256  # user, cache_salt, request_id
MAX_STOP_TOKEN_IDS = 1024
MAX_SNAPSHOT_HINTS = 1024
MAX_LOGIT_BIAS = 300  # entries, as OpenAI (engine/sampling.py MAX_LOGIT_BIAS)
HINTS_PARAM = "kdamesh_snapshot_hints"
UINT32_MAX = (1 << 32) - 1  # the mesh's token counts and ids are uint32
INT32_MAX = (1 << 31) - 1  # top_k is int32
FLOAT32_MAX = 3.4028234663852886e38  # sampling floats are float32 on the mesh
M = TypeVar("M", bound=BaseModel)


def _float32(v: float) -> float:
    return struct.unpack("f", struct.pack("f", v))[0]


class RequestModel(BaseModel):
    # strict: JSON types are taken as they are — "5" is not an integer, "yes" not a boolean (floats take integers)
    model_config = ConfigDict(extra="ignore", strict=True)


# Fields of vLLM's or OpenAI's API that a client may expect to work but this server does not implement: refused by
# name (400 `unsupported_parameter`) when set, never silently ignored like other unknown fields. Value: what to use.
UNIMPLEMENTED_FIELDS = {
    "guided_json": "response_format {type: json_schema}", "guided_regex": "", "guided_choice": "",
    "guided_grammar": "", "guided_decoding_backend": "", "structured_outputs": "response_format",
    "allowed_token_ids": "", "bad_words": "stop", "truncate_prompt_tokens": "", "logits_processors": "",
    "prompt_embeds": "", "reasoning_effort": "chat_template_kwargs.thinking_effort",
    # OpenAI's deprecated function calling: refused rather than mapped, since its replies (`message.function_call`)
    # would differ from what a client of the old fields reads
    "functions": "tools", "function_call": "tool_choice",
}


def refuse_unimplemented(body: dict) -> None:
    for name, instead in UNIMPLEMENTED_FIELDS.items():
        if body.get(name) not in (None, [], {}, ""):
            hint = f" (use {instead})" if instead else ""
            raise ApiError(400, f"'{name}' is not supported by this server{hint}", param=name,
                           code="unsupported_parameter")


def validate_body(model_type: type[M], body: Any) -> M:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    refuse_unimplemented(body)
    try:
        return model_type.model_validate(body)
    except ValidationError as exc:
        raise validation_error(exc) from None


def merge_hints(*groups: Iterable[int]) -> tuple[int, ...]:
    """The union of hint groups, sorted, duplicates dropped."""
    return tuple(sorted({int(h) for group in groups for h in group}))


def check_client_hints(hints: Sequence[int] | None, prompt_length: int) -> tuple[int, ...]:
    """The client's `kdamesh_snapshot_hints`, sorted; 400 naming the field for a value outside [0, prompt_length]."""
    for hint in hints or ():
        if not 0 <= hint <= prompt_length:
            raise ApiError(400, f"'{HINTS_PARAM}' entries must be token positions in [0, {prompt_length}] (the "
                                f"prompt length), got {hint}", param=HINTS_PARAM)
    return merge_hints(hints or ())


def check_served(model: str | None, served: set[str]) -> None:
    if model is not None and model not in served:
        raise not_found_model(model)


class StreamOptions(RequestModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class FunctionDefinition(RequestModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(RequestModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


def tools_json(tools: list[ToolDefinition] | None) -> list[dict] | None:
    """The tools as the chat renderer takes them (plain JSON, unset fields left out)."""
    return [t.model_dump(exclude_none=True) for t in tools] if tools else None


class JsonSchemaSpec(RequestModel):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(RequestModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and (self.json_schema is None or self.json_schema.schema_ is None):
            raise ValueError("response_format type 'json_schema' needs json_schema.schema")
        return self


class SamplingRequest(RequestModel):
    """The fields `/v1/chat/completions` and `/v1/completions` share (vLLM's sampling extras included)."""

    model: str
    max_tokens: int | None = Field(default=None, ge=1, le=UINT32_MAX)
    n: int = Field(default=1, ge=1, le=MAX_N)
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1, le=INT32_MAX)
    min_p: float | None = Field(default=None, ge=0, le=1)
    presence_penalty: float = Field(default=0.0, ge=-2, le=2)
    frequency_penalty: float = Field(default=0.0, ge=-2, le=2)
    repetition_penalty: float | None = Field(default=None, gt=0)
    seed: int | None = None
    stop: Union[str, list[str], None] = None
    stop_token_ids: list[int] | None = Field(default=None, max_length=MAX_STOP_TOKEN_IDS)
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0, le=UINT32_MAX)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    echo: bool = False
    user: str | None = Field(default=None, max_length=MAX_ID_CHARS)
    priority: int = 0
    cache_salt: str | None = Field(default=None, max_length=MAX_ID_CHARS)
    request_id: str | None = Field(default=None, max_length=MAX_ID_CHARS)
    # OpenAI's logit bias: token id (as a string key) -> added to its logit, in [-100, 100] (engine/sampling.py)
    logit_bias: dict[str, float] | None = Field(default=None, max_length=MAX_LOGIT_BIAS)
    # kdamesh's extension: prompt token positions where reusable parts end (gateway/hints.py checks the range)
    kdamesh_snapshot_hints: list[int] | None = Field(default=None, max_length=MAX_SNAPSHOT_HINTS)

    # (field, whether its value changes the result): refused with 400 `unsupported_parameter` when it does
    UNSUPPORTED: ClassVar[tuple] = ()

    @field_validator("model")
    @classmethod
    def _model_not_empty(cls, v: str) -> str:
        if not v:
            raise ValueError("must not be empty")
        return v

    @field_validator("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                     "frequency_penalty")
    @classmethod
    def _finite(cls, v):
        if v is not None and not (math.isfinite(v) and abs(v) <= FLOAT32_MAX):
            raise ValueError("must be a finite number")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v):
        if v is None:
            return v
        for token, bias in v.items():
            if not token.isdigit() or int(token) > UINT32_MAX:
                raise ValueError(f"keys must be token ids (non-negative integers), got {token!r}")
            if not (math.isfinite(bias) and -100 <= bias <= 100):
                raise ValueError(f"values must be in [-100, 100], got {bias!r} for token {token}")
        return v

    @field_validator("top_p", "repetition_penalty")
    @classmethod
    def _positive_as_float32(cls, v):
        if v is not None and v > 0 and _float32(v) == 0:  # e.g. 1e-46: positive here, 0 on the mesh
            raise ValueError("must be a positive float32 (at least 1.4e-45)")
        return v

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        if isinstance(v, str):
            v = [v]
        if v is not None and not all(s for s in v):
            raise ValueError("stop strings must not be empty")
        if v is not None and len(v) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")
        if v is not None and any(len(s) > MAX_STOP_STRING_CHARS for s in v):
            raise ValueError(f"a stop string may hold at most {MAX_STOP_STRING_CHARS} characters")
        return v

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_ids(cls, v):
        if v is not None and any(not 0 <= t <= UINT32_MAX for t in v):
            raise ValueError(f"token ids must be integers in [0, {UINT32_MAX}]")
        return v

    @field_validator("seed")
    @classmethod
    def _seed(cls, v):
        if v is not None and not -(1 << 63) <= v < (1 << 64):
            raise ValueError("must fit in 64 bits")
        return v

    @field_validator("priority")
    @classmethod
    def _priority(cls, v):
        if not -(1 << 31) <= v < (1 << 31):
            raise ValueError("must fit in 32 bits")
        return v

    @property
    def completion_limit(self) -> int | None:
        """The most tokens a choice may generate (None: up to the context length)."""
        return self.max_tokens

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """vLLM's `stream_options.continuous_usage_stats` (with `include_usage`): usage so far on every chunk."""
        return self.include_usage and self.stream_options.continuous_usage_stats

    def check(self) -> None:
        """Checks across fields (`ApiError` naming the field)."""
        if self.stream_options is not None and not self.stream:
            raise ApiError(400, "'stream_options' needs 'stream': true", param="stream_options")
        if self.stream and getattr(self, "prompt_logprobs", None) is not None:  # as vLLM
            raise ApiError(400, "'prompt_logprobs' is not available with 'stream': true", param="prompt_logprobs")
        limit = self.completion_limit
        if limit is not None and self.min_tokens > limit:
            raise ApiError(400, f"'min_tokens' {self.min_tokens} is larger than max_tokens {limit}",
                           param="min_tokens")
        for name, matters in self.UNSUPPORTED:
            if matters(getattr(self, name)):
                raise ApiError(400, f"'{name}' is not supported by this server", param=name,
                               code="unsupported_parameter")

    def sampling_params(self, logprobs: int | None, skip_special_tokens: bool) -> common_pb2.SamplingParams:
        """The mesh sampling parameters (structured output is added by the caller)."""
        sampling = common_pb2.SamplingParams(
            n=self.n, min_tokens=self.min_tokens, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, stop=self.stop or [], stop_token_ids=self.stop_token_ids or [],
            ignore_eos=self.ignore_eos, include_stop_str_in_output=self.include_stop_str_in_output,
            logprobs=logprobs is not None, top_logprobs=logprobs or 0, skip_special_tokens=skip_special_tokens)
        if self.completion_limit is not None:
            sampling.max_tokens = self.completion_limit
        for name in ("temperature", "top_p", "min_p", "repetition_penalty"):
            value = getattr(self, name)
            if value is not None:
                setattr(sampling, name, float(value))
        if self.top_k is not None:
            sampling.top_k = self.top_k
        if self.seed is not None:
            sampling.seed = self.seed % (1 << 64)
        for token, bias in (self.logit_bias or {}).items():
            sampling.logit_bias[int(token)] = bias
        return sampling
