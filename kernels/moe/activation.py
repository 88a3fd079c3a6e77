"""Gated activations of the expert / dense MLPs: SwiGLU (Kimi Linear) and SiTU (Kimi K3).

Contract: `GatedActivation(kind, beta=1.0, linear_beta=None)(gate, up) -> tensor` in the input dtype.
- `silu`: `silu(gate) * up` computed in the input dtype (as transformers' `act(gate) * up`).
- `situ`: in fp32, `beta·tanh(g/beta)·sigmoid(g) · u'` with `u' = linear_beta·tanh(u/linear_beta)` when
  `linear_beta` is set, else `u' = u`; cast back to the input dtype (as the official `SituAndMul`). Computed as
  `tanh(g/beta)·sigmoid(g)·tanh(u/linear_beta)·(beta·linear_beta)` with in-place ops on fresh fp32 tensors
  (out of place when autograd records it: training a drafter through these modules).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.casting import cast, fp32

KINDS = ("silu", "situ")


@dataclass(frozen=True)
class GatedActivation:
    kind: str
    beta: float = 1.0
    linear_beta: float | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown gated activation {self.kind!r}; expected one of {KINDS}")

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if self.kind == "silu":
            return F.silu(gate) * up
        g = fp32(gate)
        u = fp32(up)
        if torch.is_grad_enabled() and (g.requires_grad or u.requires_grad):
            return self._situ_differentiable(g, u).to(gate.dtype)
        act = torch.div(g, self.beta).tanh_().mul_(torch.sigmoid(g))  # new tensors: in place from here on
        scale = self.beta
        if self.linear_beta is not None:
            u = torch.div(u, self.linear_beta).tanh_()
            scale *= self.linear_beta
        return cast(act.mul_(u).mul_(scale), gate.dtype)

    def _situ_differentiable(self, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """The same fp32 SiTU out of place, for autograd (drafter training)."""
        act = torch.tanh(g / self.beta) * torch.sigmoid(g)
        scale = self.beta
        if self.linear_beta is not None:
            u = torch.tanh(u / self.linear_beta)
            scale *= self.linear_beta
        return act * u * scale
