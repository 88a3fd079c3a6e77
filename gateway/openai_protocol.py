"""The OpenAI-compatible wire protocol of the gateway: request validation, the error envelope, response pieces.

Contract:
- `ApiError(status, message, param, code, type_)` is the only error a request handler raises for a bad request; its
  `body()` is the OpenAI envelope `{"error": {"message", "type", "param", "code"}}`. `grpc_code` maps it to the gRPC
  status of the public gRPC API.
- `parse_chat(body, served, max_logprobs)` validates a `/v1/chat/completions` body with the pydantic model
  `ChatCompletionRequest` and returns it, or raises `ApiError` (400 naming the first bad field as `param`; 404 with
  code `model_not_found` for a model not in `served`). Unknown top-level fields are ignored (as vLLM does); fields
  this gateway cannot honour (`logit_bias`, `continue_final_message`, `prompt_logprobs`, ...) are refused with 400
  rather than silently dropped.
- `parse_completion(body, tokenizer, served)` does the same for `/v1/completions` (hand-written checks, the shape of
  vLLM's completions API) and returns a `CompletionJob` with the mesh `SamplingParams` filled in.
- `parse_tokenize` / `parse_detokenize`: vLLM's `/tokenize` (a `prompt`, or chat `messages`) and `/detokenize`.
- `sampling_from_chat(request, ...)` builds the mesh `SamplingParams` of a chat request (max_completion_tokens wins
  over max_tokens; `n`, `seed`, `stop`, penalties, logprobs, ...).
- Response helpers: `usage_dict`, `chat_logprobs_entry`, `completion_logprobs`.
Nothing here talks to the mesh; everything is pure and unit-tested (tests/unit/gateway/test_openai_protocol.py).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Literal, Union

import grpc
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from protos import common_pb2

MAX_LOGPROBS = 20
MAX_N = 128
HTTP_STATUS = {grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.OUT_OF_RANGE: 400,
               grpc.StatusCode.FAILED_PRECONDITION: 400, grpc.StatusCode.NOT_FOUND: 404,
               grpc.StatusCode.UNIMPLEMENTED: 501, grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
               grpc.StatusCode.DEADLINE_EXCEEDED: 504, grpc.StatusCode.UNAVAILABLE: 503,
               grpc.StatusCode.CANCELLED: 499, grpc.StatusCode.UNAUTHENTICATED: 401,
               grpc.StatusCode.PERMISSION_DENIED: 403}
GRPC_CODE = {400: grpc.StatusCode.INVALID_ARGUMENT, 401: grpc.StatusCode.UNAUTHENTICATED,
             403: grpc.StatusCode.PERMISSION_DENIED, 404: grpc.StatusCode.NOT_FOUND,
             413: grpc.StatusCode.INVALID_ARGUMENT, 429: grpc.StatusCode.RESOURCE_EXHAUSTED,
             499: grpc.StatusCode.CANCELLED, 501: grpc.StatusCode.UNIMPLEMENTED,
             503: grpc.StatusCode.UNAVAILABLE, 504: grpc.StatusCode.DEADLINE_EXCEEDED}


# -- errors ------------------------------------------------------------------------------------------------------


class ApiError(Exception):
    """A request failed with an HTTP status; `body()` is the OpenAI error envelope."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type_ or ("invalid_request_error" if status < 500 else "server_error")
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    @property
    def grpc_code(self) -> grpc.StatusCode:
        return GRPC_CODE.get(self.status, grpc.StatusCode.INTERNAL)


def mesh_api_error(code: grpc.StatusCode, message: str, prompt_param: str = "prompt") -> ApiError:
    """The REST error of a failed mesh call (gRPC status of the worker); `prompt_param` names the prompt field
    ("prompt" or "messages") in a context-length error."""
    status = HTTP_STATUS.get(code, 500)
    if "maximum context length" in message:
        return ApiError(400, message, param=prompt_param, code="context_length_exceeded")
    return ApiError(status, message, code=code.name.lower())


def not_found_model(model: str) -> ApiError:
    return ApiError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found",
                    type_="NotFoundError")


