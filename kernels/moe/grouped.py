"""Routed experts with tokens grouped by expert: one matmul pair per non-empty expert over a contiguous slice.

Contract: same signature and result as `kernels.moe.naive.moe_experts_naive` (equal to fp32 rounding). The T·k
(token, expert) assignments are sorted by expert id once (stable argsort, so each expert's tokens stay in token
order) and counted with `bincount` (the only host sync); expert e's assignments are then the contiguous slice
`[offset_e, offset_e + count_e)` of the sorted order. Each slice gathers its token rows, goes through
w1/w3 → act → w2 in `x.dtype`, is scaled by its routing weights in fp32 and written to its rows of a [T·k, D] buffer
in sorted order; one un-permute (a scatter with unique indices) and a sum over the k choices give each token's output
(`index_add_` with repeated indices is serial on CPU and was the bottleneck).
"""

from __future__ import annotations

import torch

from kernels.moe.activation import GatedActivation


def moe_experts_grouped(
    x: torch.Tensor,
    w1: torch.Tensor,
    w3: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    act: GatedActivation,
) -> torch.Tensor:
    T, D = x.shape
    k = topk_ids.shape[1]
    flat_ids = topk_ids.reshape(-1)  # [T*k]
    order = torch.argsort(flat_ids, stable=True)  # assignments grouped by expert, token order within an expert
    token_of = order // k  # [T*k] source token of each sorted assignment
    weight_of = topk_weights.reshape(-1)[order].to(torch.float32)  # [T*k]
    counts = torch.bincount(flat_ids, minlength=w1.shape[0]).tolist()
    sorted_out = torch.zeros(T * k, D, dtype=torch.float32, device=x.device)  # [T*k, D] in expert order
    start = 0
    for e, count in enumerate(counts):
        if count == 0:
            continue
        tokens = token_of[start : start + count]  # [count]
        seg = x[tokens]  # [count, D]
        hidden = act(seg @ w1[e].t(), seg @ w3[e].t())  # [count, I]
        out = (hidden @ w2[e].t()).to(torch.float32)  # [count, D]
        sorted_out[start : start + count] = out.mul_(weight_of[start : start + count, None])
        start += count
    per_choice = torch.empty_like(sorted_out)
    per_choice[order] = sorted_out  # back to (token, choice) order
    return per_choice.view(T, k, D).sum(dim=1).to(x.dtype)
