"""Sampling parameters (shaped like vLLM's `SamplingParams`) and the sampler: every row at once, on the device.

Contract:
- `SamplingParams(...)` validates on construction and raises `InvalidRequestError` (a `ValueError`, with `.param`
  naming the field) for any value outside its range; services map it to 400 / INVALID_ARGUMENT.
- `Sampler.sample(logits [L, V] fp32, rows)` picks one token per row; `sample_on_device` does the same and leaves
  the result on the logits' device (`DeviceSample`) for the caller's one read-back (`read_back`). All rows are
  processed by the same tensor ops at once: no value is read back to the host while sampling, whatever the batch.
- Randomness is counter-based: row r's random number is a hash of (its request's `seed`, its output `position`, a
  stream id), computed with int64 tensor ops on the device (`row_uniforms`: a uniform of 52-bit resolution from a
  32-bit key), and a draw is the inverse CDF of the row's weights at it (`categorical`: one cumsum and one
  searchsorted per batch). A seeded request therefore samples the same tokens whatever else is in the batch, in any
  order, on any engine: a handoff carries only the seed (engine/transfer.py `RequestState.sampling_seed`), and the
  output position says where it is.
  `temperature == 0` is greedy (argmax after penalties); its rows use no noise.
- Processing order, per row: logit bias (`logit_bias`: token id -> value added to its logit, each in [-100, 100],
  at most `MAX_LOGIT_BIAS` entries; ids checked against the vocabulary by `check_vocab`), repetition penalty
  (prompt and output tokens), frequency and presence penalties (output tokens), min_tokens suppression of stop ids, then (sampled rows only) temperature, min_p, top_k, top_p,
  then the draw. Logprobs are the model's raw log-softmax (before any processing), as vLLM v1 reports them.
- `structured` (a validated `engine.structured.StructuredOutputParams`) makes the engine mask each row's logits with
  its grammar before this sampler runs (so logprobs are then over the allowed tokens, as in vLLM); for such
  requests `min_tokens` does not suppress stop ids (the grammar decides where the output ends).
- `read_back(tensors)`: the one device -> host transfer of a step: every tensor packed into one float64 vector on
  the device, copied once (into pinned memory, non-blocking, then one synchronize, on CUDA) and split on the host.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from engine.errors import InvalidRequestError
from engine.structured import StructuredOutputParams
from engine.sampling_noise import (STREAM_ACCEPT, STREAM_RESIDUAL, STREAM_SAMPLE,  # noqa: F401 (re-exported)
                                   categorical, row_keys, row_uniforms, spread_keys)

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
    """One row of logits to sample: its request's params, token history, seed and output position."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]  # the history the penalties count (empty when the params have none)
    seed: int | None  # needed when not greedy
    suppress_ids: Sequence[int] = ()  # stop ids masked out before min_tokens are generated
    position: int = 0  # the output position this row samples (the noise counter)


@dataclass
class SampleResult:
    token_id: int
    logprob: float | None = None  # raw logprob of the sampled token (when logprobs were asked)
    rank: int | None = None  # 1 = most likely
    top: list[tuple[int, float]] = field(default_factory=list)  # (token id, raw logprob), best first


# -- batched processing ------------------------------------------------------------------------------------------