def bad_json(exc: Exception) -> ApiError:
    return ApiError(400, f"the request body is not valid JSON: {exc}", code="invalid_json")


def _validation_error(exc: ValidationError) -> ApiError:
    first = exc.errors(include_url=False)[0]
    # pydantic names the union member it tried ("literal['none','auto']", "str", "function-after[...]"): keep only
    # field names and list indices
    loc = [str(p) for p in first.get("loc", ()) if isinstance(p, int) or str(p).isidentifier()]
    loc = [p for p in loc if p not in ("str", "int", "float", "bool", "list", "dict", "NamedToolChoice")]
    message = first.get("msg", "invalid request")
    if message.startswith("Value error, "):
        message = message[len("Value error, "):]
    where = f"'{'.'.join(loc)}': " if loc else ""
    return ApiError(400, f"{where}{message}", param=loc[0] if loc else None)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


# -- chat completions --------------------------------------------------------------------------------------------


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Model):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class FunctionDefinition(_Model):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(_Model):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class _FunctionName(_Model):
    name: str


class NamedToolChoice(_Model):
    type: Literal["function"] = "function"
    function: _FunctionName


class JsonSchemaSpec(_Model):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Model):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and (self.json_schema is None or self.json_schema.schema_ is None):
            raise ValueError("response_format type 'json_schema' needs json_schema.schema")
        return self


class ChatCompletionRequest(_Model):
    """OpenAI chat completions request, with vLLM's extra sampling fields."""

    model: str
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    n: int = Field(default=1, ge=1, le=MAX_N)
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0, le=1)
    presence_penalty: float = Field(default=0.0, ge=-2, le=2)
    frequency_penalty: float = Field(default=0.0, ge=-2, le=2)
    repetition_penalty: float | None = Field(default=None, gt=0)
    seed: int | None = None
    stop: Union[str, list[str], None] = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    user: str | None = None
    priority: int = 0
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[ToolDefinition] | None = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    cache_salt: str | None = None
    request_id: str | None = None
    # accepted by the OpenAI API but not honoured here: refused when set to something that matters
    logit_bias: dict[str, float] | None = None
    prompt_logprobs: int | None = None
    echo: bool = False

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
        if v is not None and not math.isfinite(v):
            raise ValueError("must be a finite number")
        return v

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        if isinstance(v, str):
            v = [v]
        if v is not None and not all(s for s in v):
            raise ValueError("stop strings must not be empty")
        if v is not None and len(v) > 16:
            raise ValueError("at most 16 stop strings")
        return v

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_ids(cls, v):
        if v is not None and any(t < 0 for t in v):
            raise ValueError("token ids must be >= 0")
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

    def check(self) -> None:
        """Checks across fields (`ApiError` naming the field)."""
        if self.top_logprobs is not None and self.top_logprobs > 0 and not self.logprobs:
            raise ApiError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
        if self.stream_options is not None and not self.stream:
            raise ApiError(400, "'stream_options' needs 'stream': true", param="stream_options")
        if self.tool_choice is not None and self.tool_choice != "none" and not self.tools:
            raise ApiError(400, "'tool_choice' needs 'tools'", param="tool_choice")
        if isinstance(self.tool_choice, NamedToolChoice):
            names = [t.function.name for t in self.tools or ()]
            if self.tool_choice.function.name not in names:
                raise ApiError(400, f"'tool_choice' names {self.tool_choice.function.name!r}, which is not among "
                                    f"the tools {names}", param="tool_choice")
        limit = self.completion_limit
        if limit is not None and self.min_tokens > limit:
            raise ApiError(400, f"'min_tokens' {self.min_tokens} is larger than max_tokens {limit}",
                           param="min_tokens")
        for name, matters in _UNSUPPORTED_CHAT:
            if matters(getattr(self, name)):
                raise ApiError(400, f"'{name}' is not supported by this server", param=name,
                               code="unsupported_parameter")

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
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None

    def response_format_json(self) -> dict | None:
        if self.response_format is None:
            return None
        return self.response_format.model_dump(by_alias=True, exclude_none=True)


