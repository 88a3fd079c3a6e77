"""Readable reference for varlen non-causal attention: every token attends to every token of its own image.

Contract:
`varlen_attention_naive(q [T, H, D], k [T, H, D], v [T, H, D], cu_seqlens [N+1], scale) -> o [T, H, D]`

- Image n owns rows `cu_seqlens[n] : cu_seqlens[n+1]`; its tokens attend to exactly those rows (no causal mask,
  nothing across images). Empty images are allowed and produce no rows.
- Scores, softmax and the weighted sum run in fp32; `o` is returned in `q.dtype`.
"""

from __future__ import annotations

import torch


def varlen_attention_naive(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                           scale: float) -> torch.Tensor:
    out = torch.empty_like(q)
    bounds = [int(b) for b in cu_seqlens.tolist()]
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end == start:
            continue
        qi, ki, vi = (t[start:end].to(torch.float32) for t in (q, k, v))  # [L, H, D]
        scores = torch.einsum("qhd,khd->hqk", qi, ki) * scale  # [H, L, L]
        probs = torch.softmax(scores, dim=-1)
        out[start:end] = torch.einsum("hqk,khd->qhd", probs, vi).to(q.dtype)
    return out