def upload(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list as a tensor on `device`: through pinned memory and a non-blocking copy on CUDA (no stall)."""
    host = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


@dataclass
class RowBatch:
    """The rows' parameters as device tensors [L] (built once per step) plus what the host knows of them. The
    tensors exist only when some row samples (an all-greedy batch uploads nothing)."""

    any_sampled: bool
    any_greedy: bool
    logprobs_k: int | None  # the most top logprobs any row asks (None: no row asks logprobs)
    logprobs: list[int | None]  # per row: top logprobs asked (None: none)
    greedy: torch.Tensor | None = None  # [L] bool
    temperature: torch.Tensor | None = None  # [L] fp32; 1 for greedy rows
    top_k: torch.Tensor | None = None  # [L] int64; 0: off
    top_p: torch.Tensor | None = None  # [L] fp32; 1: off
    min_p: torch.Tensor | None = None  # [L] fp32; 0: off
    seeds: torch.Tensor | None = None  # [L] int64; 0 for greedy rows
    positions: torch.Tensor | None = None  # [L] int64

    @classmethod
    def build(cls, rows: Sequence[SampleRow], device: torch.device) -> "RowBatch":
        params = [r.params for r in rows]
        greedy = [p.greedy for p in params]
        asked = [p.logprobs for p in params if p.logprobs is not None]
        batch = cls(any_sampled=not all(greedy), any_greedy=any(greedy), logprobs_k=max(asked) if asked else None,
                    logprobs=[p.logprobs for p in params])
        if batch.any_sampled:
            columns = [(1.0, 0, 1.0, 0.0, 0) if g else
                       (p.temperature, max(p.top_k, 0), p.top_p, p.min_p, _need_seed(r))
                       for r, p, g in zip(rows, params, greedy)]
            temperature, top_k, top_p, min_p, seeds = zip(*columns)
            batch.greedy = upload(greedy, torch.bool, device)
            batch.temperature = upload(temperature, torch.float32, device)
            batch.top_k = upload(top_k, torch.long, device)
            batch.top_p = upload(top_p, torch.float32, device)
            batch.min_p = upload(min_p, torch.float32, device)
            batch.seeds = upload(seeds, torch.long, device)
            batch.positions = upload([r.position for r in rows], torch.long, device)
        return batch

    def keys(self, stream: int) -> torch.Tensor:
        return row_keys(self.seeds, self.positions, stream)  # [L]


def _need_seed(row: SampleRow) -> int:
    if row.seed is None:
        raise ValueError("a sampled (temperature > 0) row needs a seed")
    return row.seed & ((1 << 63) - 1)


def target_logits(logits: torch.Tensor, rows: Sequence[SampleRow], batch: RowBatch) -> torch.Tensor:
    """The rows' processed logits [L, V] (penalties, suppressed stop ids; then temperature, min_p, top_k, top_p for
    the sampled rows): greedy picks their argmax, sampling draws from their softmax (so does speculative
    verification, engine/spec/accept.py). `logits` itself is never changed."""
    x = apply_penalties_rows(apply_logit_bias_rows(logits, rows), rows)
    suppress = [(i, t) for i, r in enumerate(rows) for t in r.suppress_ids]
    if suppress:
        x = x.clone() if x is logits else x
        index = upload(suppress, torch.long, logits.device)  # [n, 2]
        x[index[:, 0], index[:, 1]] = float("-inf")
    if batch.any_sampled:
        x = filter_rows(x / batch.temperature[:, None], batch.top_k, batch.top_p, batch.min_p,
                        [r.params for r in rows])
    return x


def apply_penalties_rows(logits: torch.Tensor, rows: Sequence[SampleRow]) -> torch.Tensor:
    """vLLM's penalties on logits [L, V], each row by its own params and history; rows without penalties are
    unchanged (and so is `logits` when no row has any)."""
    with_penalties = [i for i, r in enumerate(rows) if r.params.has_penalties]
    if not with_penalties:
        return logits
    device, vocab = logits.device, logits.shape[1]
    seen_pairs = [(i, t) for i in with_penalties if rows[i].params.repetition_penalty != 1
                  for t in itertools.chain(rows[i].prompt_token_ids, rows[i].output_token_ids)]
    count_pairs = [(i, t) for i in with_penalties for t in rows[i].output_token_ids]
    params = [r.params for r in rows]
    x = logits
    if seen_pairs:
        seen = torch.zeros_like(logits, dtype=torch.bool)  # [L, V]
        index = upload(seen_pairs, torch.long, device)
        seen[index[:, 0], index[:, 1]] = True
        rep = upload([p.repetition_penalty for p in params], torch.float32, device)[:, None]  # [L, 1]
        x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    if count_pairs:
        index = upload(count_pairs, torch.long, device)
        counts = torch.zeros(logits.shape[0] * vocab, dtype=torch.float32, device=device)
        counts.index_add_(0, index[:, 0] * vocab + index[:, 1], torch.ones(len(count_pairs), device=device))
        counts = counts.view(-1, vocab)  # [L, V]
        freq = upload([p.frequency_penalty for p in params], torch.float32, device)[:, None]
        presence = upload([p.presence_penalty for p in params], torch.float32, device)[:, None]
        x = x - freq * counts - presence * (counts > 0).float()
    return x


def filter_rows(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor,
                params: Sequence[SamplingParams] | None = None) -> torch.Tensor:
    """min_p, top_k and top_p per row on logits [L, V] (already divided by the temperature); removed entries
    become -inf. `params` (host) lets rows that use a filter skip it everywhere when none does."""
    vocab = logits.shape[1]
    use_min_p = params is None or any(p.min_p > 0 for p in params)
    use_top_k = params is None or any(0 < p.top_k < vocab for p in params)
    use_top_p = params is None or any(p.top_p < 1 for p in params)
    if use_min_p:
        probs = torch.softmax(logits, dim=-1)  # [L, V]
        logits = logits.masked_fill(probs < min_p[:, None] * probs.amax(dim=-1, keepdim=True), float("-inf"))
    if not (use_top_k or use_top_p):
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [L, V]
    drop = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if use_top_k:
        k = torch.where((top_k > 0) & (top_k < vocab), top_k, vocab)  # [L]
        kth = sorted_logits.gather(1, (k - 1)[:, None])  # [L, 1]
        drop = sorted_logits < kth
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    if use_top_p:
        probs = torch.softmax(sorted_logits, dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass strictly above each entry
        # keeps the smallest set whose mass reaches top_p (never the first); rows with top_p 1 keep everything
        drop = drop | ((before >= top_p[:, None]) & (top_p < 1)[:, None])
    return logits.masked_fill(torch.zeros_like(drop).scatter(1, order, drop), float("-inf"))


def apply_logit_bias_rows(logits: torch.Tensor, rows: Sequence[SampleRow]) -> torch.Tensor:
    """A copy of logits [L, V] with each row's `logit_bias[t]` added at token t (`logits` itself when no row has
    a bias): one upload of the (row, token) pairs and their values, one indexed add."""
    pairs = [(i, t, v) for i, r in enumerate(rows) for t, v in (r.params.logit_bias or {}).items()]
    if not pairs:
        return logits
    index = upload([(i, t) for i, t, _ in pairs], torch.long, logits.device)  # [n, 2]
    values = upload([v for _, _, v in pairs], logits.dtype, logits.device)  # [n]
    return logits.index_put((index[:, 0], index[:, 1]), values, accumulate=True)


def apply_logit_bias(logits: torch.Tensor, bias: dict[int, float]) -> torch.Tensor:
    """A copy of logits [V] with `bias[t]` added at each token t (`apply_logit_bias_rows` with one row)."""
    row = SampleRow(SamplingParams(temperature=0, logit_bias=bias), (), (), None)
    return apply_logit_bias_rows(logits[None], [row])[0]


def apply_penalties(logits: torch.Tensor, p: SamplingParams, prompt_ids: Sequence[int],
                    output_ids: Sequence[int]) -> torch.Tensor:
    """vLLM's penalties on one row [V] (`apply_penalties_rows` with one row)."""
    return apply_penalties_rows(logits[None], [SampleRow(p, prompt_ids, output_ids, None)])[0]


