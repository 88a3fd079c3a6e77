"""Readable reference for the routed experts of an MoE layer.

Contract: `moe_experts_naive(x [T, D], w1 [E, I, D] (gate), w3 [E, I, D] (up), w2 [E, D, I] (down),
topk_weights [T, k], topk_ids [T, k], act) -> y [T, D]` with, per token,
`y = Σ_k topk_weights[k] · w2[e_k] @ act(w1[e_k] @ x, w3[e_k] @ x)`; an id outside `[0, E)` (an expert of another
rank under expert parallelism) adds nothing. The expert matmuls run in `x.dtype`, the
weighted sum accumulates in fp32, `y` is returned in `x.dtype`. Loops over experts (one matmul per expert).
"""

from __future__ import annotations

import torch

from kernels.moe.activation import GatedActivation


def moe_experts_naive(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                      topk_ids: torch.Tensor, act: GatedActivation) -> torch.Tensor:
    T, D = x.shape
    y = torch.zeros(T, D, dtype=torch.float32, device=x.device)
    for e in range(w1.shape[0]):
        tokens, slots = torch.where(topk_ids == e)  # tokens routed to e, and which of their k choices it is
        if tokens.numel() == 0:
            continue
        xe = x[tokens]  # [n, D]
        hidden = act(xe @ w1[e].t(), xe @ w3[e].t())  # [n, I]
        out = (hidden @ w2[e].t()).to(torch.float32)  # [n, D]
        y.index_add_(0, tokens, out * topk_weights[tokens, slots].to(torch.float32)[:, None])
    return y.to(x.dtype)