# `{"prompt_logprobs": 0}` etc. are fine; only values that change the result are refused.
_UNSUPPORTED_CHAT = (("logit_bias", lambda v: bool(v)), ("prompt_logprobs", lambda v: v is not None),
                     ("continue_final_message", bool), ("echo", bool))


def parse_chat(body: Any, served: set[str]) -> ChatCompletionRequest:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    try:
        request = ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:
        raise _validation_error(exc) from None
    if request.model not in served:
        raise not_found_model(request.model)
    request.check()
    return request


def sampling_from_chat(request: ChatCompletionRequest, skip_special_tokens: bool) -> common_pb2.SamplingParams:
    """The mesh sampling parameters of a chat request (structured output is added by the caller)."""
    sampling = common_pb2.SamplingParams(
        n=request.n, min_tokens=request.min_tokens, presence_penalty=request.presence_penalty,
        frequency_penalty=request.frequency_penalty, stop=request.stop or [],
        stop_token_ids=request.stop_token_ids or [], ignore_eos=request.ignore_eos,
        include_stop_str_in_output=request.include_stop_str_in_output, logprobs=request.logprobs,
        top_logprobs=(request.top_logprobs or 0) if request.logprobs else 0,
        skip_special_tokens=skip_special_tokens)
    if request.completion_limit is not None:
        sampling.max_tokens = request.completion_limit
    for name in ("temperature", "top_p", "min_p", "repetition_penalty"):
        value = getattr(request, name)
        if value is not None:
            setattr(sampling, name, float(value))
    if request.top_k is not None:
        sampling.top_k = request.top_k
    if request.seed is not None:
        sampling.seed = request.seed % (1 << 64)
    return sampling


# -- tokenize / detokenize (vLLM) --------------------------------------------------------------------------------


class TokenizeCompletionRequest(_Model):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(_Model):
    model: str | None = None
    messages: list[dict[str, Any]] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ToolDefinition] | None = None
    return_token_strs: bool = False

    def tools_json(self) -> list[dict] | None:
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None


class DetokenizeRequest(_Model):
    model: str | None = None
    tokens: list[int]


def _check_model(model: str | None, served: set[str]) -> None:
    if model is not None and model not in served:
        raise not_found_model(model)


def parse_tokenize(body: Any, served: set[str]) -> TokenizeCompletionRequest | TokenizeChatRequest:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    if ("prompt" in body) == ("messages" in body):
        raise ApiError(400, "give exactly one of 'prompt' and 'messages'", param="prompt")
    model_type = TokenizeChatRequest if "messages" in body else TokenizeCompletionRequest
    try:
        request = model_type.model_validate(body)
    except ValidationError as exc:
        raise _validation_error(exc) from None
    _check_model(request.model, served)
    if isinstance(request, TokenizeChatRequest) and request.continue_final_message:
        raise ApiError(400, "'continue_final_message' is not supported by this server",
                       param="continue_final_message")
    return request


def parse_detokenize(body: Any, served: set[str], vocab_size: int) -> DetokenizeRequest:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    try:
        request = DetokenizeRequest.model_validate(body)
    except ValidationError as exc:
        raise _validation_error(exc) from None
    _check_model(request.model, served)
    if not all(0 <= t < vocab_size for t in request.tokens):
        raise ApiError(400, f"token ids must be integers in [0, {vocab_size})", param="tokens")
    return request


# -- completions -------------------------------------------------------------------------------------------------


class _Fields:
    """Typed reads of a JSON object; a wrong type is a 400 naming the field."""

    def __init__(self, body: dict):
        self.body = body

    def get(self, name: str, check, what: str, default=None):
        value = self.body.get(name)
        if value is None:
            return default
        if not check(value):
            raise ApiError(400, f"'{name}' must be {what}, got {json.dumps(value)[:100]}", param=name)
        return value

    def int(self, name, default=None, lo=None, hi=None):
        v = self.get(name, _is_int, "an integer", default)
        if v is not None and ((lo is not None and v < lo) or (hi is not None and v > hi)):
            raise ApiError(400, f"'{name}' must be in [{lo}, {hi if hi is not None else 'inf'}], got {v}", param=name)
        return v

    def num(self, name, default=None):
        return self.get(name, _is_num, "a finite number", default)

    def bool(self, name, default=False):
        return self.get(name, lambda v: isinstance(v, bool), "a boolean", default)


