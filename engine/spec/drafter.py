"""The drafter contract of speculative decoding: what the engine gives a drafter and what it gets back.

This file is the seam between the engine's speculative core (scheduler, runner, verification, acceptance:
engine/spec/ outside this file's drafters) and the drafters (`ngram`, `mtp`, `dspark`). Nothing here runs a model.

Contract (one `Drafter` per engine; every call comes from the engine's step thread):
- `taps`: which target hidden streams the drafter reads, as target layer ids (0-based; the stream a layer hands
  on, as the drafter's method defines it) plus `FINAL_TAP` for the final hidden state before `model.norm`. Empty:
  the drafter reads no hidden state (n-gram). The runner captures exactly these rows, concatenated in `taps` order:
  `[n, len(taps) * hidden_size]`, in the target's dtype.
- `observe(req_id, start, token_ids, hidden)`: the target has *committed* positions `start … start + n - 1` of the
  request (a prefill chunk, or the accepted part of a verification, bonus input included), `token_ids` are the
  input tokens at those positions and `hidden` their tapped rows (None when `taps` is empty). Calls for one request
  come in position order without gaps, except after `rollback` or a prefix-cache hit / an imported handoff, where
  the first call may start later than 0 (positions the target did not compute here are never observed: the drafter
  drafts from what it has). Positions that were verified but rejected are never observed.
- `propose(queries)`: for each `DraftQuery`, up to `num_tokens` draft tokens that would follow `token_ids` (every
  token so far: prompt + output, the last one being the token the target will read next). Returns one `Draft` per
  query, in order. A drafter may return fewer tokens (even none): the request then verifies fewer positions.
  `Draft.probs` is None for a deterministic drafter (a one-hot proposal: rejection sampling treats q(x) = 1), else
  `[len(tokens), vocab]` fp32 probabilities the tokens were sampled from (the `draft_sample_method`), on the
  drafter's device (they are never read back to the host).
- `rollback(req_id, num_tokens)`: forget everything observed at positions ≥ `num_tokens` (preemption by recompute
  rolls back to 0). `release(req_id)`: the request is finished or aborted; drop its state.
- A drafter may defer an `observe`'s computation to a later call (the model drafters compute the observed rows of
  all requests in one batched pass at the next `propose`); the result is the same as computing it at once.
- A drafter never changes the target's outputs: verification decides every token (engine/spec/accept.py).
- Construction: each method's factory `build(config, target: DraftTarget) -> Drafter` (registered in
  engine/spec/config.py `DRAFTER_FACTORIES`); `DraftTarget` is what the engine knows of its target at start-up.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch

FINAL_TAP = -1  # the target's final hidden state (after the output mix of attention residuals, before model.norm)


@dataclass(frozen=True)
class DraftQuery:
    req_id: str
    token_ids: Sequence[int]  # prompt + output so far; the last is the next input of the target
    num_tokens: int  # how many drafts the step has room for (≤ num_speculative_tokens)


@dataclass(frozen=True)
class Draft:
    tokens: tuple[int, ...]
    probs: torch.Tensor | None = None  # [len(tokens), vocab] fp32; None: deterministic (one-hot) proposals


@dataclass(frozen=True)
class DraftTarget:
    """The target a drafter serves: its model (a `KimiForCausalLM`, for shared embedding / LM head), checkpoint
    folder, device, dtype, the engine's limits and its compilation config (None under `enforce_eager`)."""

    model: object  # engine.model.model.KimiForCausalLM (typed loosely: this module imports no engine model code)
    model_dir: str
    device: torch.device
    dtype: torch.dtype
    max_model_len: int
    max_num_seqs: int
    compilation: object = None  # engine.compilation.CompilationConfig the drafter's step compiles by (None: eager)


class Drafter(ABC):
    taps: tuple[int, ...] = ()

    def observe(self, req_id: str, start: int, token_ids: Sequence[int], hidden: torch.Tensor | None) -> None:
        """Committed target positions `start … start + len(token_ids) - 1`; `hidden` `[n, len(taps) * D]`."""

    @abstractmethod
    def propose(self, queries: Sequence[DraftQuery]) -> list[Draft]:
        """One `Draft` per query, in order."""

    def rollback(self, req_id: str, num_tokens: int) -> None:
        """Forget positions ≥ `num_tokens`."""

    def release(self, req_id: str) -> None:
        """Drop the request's state."""
