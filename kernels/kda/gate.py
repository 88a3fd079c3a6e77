"""The two KDA forget-gate forms, turning the gate projection into per-channel log-decays g (<= 0), in fp32.

Contract: `f` is the gate projection output with last dim H*K (any leading dims, typically [T, H*K]); `dt_bias` is
[H*K]; the result is g [..., H, K] in fp32. `A_log` is per head and may carry extra singleton dims ([1, 1, H, 1]) or
padding beyond H entries ([128] in Kimi K3 checkpoints): the first `num_heads` entries are used.

- `kda_gate_softplus` (Kimi Linear):   g = -exp(A_log_h) * softplus(f + dt_bias), softplus(x) = x where x > 20
- `kda_gate_lower_bound` (Kimi K3):    g = lower_bound * sigmoid(exp(A_log_h) * (f + dt_bias)), so g in (lower_bound, 0)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.casting import fp32


def _per_head(A_log: torch.Tensor, num_heads: int) -> torch.Tensor:
    """exp(A_log) for the first `num_heads` entries, shaped [H, 1] to broadcast over a [..., H, K] gate."""
    return torch.exp(fp32(A_log).reshape(-1)[:num_heads]).unsqueeze(-1)


def _biased(f: torch.Tensor, dt_bias: torch.Tensor, num_heads: int) -> torch.Tensor:
    """(f + dt_bias) in fp32, reshaped [..., H*K] -> [..., H, K]."""
    x = fp32(f) + fp32(dt_bias)
    return x.unflatten(-1, (num_heads, -1))


def kda_gate_softplus(f, A_log, dt_bias, num_heads):
    """Kimi Linear's gate: -exp(A_log) * softplus(f + dt_bias) -> g [..., H, K] fp32."""
    x = _biased(f, dt_bias, num_heads)  # [..., H, K]
    return -_per_head(A_log, num_heads) * F.softplus(x, beta=1.0, threshold=20.0)


def kda_gate_lower_bound(f, A_log, dt_bias, num_heads, lower_bound):
    """Kimi K3's bounded gate: lower_bound * sigmoid(exp(A_log) * (f + dt_bias)) -> g [..., H, K] fp32."""
    x = _biased(f, dt_bias, num_heads)  # [..., H, K]
    return lower_bound * torch.sigmoid(_per_head(A_log, num_heads) * x)
