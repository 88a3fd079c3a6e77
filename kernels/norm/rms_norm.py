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


def _normalize_fp32(x: torch.Tensor, eps: float) -> torch.Tensor:
    """fp32 `x * rsqrt(mean(x²) + eps)` over the last dim."""
    x32 = x.to(torch.float32)
    variance = x32.pow(2).mean(-1, keepdim=True)
    return x32 * torch.rsqrt(variance + eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm with the weight applied after casting back to `x.dtype`. x [..., D], weight [D]."""
    return weight * _normalize_fp32(x, eps).to(x.dtype)


def rms_norm_no_weight(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Weightless RMSNorm; fp32 in, fp32 out. x [..., D]."""
    return _normalize_fp32(x, eps)


def gated_rms_norm(x: torch.Tensor, weight: torch.Tensor, gate: torch.Tensor, eps: float) -> torch.Tensor:
    """fp32 `rms_norm(x) · weight · sigmoid(gate)`, returned in `x.dtype`. x, gate [..., D], weight [D]."""
    out = _normalize_fp32(x, eps) * weight.to(torch.float32)
    out = out * torch.sigmoid(gate.to(torch.float32))
    return out.to(x.dtype)


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """`x / sqrt(sum x² + eps)` over the last dim, computed in fp32, returned in `x.dtype`."""
    x32 = x.to(torch.float32)
    return (x32 * torch.rsqrt(x32.pow(2).sum(-1, keepdim=True) + eps)).to(x.dtype)
