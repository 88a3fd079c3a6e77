"""Varlen non-causal attention with `torch.nn.functional.scaled_dot_product_attention`, one call per image.

Contract: the same as `kernels.vision.naive.varlen_attention_naive` — `q, k, v [T, H, D]`, `cu_seqlens [N+1]`,
`scale` -> `o [T, H, D]` in `q.dtype`; image n attends within rows `cu_seqlens[n] : cu_seqlens[n+1]` only.
Images of equal length are batched into one SDPA call (no mask, no padding), so a request with many same-size
images costs one kernel launch per size; SDPA picks its fused backend (flash / memory-efficient / CPU flash).
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.nn.functional as F


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                     scale: float) -> torch.Tensor:
    bounds = [int(b) for b in cu_seqlens.tolist()]
    by_length: dict[int, list[int]] = defaultdict(list)  # image length -> start rows
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end > start:
            by_length[end - start].append(start)
    if len(by_length) == 1 and len(bounds) == 2:  # one image: no gather, no scatter
        return _attend(q[None], k[None], v[None], scale)[0]
    out = torch.empty_like(q)
    for length, starts in by_length.items():
        rows = (torch.tensor(starts, device=q.device)[:, None]
                + torch.arange(length, device=q.device)[None, :])  # [B, L]
        out[rows] = _attend(q[rows], k[rows], v[rows], scale)
    return out


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q, k, v [B, L, H, D] -> [B, L, H, D]."""
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=scale)
    return o.transpose(1, 2)  # [B, L, H, D]