@dataclass
class CompletionJob:
    """A parsed /v1/completions request."""

    model: str
    prompts: list[list[int]]
    prompt_texts: list[str | None]
    sampling: common_pb2.SamplingParams
    n: int
    stream: bool
    include_usage: bool
    echo: bool
    logprobs: int | None
    stop: list[str]
    min_tokens: int
    include_stop_str: bool
    skip_special_tokens: bool
    ignore_eos: bool
    stop_token_ids: list[int] = field(default_factory=list)
    user: str | None = None
    priority: int = 0
    cache_salt: str | None = None
    request_id: str | None = None
    return_token_ids: bool = False

    @property
    def max_tokens(self) -> int | None:
        return self.sampling.max_tokens if self.sampling.HasField("max_tokens") else None


def parse_completion(body, tokenizer, served: set[str]) -> CompletionJob:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    f = _Fields(body)
    model = f.get("model", lambda v: isinstance(v, str), "a string")
    if model is None:
        raise ApiError(400, "'model' is required", param="model")
    if model not in served:
        raise not_found_model(model)
    prompts, texts = _parse_prompt(body.get("prompt"), tokenizer)
    if body.get("suffix") is not None:
        raise ApiError(400, "'suffix' is not supported", param="suffix")
    if body.get("logit_bias"):
        raise ApiError(400, "'logit_bias' is not supported by this server", param="logit_bias",
                       code="unsupported_parameter")
    n = f.int("n", 1, lo=1, hi=MAX_N)
    best_of = f.int("best_of", None, lo=1)
    if best_of is not None and best_of != n:
        raise ApiError(400, "'best_of' other than n is not supported", param="best_of")
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and not (isinstance(stop, list) and all(isinstance(s, str) and s for s in stop)):
        raise ApiError(400, "'stop' must be a non-empty string or a list of them", param="stop")
    stop = stop or []
    stop_ids = f.get("stop_token_ids", lambda v: isinstance(v, list) and all(_is_int(t) and t >= 0 for t in v),
                     "a list of token ids", [])
    logprobs = f.int("logprobs", None, lo=0, hi=MAX_LOGPROBS)
    options = f.get("stream_options", lambda v: isinstance(v, dict), "an object", {})
    stream = f.bool("stream")
    if options and not stream:
        raise ApiError(400, "'stream_options' needs 'stream': true", param="stream_options")
    sampling = common_pb2.SamplingParams(
        min_tokens=f.int("min_tokens", 0, lo=0), presence_penalty=f.num("presence_penalty", 0.0),
        frequency_penalty=f.num("frequency_penalty", 0.0), stop=stop, stop_token_ids=stop_ids,
        ignore_eos=f.bool("ignore_eos"), include_stop_str_in_output=f.bool("include_stop_str_in_output"),
        logprobs=logprobs is not None, top_logprobs=logprobs or 0, n=n,
        skip_special_tokens=f.bool("skip_special_tokens", True))
    max_tokens = f.int("max_tokens", 16, lo=1)
    if max_tokens is not None:
        sampling.max_tokens = max_tokens
    for name in ("temperature", "top_p", "min_p", "repetition_penalty"):
        value = f.num(name)
        if value is not None:
            setattr(sampling, name, float(value))
    top_k = f.int("top_k", None, lo=-1)
    if top_k is not None:
        sampling.top_k = top_k
    seed = f.int("seed", None, lo=-(1 << 63), hi=(1 << 64) - 1)
    if seed is not None:
        sampling.seed = seed % (1 << 64)
    structured = _completion_structured(body.get("response_format"))
    if structured is not None:
        sampling.structured_output.CopyFrom(structured)
    user = f.get("user", lambda v: isinstance(v, str), "a string")
    priority = f.int("priority", 0, lo=-(1 << 31), hi=(1 << 31) - 1)
    cache_salt = f.get("cache_salt", lambda v: isinstance(v, str), "a string")
    request_id = f.get("request_id", lambda v: isinstance(v, str), "a string")
    return CompletionJob(model=model, prompts=prompts, prompt_texts=texts, sampling=sampling, n=n, stream=stream,
                         include_usage=bool(_Fields(options).bool("include_usage")), echo=f.bool("echo"),
                         logprobs=logprobs, stop=stop, min_tokens=sampling.min_tokens,
                         include_stop_str=sampling.include_stop_str_in_output,
                         skip_special_tokens=sampling.skip_special_tokens, ignore_eos=sampling.ignore_eos,
                         stop_token_ids=list(stop_ids), user=user, priority=priority, cache_salt=cache_salt,
                         request_id=request_id, return_token_ids=f.bool("return_token_ids"))


