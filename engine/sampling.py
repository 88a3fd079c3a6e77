"""Sampling parameters (shaped like vLLM's `SamplingParams`) and the sampler.

Contract:
- `SamplingParams(...)` validates on construction and raises `InvalidRequestError` (a `ValueError`, with `.param`
  naming the field) for any value outside its range; services map it to 400 / INVALID_ARGUMENT.
- `Sampler.sample(logits [L, V] fp32, rows)` picks one token per row. Row r carries its request's params, token
  history and `torch.Generator`; a row draws random numbers only from its own generator, a fixed count per step
  (one exponential per vocabulary entry), so a seeded request samples the same tokens whatever else is in the
  batch. `temperature == 0` is greedy (argmax after penalties); no random numbers are drawn then.
- Processing order, per row: logit bias (`logit_bias`: token id -> value added to its logit, each in [-100, 100],
  at most `MAX_LOGIT_BIAS` entries; ids checked against the vocabulary by `check_vocab`), repetition penalty
  (prompt and output tokens), frequency and presence penalties
  (output tokens), temperature, min_p, top_k, top_p, then sampling. Logprobs are the model's raw log-softmax
  (before any processing), as vLLM v1 reports them by default.
- `structured` (a validated `engine.structured.StructuredOutputParams`) makes the engine mask each row's logits with
  its grammar before this sampler runs (so logprobs are then over the allowed tokens, as in vLLM); for such
  requests `min_tokens` does not suppress stop tokens (the grammar decides where the output ends).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from engine.errors import InvalidRequestError
from engine.structured import StructuredOutputParams

GREEDY_EPS = 1e-5  # temperatures below this are greedy
MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 300  # entries (OpenAI's limit)


@dataclass
class SamplingParams:
    n: int = 1
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # None: none; k >= 0: the sampled token's logprob plus the top k
    prompt_logprobs: int | None = None  # None: none; k >= 0: each prompt token's logprob plus the top k
    skip_special_tokens: bool = True
    # structured output (grammar-constrained decoding, see engine/structured/); None: unconstrained
    structured: StructuredOutputParams | None = None
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit (logit units, [-100, 100])

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self._validate()
        if not _is_logit_bias(self.logit_bias):
            raise InvalidRequestError(f"logit_bias must map at most {MAX_LOGIT_BIAS} token ids >= 0 to values in "
                                      f"[-100, 100], got {self.logit_bias!r}", param="logit_bias")

    def _validate(self) -> None:
        def bad(param: str, why: str) -> InvalidRequestError:
            return InvalidRequestError(f"{param} {why}, got {getattr(self, param)!r}", param=param)

        if not _is_int(self.n) or self.n < 1:
            raise bad("n", "must be an integer >= 1")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise bad("max_tokens", "must be an integer >= 1")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise bad("min_tokens", "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must be <= max_tokens {self.max_tokens}")
        if not _is_finite(self.temperature) or self.temperature < 0:
            raise bad("temperature", "must be a finite number >= 0")
        if not _is_finite(self.top_p) or not 0 < self.top_p <= 1:
            raise bad("top_p", "must be in (0, 1]")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise bad("top_k", "must be an integer: -1 or 0 (off) or >= 1")
        if not _is_finite(self.min_p) or not 0 <= self.min_p <= 1:
            raise bad("min_p", "must be in [0, 1]")
        if self.seed is not None and not _is_int(self.seed):
            raise bad("seed", "must be an integer")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_finite(value) or not -2 <= value <= 2:
                raise bad(name, "must be in [-2, 2]")
        if not _is_finite(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise bad("repetition_penalty", "must be > 0")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise bad("stop", "must be non-empty strings")
        if not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be non-negative integers")
        bad_logprobs = [name for name in ("logprobs", "prompt_logprobs") if not _is_logprob_count(getattr(self, name))]
        if bad_logprobs:
            raise bad(bad_logprobs[0], f"must be an integer in [0, {MAX_LOGPROBS}]")
        if self.structured is not None and not isinstance(self.structured, StructuredOutputParams):
            raise bad("structured", "must be StructuredOutputParams or None")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    def check_vocab(self, vocab_size: int) -> None:
        """Token ids in the params must exist in the model's vocabulary."""
        bad = [t for t in self.stop_token_ids if t >= vocab_size]
        if bad:
            raise InvalidRequestError(f"stop_token_ids {bad} are outside the vocabulary (size {vocab_size})",
                                      param="stop_token_ids")
        bad = sorted(t for t in self.logit_bias or {} if t >= vocab_size)
        if bad:
            raise InvalidRequestError(f"logit_bias token ids {bad} are outside the vocabulary (size {vocab_size})",
                                      param="logit_bias")


def _is_logit_bias(bias) -> bool:
    """None, or at most MAX_LOGIT_BIAS token ids >= 0 mapped to finite values in [-100, 100]."""
    if bias is None:
        return True
    return isinstance(bias, dict) and len(bias) <= MAX_LOGIT_BIAS and all(
        _is_int(t) and t >= 0 and _is_finite(v) and -100 <= v <= 100 for t, v in bias.items())


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_logprob_count(value) -> bool:
    return value is None or (_is_int(value) and 0 <= value <= MAX_LOGPROBS)