def apply_filters(logits: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """min_p, top_k and top_p on one row [V] (`filter_rows` with one row)."""
    device = logits.device
    return filter_rows(logits[None], torch.tensor([top_k], device=device), torch.tensor([top_p], device=device),
                       torch.tensor([min_p], device=device))[0]


# -- sampling and the read-back ----------------------------------------------------------------------------------


@dataclass
class DeviceSample:
    """One step's sampled rows, still on the device: ids [L] and, when asked, raw logprobs of the ids [L], their
    ranks [L] and the top-k ids / logprobs [L, k]."""

    token_ids: torch.Tensor
    logprob: torch.Tensor | None = None
    rank: torch.Tensor | None = None
    top_ids: torch.Tensor | None = None
    top_values: torch.Tensor | None = None

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.token_ids, self.logprob, self.rank, self.top_ids, self.top_values) if t is not None]

    def to_results(self, host: list[list[float]], logprobs: Sequence[int | None], k: int | None
                   ) -> list[SampleResult]:
        """`host`: `read_back(self.tensors())`, `logprobs` the rows' asked top counts (None: none), `k` their
        maximum (the width of the top tensors) -> one `SampleResult` per row."""
        ids = [int(t) for t in host[0]]
        if k is None:
            return [SampleResult(t) for t in ids]
        logprob, rank, top_ids, top_values = host[1], host[2], host[3], host[4]
        results = []
        for i, token in enumerate(ids):
            result = SampleResult(token)
            if logprobs[i] is not None:
                result.logprob, result.rank = logprob[i], int(rank[i])
                result.top = [(int(top_ids[i * k + j]), top_values[i * k + j]) for j in range(logprobs[i])]
            results.append(result)
        return results


