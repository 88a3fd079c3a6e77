"""Per-request caps: what one request may ask of the mesh, so one client cannot starve the others.

Contract:
- `RequestCaps(max_prompts, max_sequences, max_prompt_tokens)` (built by `GatewayConfig.request_caps()`); positive
  integers, `max_prompt_tokens` None: only the context length limits a prompt.
- `check(prompt_lengths, n, prompt_param)` raises `ApiError` for a request over a cap, before it is admitted:
  400 `too_many_prompts` (param `prompt`) for more than `max_prompts` prompts, 400 `too_many_sequences` (param `n`)
  when `n` × prompts exceeds `max_sequences`, 413 `prompt_too_large` (param `prompt_param`) for a prompt of more
  than `max_prompt_tokens` tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from gateway.protocol import ApiError

DEFAULT_MAX_PROMPTS = 256
DEFAULT_MAX_SEQUENCES = 256


@dataclass(frozen=True)
class RequestCaps:
    max_prompts: int = DEFAULT_MAX_PROMPTS  # prompts in one /v1/completions request
    max_sequences: int = DEFAULT_MAX_SEQUENCES  # n × prompts: the sequences one request generates
    max_prompt_tokens: int | None = None  # tokens in one prompt (None: the context length alone)

    def __post_init__(self):
        for name in ("max_prompts", "max_sequences", "max_prompt_tokens"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")

    def check(self, prompt_lengths: Sequence[int], n: int, prompt_param: str) -> None:
        count = len(prompt_lengths)
        if count > self.max_prompts:
            raise ApiError(400, f"{count} prompts in one request; the limit is {self.max_prompts}",
                           param="prompt", code="too_many_prompts")
        if count * n > self.max_sequences:
            raise ApiError(400, f"n={n} for {count} prompt(s) asks for {count * n} sequences; the limit is "
                                f"{self.max_sequences} per request", param="n", code="too_many_sequences")
        longest = max(prompt_lengths, default=0)
        if self.max_prompt_tokens is not None and longest > self.max_prompt_tokens:
            raise ApiError(413, f"a prompt of {longest} tokens; the limit is {self.max_prompt_tokens}",
                           param=prompt_param, code="prompt_too_large")
