"""RMS norms and L2 normalisation in the exact numeric forms of the Kimi reference models.

Contract (all ops normalise over the last dimension):
- `rms_norm(x, weight, eps)`: `x * rsqrt(mean(x²) + eps)` computed in fp32, cast back to `x.dtype`, THEN multiplied
  by `weight` (`weight * x_normed.to(dtype)`), exactly like transformers' `KimiLinearRMSNorm`. The result dtype is the
  promotion of `weight.dtype` and `x.dtype` (as in the reference).
- `rms_norm_no_weight(x, eps)`: fp32 in, fp32 out, no weight (attention-residual mixing in Kimi K3).
- `gated_rms_norm(x, weight, gate, eps)`: entirely in fp32, `rms_norm(x) · weight · sigmoid(gate)`, returned in
  `x.dtype` (`KimiLinearRMSNormGated`).
- `l2_normalize(x, eps=1e-6)`: `x / sqrt(sum x² + eps)` in fp32, returned in `x.dtype` (KDA's q/k norm).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _fp32(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype == torch.float32 else x.to(torch.float32)


def _normalize_fp32(x: torch.Tensor, eps: float) -> torch.Tensor:
    """fp32 `x * rsqrt(mean(x²) + eps)` over the last dim (torch's fused `rms_norm`: the same formula, bitwise)."""
    return F.rms_norm(_fp32(x), (x.shape[-1],), eps=eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm with the weight applied after casting back to `x.dtype`. x [..., D], weight [D]."""
    normed = _normalize_fp32(x, eps)
    return weight * (normed if x.dtype == torch.float32 else normed.to(x.dtype))


def rms_norm_no_weight(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Weightless RMSNorm; fp32 in, fp32 out. x [..., D]."""
    return _normalize_fp32(x, eps)


def gated_rms_norm(x: torch.Tensor, weight: torch.Tensor, gate: torch.Tensor, eps: float) -> torch.Tensor:
    """fp32 `rms_norm(x) · weight · sigmoid(gate)`, returned in `x.dtype`. x, gate [..., D], weight [D]."""
    out = F.rms_norm(_fp32(x), (x.shape[-1],), _fp32(weight), eps=eps)
    out = out.mul_(torch.sigmoid(_fp32(gate)))
    return out if x.dtype == torch.float32 else out.to(x.dtype)


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """`x / sqrt(sum x² + eps)` over the last dim, computed in fp32, returned in `x.dtype`."""
    x32 = _fp32(x)
    out = x32 * torch.rsqrt(x32.square().sum(-1, keepdim=True).add_(eps))
    return out if x.dtype == torch.float32 else out.to(x.dtype)
