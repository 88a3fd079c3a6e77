"""What the engine hands back: `RequestOutput` per request, `CompletionOutput` per sampled sequence.

Contract:
- `CompletionOutput.token_ids` / `.text` / `.logprobs` are cumulative (everything generated so far) and
  `.delta_token_ids` / `.delta_text` / `.delta_logprobs` hold what is new since the previous output of the same
  sequence; `.finish_reason` is None while running, else "stop" | "length" | "abort"; `.stop_reason` is the
  matched stop string or stop token id (None for EOS or length).
- A stop string is matched on detokenised text and is not part of `.text` (unless
  `include_stop_str_in_output`); the token that completed it stays in `.token_ids`. A stop token's id is in
  `.token_ids`, its text is not in `.text`.
- `RequestOutput.outputs` holds, for a streamed delta, only the sequences that changed (each with its `.index`);
  `LLM.generate` returns the final outputs with all `n` sequences in index order.
- `Logprob` entries follow vLLM: per generated position a dict token id -> `Logprob(logprob, rank, decoded_token)`
  holding the sampled token and the top `logprobs` tokens. `RequestOutput.prompt_logprobs` likewise per prompt
  position (`None` first), with `prompt_logprobs=k` (engine/prompt_logprobs.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Logprob:
    logprob: float
    rank: int
    decoded_token: str | None = None


PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[PositionLogprobs] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    delta_logprobs: list[PositionLogprobs] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    exported: object | None = None  # `engine.transfer.RequestState` when the request asked for an export
    # `params.prompt_logprobs`: None first, then per prompt position (engine/prompt_logprobs.py); set once the
    # whole prompt is computed
    prompt_logprobs: list[PositionLogprobs | None] | None = None