def _is_finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass
class SampleRow:
    """One row of logits to sample: its request's params, token history and generator."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    generator: torch.Generator | None  # needed when not greedy
    suppress_ids: Sequence[int] = ()  # stop ids masked out before min_tokens are generated


@dataclass
class SampleResult:
    token_id: int
    logprob: float | None = None  # raw logprob of the sampled token (when logprobs were asked)
    rank: int | None = None  # 1 = most likely
    top: list[tuple[int, float]] = field(default_factory=list)  # (token id, raw logprob), best first


class Sampler:
    """Stateless: every per-request state (generator, history) comes in with the rows."""

    def sample(self, logits: torch.Tensor, rows: Sequence[SampleRow]) -> list[SampleResult]:
        """logits [L, V] fp32 -> one `SampleResult` per row."""
        assert logits.shape[0] == len(rows)
        if not rows:
            return []
        plain = [r.params.greedy and not r.params.has_penalties and r.params.logprobs is None and not r.suppress_ids
                 and not r.params.logit_bias for r in rows]
        if all(plain):  # the common fast path: one argmax over the batch
            return [SampleResult(int(t)) for t in logits.argmax(dim=-1).tolist()]
        return [self._sample_row(logits[i], row) for i, row in enumerate(rows)]

    def _sample_row(self, logits: torch.Tensor, row: SampleRow) -> SampleResult:
        x = self.target_logits(logits, row)
        if row.params.greedy:
            token = int(x.argmax())
        else:
            probs = torch.softmax(x, dim=-1)  # [V]
            noise = torch.empty_like(probs).exponential_(generator=row.generator)  # [V]
            token = int((probs / noise).argmax())  # exponential race == a categorical draw
        return self.result(logits, token, row.params)

    @staticmethod
    def target_logits(logits: torch.Tensor, row: SampleRow) -> torch.Tensor:
        """The row's processed logits [V] (penalties, suppressed stop ids; then temperature, min_p, top_k, top_p
        unless greedy): greedy picks their argmax, sampling draws from their softmax (so does speculative
        verification, engine/spec/verify.py). `logits` itself is never changed."""
        p = row.params
        if p.logit_bias:
            logits = apply_logit_bias(logits, p.logit_bias)
        x = apply_penalties(logits.clone(), p, row.prompt_token_ids, row.output_token_ids) if p.has_penalties \
            else logits
        if row.suppress_ids:
            x = x.clone() if x is logits else x
            x[torch.tensor(list(row.suppress_ids), dtype=torch.long)] = float("-inf")
        if not p.greedy:
            x = apply_filters(x / p.temperature, p.top_k, p.top_p, p.min_p)
        return x

    @staticmethod
    def result(raw: torch.Tensor, token: int, p: SamplingParams) -> SampleResult:
        """`SampleResult` of `token` chosen from raw logits [V] (logprobs when the params ask for them)."""
        result = SampleResult(token)
        if p.logprobs is not None:
            logprobs = torch.log_softmax(raw, dim=-1)  # [V]
            chosen = float(logprobs[token])
            result.logprob = chosen
            result.rank = int((logprobs > chosen).sum()) + 1
            if p.logprobs:
                values, ids = logprobs.topk(p.logprobs)
                result.top = list(zip(ids.tolist(), values.tolist()))
        return result


def apply_logit_bias(logits: torch.Tensor, bias: dict[int, float]) -> torch.Tensor:
    """A copy of logits [V] with `bias[t]` added at each token t."""
    ids = torch.tensor(list(bias), dtype=torch.long, device=logits.device)  # [B]
    values = torch.tensor(list(bias.values()), dtype=logits.dtype, device=logits.device)  # [B]
    return logits.index_add(0, ids, values)


def apply_penalties(logits: torch.Tensor, p: SamplingParams, prompt_ids: Sequence[int],
                    output_ids: Sequence[int]) -> torch.Tensor:
    """vLLM's penalties, in place on logits [V]."""
    vocab = logits.shape[0]
    if p.repetition_penalty != 1:
        seen = torch.zeros(vocab, dtype=torch.bool)
        seen[torch.tensor(list(prompt_ids) + list(output_ids), dtype=torch.long)] = True
        seen = seen.to(logits.device)
        scaled = torch.where(logits > 0, logits / p.repetition_penalty, logits * p.repetition_penalty)
        logits = torch.where(seen, scaled, logits)
    if output_ids and (p.frequency_penalty or p.presence_penalty):
        counts = torch.bincount(torch.tensor(list(output_ids), dtype=torch.long), minlength=vocab)[:vocab]
        counts = counts.to(logits.device, torch.float32)
        logits = logits - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).float()
    return logits


def apply_filters(logits: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """min_p, top_k and top_p on logits [V] (already divided by the temperature); removed entries become -inf."""
    if min_p > 0:
        probs = torch.softmax(logits, dim=-1)
        logits = logits.masked_fill(probs < min_p * probs.max(), float("-inf"))
    if 0 < top_k < logits.shape[0]:
        kth = logits.topk(top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1:
        sorted_logits, order = logits.sort(descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass strictly above each entry
        drop_sorted = before >= top_p  # keeps the smallest set whose mass reaches top_p (never the first)
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits
