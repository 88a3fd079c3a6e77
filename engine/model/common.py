"""Building blocks shared by the mixers and FFNs, each built for one tensor-parallel rank.

Contract:
- `Linear` is a bias-free `nn.Linear` (same parameter name and layout) whose product runs through `kernels.linear`.
  `_linear(in, out, shard_dim)` builds one with this rank's LOCAL sizes; `shard_dim` says how the checkpoint tensor
  is split across ranks: 0 column-parallel (rank r holds output rows `[r*out, (r+1)*out)`), 1 row-parallel (input
  columns `[r*in, (r+1)*in)`; its product is a partial sum the owner all-reduces), None replicated.
- A module's `tp_dims` maps its parameter attribute names to their split dim in the checkpoint tensor;
  `engine.model.loader` reads each parameter's slice from it (`rank * local_size` along that dim).
- `GatedMLP` is column -> row parallel and returns this rank's PARTIAL sum; the caller all-reduces (so a dense FFN,
  or the shared experts together with the routed ones, cost one all-reduce).
- `VocabEmbedding` holds vocabulary rows `[r*V/N, (r+1)*V/N)`; ids outside give zero rows and the all-reduce sums
  the ranks' rows, so every rank gets the full embedding (bitwise: exactly one rank contributes a non-zero row).
- RMSNorm computes in fp32 and multiplies the weight after casting back (docs/architecture.md, "Shared forms").
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.config import ModelConfig
from engine.model.fused import FusedLinear
from engine.parallel.comm import SINGLE, RankContext
from kernels.linear import linear
from kernels.moe.activation import GatedActivation
from kernels.norm.rms_norm import rms_norm

# Widest intermediate whose gate/up run as one matmul: on CPU, fused was 2.5x (I=128) and ~1.1x (I=1024) faster at
# 32 tokens, and slower at I=2048.
FUSED_GATE_UP_MAX = 1024


class Linear(nn.Linear):
    """A bias-free `nn.Linear` (same parameter name and layout) whose product runs through `kernels.linear`;
    `compact_weight`, where the loader set one, is the weight's exact bf16 copy the small-batch kernel reads."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.compact_weight: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.compact_weight)


def _linear(in_features: int, out_features: int, shard_dim: int | None = None) -> nn.Linear:
    layer = Linear(in_features, out_features, bias=False)
    if shard_dim is not None:
        layer.tp_dims = {"weight": shard_dim}
    return layer


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def gated_activation(config: ModelConfig) -> GatedActivation:
    act = config.activation
    return GatedActivation(kind=act.kind, beta=act.situ_beta, linear_beta=act.situ_linear_beta)


class GatedMLP(nn.Module):
    """`down_proj(act(gate_proj(x), up_proj(x)))`: the dense FFN and the shared experts (a partial sum under TP)."""

    def __init__(self, hidden: int, intermediate: int, act: GatedActivation, ctx: RankContext = SINGLE,
                 what: str = "intermediate_size"):
        super().__init__()
        intermediate = ctx.split(intermediate, what)
        self.gate_proj = _linear(hidden, intermediate, shard_dim=0)
        self.up_proj = _linear(hidden, intermediate, shard_dim=0)
        self.down_proj = _linear(intermediate, hidden, shard_dim=1)
        self.act = act
        # Fusing gate/up pays for narrow MLPs (shared experts); wide ones already run as large matmuls, and on CPU a
        # fused output over 32 MiB is page-faulted afresh on every call (see engine/runner.py).
        self.gate_up = FusedLinear([[self.gate_proj], [self.up_proj]]) if intermediate <= FUSED_GATE_UP_MAX else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x) if self.gate_up is not None else (self.gate_proj(x), self.up_proj(x))  # [T, I]
        return self.down_proj(self.act(gate, up))  # [T, D], this rank's partial sum


class VocabEmbedding(nn.Module):
    """`nn.Embedding`'s `weight` [V/N, D], vocabulary-parallel."""

    def __init__(self, vocab_size: int, hidden: int, ctx: RankContext = SINGLE):
        super().__init__()
        self.start, end = ctx.shard_range(vocab_size, "vocab_size")
        self.weight = nn.Parameter(torch.empty(end - self.start, hidden))
        self.tp_dims = {"weight": 0}
        self.ctx = ctx

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # ids [T] -> [T, D]
        if self.ctx.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        inside = (local >= 0) & (local < self.weight.shape[0])  # [T]
        rows = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight)
        return self.ctx.all_reduce(rows * inside.unsqueeze(-1).to(rows.dtype))