def _completion_structured(response_format) -> common_pb2.StructuredOutput | None:
    """vLLM's `response_format` on completions: the whole output is the JSON (no chat format around it)."""
    if response_format is None:
        return None
    try:
        fmt = ResponseFormat.model_validate(response_format)
    except ValidationError as exc:
        error = _validation_error(exc)
        raise ApiError(400, error.message, param="response_format") from None
    kinds = common_pb2.StructuredOutput
    if fmt.type == "json_object":
        return kinds(kind=kinds.KIND_JSON_OBJECT)
    if fmt.type == "json_schema":
        return kinds(kind=kinds.KIND_JSON_SCHEMA, json_schema=json.dumps(fmt.json_schema.schema_))
    return None


def _parse_prompt(prompt, tokenizer) -> tuple[list[list[int]], list[str | None]]:
    vocab = tokenizer.vocab_size

    def ids(p: list) -> list[int]:
        if not p:
            raise ApiError(400, "a prompt must not be empty", param="prompt")
        if not all(_is_int(t) and 0 <= t < vocab for t in p):
            raise ApiError(400, f"prompt token ids must be integers in [0, {vocab})", param="prompt")
        return list(p)

    def text(s: str) -> list[int]:
        if not s:
            raise ApiError(400, "a prompt must not be empty", param="prompt")
        return tokenizer.encode(s)

    if isinstance(prompt, str):
        return [text(prompt)], [prompt]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return [text(p) for p in prompt], list(prompt)
        if all(_is_int(t) for t in prompt):
            return [ids(prompt)], [None]
        if all(isinstance(p, list) for p in prompt):
            return [ids(p) for p in prompt], [None] * len(prompt)
    raise ApiError(400, "'prompt' must be a string, a list of strings, a list of token ids or a list of such lists",
                   param="prompt")


# -- response pieces ---------------------------------------------------------------------------------------------


def usage_dict(prompt_tokens: int, completion_tokens: int, cached: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached}}


def chat_logprobs_entry(tokenizer, lp: common_pb2.TokenLogprob) -> dict:
    """One `choices[].logprobs.content[]` entry of a chat completion."""
    def one(token_id: int, logprob: float) -> dict:
        raw = tokenizer.id_to_bytes(token_id)
        return {"token": raw.decode("utf-8", errors="replace"), "logprob": max(logprob, -9999.0),
                "bytes": list(raw)}

    entry = one(lp.token_id, lp.logprob)
    entry["top_logprobs"] = [one(t.token_id, t.logprob) for t in lp.top_logprobs]
    return entry


def completion_logprobs(tokenizer, logprobs: list[common_pb2.TokenLogprob], offset: int) -> dict:
    """OpenAI completions `logprobs` for these tokens (text offsets counted from `offset`)."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for lp in logprobs:
        piece = tokenizer.decode([lp.token_id])
        tokens.append(piece)
        token_lps.append(lp.logprob)
        tops.append({tokenizer.decode([t.token_id]): t.logprob for t in lp.top_logprobs})
        offsets.append(offset)
        offset += len(piece)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}
