"""`/v1/completions` requests: OpenAI legacy completions with vLLM's extra sampling fields, validated by the same
pydantic fields and checks as chat (`gateway.protocol.common.SamplingRequest`).

Contract:
- `parse_completion(body, tokenizer, served)` validates a decoded body with `CompletionRequest` and returns a
  `CompletionJob` (the prompts as token ids, the mesh `SamplingParams` filled in), or raises `ApiError` (400 naming
  the first bad field as `param`; 404 `model_not_found`).
- `prompt` is a text, a list of texts, a list of token ids or a list of such lists; texts are encoded with the
  gateway's tokenizer as vLLM and `AutoTokenizer.encode` do: special-token text in a prompt (`<|open|>`,
  `<|im_end|>`, …) becomes that special id, so a client that renders the chat format itself gets the model input it
  would get on vLLM. `split_special_tokens: true` (transformers' name) encodes the prompt as plain text instead
  (`encode_prompt_text`, the one rule /tokenize shares). Ids must lie in the vocabulary; no prompt may be empty.
- As in OpenAI's legacy API, a field given as null takes its default (`max_tokens`: 16). `suffix` is refused,
  `best_of` only equal to `n`; `logprobs` k returns the sampled token's logprob and the top k — with `echo`, the
  prompt tokens' too (the first `null`), computed in the prefill pass; `max_tokens` 0 needs `echo` (the prompt
  alone); `prompt_logprobs` k (vLLM's) adds a choice's `prompt_logprobs`; `response_format` (vLLM's) makes the
  whole output that JSON, with no chat format around it. `kdamesh_snapshot_hints` (kdamesh's extension) must lie in
  [0, length] of every prompt (400 `param: "kdamesh_snapshot_hints"`); the job carries them as `snapshot_hints`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Union

from pydantic import Field, field_validator, model_validator

from gateway.protocol.common import (MAX_LOGPROBS, MAX_N, UINT32_MAX, SamplingRequest, check_client_hints,
                                     check_served, validate_body)
from gateway.protocol.errors import ApiError
from protos import common_pb2

DEFAULT_MAX_TOKENS = 16
PROMPT_SHAPES = "a string, a list of strings, a list of token ids or a list of such lists"


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _prompt_shape(prompt: Any) -> None:
    """Raises ValueError unless `prompt` is one of the accepted shapes with nothing empty in it."""
    if isinstance(prompt, str):
        prompts: list = [prompt]
    elif isinstance(prompt, list) and prompt and (all(isinstance(p, str) for p in prompt)
                                                  or all(isinstance(p, list) for p in prompt)):
        prompts = prompt
    elif isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        return
    else:
        raise ValueError(f"must be {PROMPT_SHAPES}")
    if not all(prompts):
        raise ValueError("a prompt must not be empty")
    if any(isinstance(p, list) and not all(_is_int(t) for t in p) for p in prompts):
        raise ValueError(f"must be {PROMPT_SHAPES}")


class CompletionRequest(SamplingRequest):
    """OpenAI legacy completions request, with vLLM's extra sampling fields."""

    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: int | None = Field(default=DEFAULT_MAX_TOKENS, ge=0, le=UINT32_MAX)  # 0: with echo only
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)  # vLLM's extension
    best_of: int | None = Field(default=None, ge=1, le=MAX_N)
    suffix: str | None = None  # not supported: refused unless null
    return_token_ids: bool = False
    # transformers' option: true encodes special-token text in the prompt as plain text (default: the special id)
    split_special_tokens: bool = False

    @model_validator(mode="before")
    @classmethod
    def _nulls_take_defaults(cls, body: Any) -> Any:
        return {k: v for k, v in body.items() if v is not None} if isinstance(body, dict) else body

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, v):
        _prompt_shape(v)
        return v

    def check(self) -> None:
        if self.suffix is not None:
            raise ApiError(400, "'suffix' is not supported", param="suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise ApiError(400, "'best_of' other than n is not supported", param="best_of")
        if self.max_tokens == 0 and not self.echo:
            raise ApiError(400, "'max_tokens' 0 needs 'echo': true", param="max_tokens")
        super().check()

    @property
    def prompt_logprob_count(self) -> int | None:
        """Prompt logprobs the mesh computes: `prompt_logprobs`, and `logprobs` k for an echoed prompt."""
        wanted = [k for k in (self.prompt_logprobs, self.logprobs if self.echo else None) if k is not None]
        return max(wanted) if wanted else None


@dataclass
class CompletionJob:
    """A parsed /v1/completions request: the validated body, its prompts as token ids, the mesh sampling parameters.
    The completion limit is the sampling's (`max_tokens`: the gRPC API may lift the body's default)."""

    request: CompletionRequest
    prompts: list[list[int]]
    prompt_texts: list[str | None]  # None: given as token ids
    sampling: common_pb2.SamplingParams
    echo_only: bool = False  # `max_tokens` 0 with echo: the mesh runs one token, which is dropped
    snapshot_hints: tuple[int, ...] = ()  # the client's, checked against every prompt

    @property
    def max_tokens(self) -> int | None:
        return self.sampling.max_tokens if self.sampling.HasField("max_tokens") else None


def parse_completion(body: Any, tokenizer, served: set[str]) -> CompletionJob:
    request = validate_body(CompletionRequest, body)
    check_served(request.model, served)
    request.check()
    prompts, texts = _encode_prompts(request.prompt, tokenizer, request.split_special_tokens)
    hints = check_client_hints(request.kdamesh_snapshot_hints, min(len(p) for p in prompts))
    sampling = request.sampling_params(request.logprobs, request.skip_special_tokens)
    if request.max_tokens == 0:
        sampling.max_tokens, sampling.min_tokens = 1, 0
    if request.prompt_logprob_count is not None:
        sampling.prompt_logprobs = request.prompt_logprob_count
    structured = _structured(request)
    if structured is not None:
        sampling.structured_output.CopyFrom(structured)
    return CompletionJob(request, prompts, texts, sampling, echo_only=request.max_tokens == 0, snapshot_hints=hints)


def _structured(request: CompletionRequest) -> common_pb2.StructuredOutput | None:
    """vLLM's `response_format` on completions: the whole output is the JSON (no chat format around it)."""
    fmt, kinds = request.response_format, common_pb2.StructuredOutput
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return kinds(kind=kinds.KIND_JSON_OBJECT)
    return kinds(kind=kinds.KIND_JSON_SCHEMA, json_schema=json.dumps(fmt.json_schema.schema_))


def encode_prompt_text(tokenizer, text: str, split_special_tokens: bool = False) -> list[int]:
    """A completions (or /tokenize) prompt text -> ids: special-token text is the special id (vLLM's and
    transformers' reading) unless `split_special_tokens`, which encodes it as plain text."""
    return tokenizer.encode(text, allow_special=not split_special_tokens)


def _encode_prompts(prompt, tokenizer, split_special_tokens: bool) -> tuple[list[list[int]], list[str | None]]:
    """(token ids, text or None) per prompt of a validated `prompt` field."""
    if isinstance(prompt, str):
        prompt = [prompt]
    if all(isinstance(p, str) for p in prompt):
        return [encode_prompt_text(tokenizer, p, split_special_tokens) for p in prompt], list(prompt)
    prompts = [list(prompt)] if all(_is_int(t) for t in prompt) else [list(p) for p in prompt]
    vocab = tokenizer.vocab_size
    if not all(0 <= t < vocab for p in prompts for t in p):
        raise ApiError(400, f"prompt token ids must be integers in [0, {vocab})", param="prompt")
    return prompts, [None] * len(prompts)