def logprob_fields(raw: torch.Tensor, token_ids: torch.Tensor, k: int) -> DeviceSample:
    """Raw log-softmax facts of the chosen ids [L] in logits [L, V]: logprob, rank (1 = best), top k."""
    logprobs = torch.log_softmax(raw.float(), dim=-1)  # [L, V]
    chosen = logprobs.gather(1, token_ids[:, None])  # [L, 1]
    rank = (logprobs > chosen).sum(dim=-1) + 1  # [L]
    top_values, top_ids = logprobs.topk(k, dim=-1)  # [L, k]
    return DeviceSample(token_ids, chosen[:, 0], rank, top_ids, top_values)


def read_back(tensors: Sequence[torch.Tensor]) -> list[list[float]]:
    """The step's one device -> host transfer: the tensors packed into one float64 vector, copied once, split into
    one flat list per tensor (ids below 2**53 are exact)."""
    if not tensors:
        return []
    packed = torch.cat([t.reshape(-1).to(torch.float64) for t in tensors])  # [N]
    if packed.device.type == "cuda":
        host = torch.empty(packed.shape, dtype=torch.float64, pin_memory=True)
        host.copy_(packed, non_blocking=True)
        torch.cuda.current_stream(packed.device).synchronize()
        flat = host.tolist()
    else:
        flat = packed.tolist()
    out, at = [], 0
    for t in tensors:
        out.append(flat[at: at + t.numel()])
        at += t.numel()
    return out


class Sampler:
    """Stateless: every per-request state (seed, position, history) comes in with the rows."""

    def sample(self, logits: torch.Tensor, rows: Sequence[SampleRow]) -> list[SampleResult]:
        """logits [L, V] fp32 -> one `SampleResult` per row (one read-back)."""
        assert logits.shape[0] == len(rows)
        if not rows:
            return []
        batch = RowBatch.build(rows, logits.device)
        sample = self.sample_on_device(logits, rows, batch)
        return sample.to_results(read_back(sample.tensors()), batch.logprobs, batch.logprobs_k)

    def sample_on_device(self, logits: torch.Tensor, rows: Sequence[SampleRow], batch: RowBatch) -> DeviceSample:
        """logits [L, V] fp32 -> the rows' ids (and logprobs when asked) on the device; nothing is read back."""
        _, token_ids = self.process_and_pick(logits, rows, batch)
        if batch.logprobs_k is None:
            return DeviceSample(token_ids)
        return logprob_fields(logits, token_ids, batch.logprobs_k)

    def process_and_pick(self, logits: torch.Tensor, rows: Sequence[SampleRow], batch: RowBatch
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (the processed logits [L, V] (`logits` itself when no row changes it), the picked ids [L])."""
        plain = not batch.any_sampled and not any(r.params.has_penalties or r.suppress_ids or r.params.logit_bias
                                                  for r in rows)
        x = logits if plain else target_logits(logits, rows, batch)  # [L, V]
        return x, self.pick(x, batch)

    @staticmethod
    def pick(x: torch.Tensor, batch: RowBatch) -> torch.Tensor:
        """Processed logits [L, V] -> ids [L]: argmax for greedy rows, a seeded draw for the others."""
        greedy = x.argmax(dim=-1)  # [L]
        if not batch.any_sampled:
            return greedy
        drawn = categorical(torch.softmax(x, dim=-1), batch.keys(STREAM_SAMPLE))  # [L]
        return torch.where(batch.greedy, greedy, drawn) if batch.any_greedy else drawn
