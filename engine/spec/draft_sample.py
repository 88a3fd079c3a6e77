"""How a model drafter turns its logits into draft tokens (`draft_sample_method`, vLLM's names).

Contract: `DraftSampler(method)`; `method` is "greedy" (argmax; the proposal is deterministic, `Draft.probs` None)
or "probabilistic" (a sample from softmax(logits) at temperature 1, the raw draft distribution; `Draft.probs` holds
that distribution). A probabilistic draw for (request, position) is a function of (req_id, position) and the logits
alone, so drafts do not depend on batch composition or call order: the row's seed is splitmix64 of sha256(req_id)
and the position, and the draw is the exponential race `argmax(p_v / E_v)` (exactly a sample of p) with
`E_v = -log U_v`, `U_v` the v-th output of a splitmix64 stream of that seed — counter-based integer arithmetic on
the logits' device, no generator object, no host read.
- `pick_rows(logits [B, V] fp32, req_ids, positions [B] int64) -> (tokens [B] int64, probs [B, V] fp32 or None)`:
  every row at once, everything stays on the logits' device (host work: one sha256 per row).
- `pick(logits [V] fp32, req_id, position) -> (token, probs [V] or None)`: one row, the same draw as `pick_rows`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch

DRAFT_SAMPLE_METHODS = ("greedy", "probabilistic")

_GAMMA = 0x9E3779B97F4A7C15 - (1 << 64)  # splitmix64's increment and mixing constants, as signed int64
_MIX1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_MIX2 = 0x94D049BB133111EB - (1 << 64)


class DraftSampler:
    def __init__(self, method: str):
        if method not in DRAFT_SAMPLE_METHODS:
            raise ValueError(f"draft_sample_method {method!r}: expected one of {DRAFT_SAMPLE_METHODS}")
        self.method = method

    @property
    def deterministic(self) -> bool:
        return self.method == "greedy"

    def pick(self, logits: torch.Tensor, req_id: str, position: int) -> tuple[int, torch.Tensor | None]:
        tokens, probs = self.pick_rows(logits[None], [req_id], torch.tensor([position], device=logits.device))
        return int(tokens[0]), None if probs is None else probs[0]

    def pick_rows(self, logits: torch.Tensor, req_ids: Sequence[str], positions: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.deterministic:
            return logits.argmax(-1), None
        probs = logits.float().softmax(-1)  # [B, V]
        seeds = torch.tensor([_request_seed(r) for r in req_ids], dtype=torch.int64, device=logits.device)
        race = exponential_race(probs, _splitmix(seeds + positions.to(seeds.device) * _GAMMA))
        return race, probs


def exponential_race(probs: torch.Tensor, seeds: torch.Tensor) -> torch.Tensor:
    """probs [B, V], seeds [B] int64 -> [B] int64: row b's token drawn from probs[b] by the stream of seeds[b]."""
    counters = torch.arange(1, probs.shape[-1] + 1, dtype=torch.int64, device=probs.device) * _GAMMA  # [V]
    bits = _splitmix(seeds[:, None] + counters[None, :])  # [B, V]
    uniform = (_shift_right(bits, 11).double() + 0.5) * 2.0 ** -53  # (0, 1)
    return (probs.double() / -uniform.log()).argmax(-1)


def _request_seed(req_id: str) -> int:
    return int.from_bytes(hashlib.sha256(req_id.encode()).digest()[:8], "little") & ((1 << 63) - 1)


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 values (torch's `>>` is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _splitmix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's output function on int64 tensors (two's-complement wrap-around products)."""
    x = (x ^ _shift_right(x, 30)) * _MIX1
    x = (x ^ _shift_right(x, 27)) * _MIX2
    return x ^ _shift_right(x, 31)
