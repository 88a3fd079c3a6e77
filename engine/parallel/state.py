"""KDA state between a rank's slice and the TP-independent layout that handoffs and cache objects use.

Layout (as `engine.runner.ModelRunner.read_state` returns it at TP=1): `conv [L, 3*H*D, W-1]` — the q, k and v
channel blocks one after the other, each by head — and `recurrent [L, H, D, D]`, over the model's L KDA layers.
Rank r of N holds heads `[r*H/N, (r+1)*H/N)`: `conv [L, 3*(H/N)*D, W-1]` (its q, k and v channels, in that order)
and `recurrent [L, H/N, D, D]`.

Contract:
- `gather_state(slices)`: the N ranks' slices, in rank order -> the full layout. `scatter_state(full, size, rank)`:
  the inverse (a copy of rank `rank`'s slice). `scatter_state(gather_state(s), N, r)` equals `s[r]` bitwise.
- `all_gather_state(ctx, local)`: every rank gets the full layout (a collective: all ranks call it together).
- MLA blocks need no conversion: every rank holds the same latents (`[c, k_rope]` per token is replicated), so any
  rank's blocks are the full layout, and a write goes to every rank unchanged — except under decode-context
  parallelism, where the runner gathers and scatters token shares (kernels/attention/context_parallel.py).
- An empty dict (a model without KDA layers) maps to an empty dict.
"""

from __future__ import annotations

import torch

from engine.parallel.comm import RankContext


def _conv_by_part(conv: torch.Tensor) -> torch.Tensor:
    """[L, 3*C, W-1] -> [L, 3, C, W-1] (a view: the q, k, v channel blocks)."""
    layers, channels, width = conv.shape
    return conv.view(layers, 3, channels // 3, width)


def gather_state(slices: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    if not slices or not slices[0]:
        return {}
    conv = torch.cat([_conv_by_part(s["conv"]) for s in slices], dim=2)  # [L, 3, H*D, W-1]
    recurrent = torch.cat([s["recurrent"] for s in slices], dim=1)  # [L, H, D, D]
    return {"conv": conv.reshape(conv.shape[0], -1, conv.shape[-1]), "recurrent": recurrent}


def scatter_state(full: dict[str, torch.Tensor], size: int, rank: int) -> dict[str, torch.Tensor]:
    if not full:
        return {}
    conv = _conv_by_part(full["conv"]).chunk(size, dim=2)[rank]  # [L, 3, H/N*D, W-1]
    recurrent = full["recurrent"].chunk(size, dim=1)[rank]  # [L, H/N, D, D]
    return {"conv": conv.reshape(conv.shape[0], -1, conv.shape[-1]).clone(), "recurrent": recurrent.clone()}


def all_gather_state(ctx: RankContext, local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    if not local or ctx.size == 1:
        return local
    conv = ctx.all_gather(_conv_by_part(local["conv"]), dim=2)  # [L, 3, H*D, W-1]
    recurrent = ctx.all_gather(local["recurrent"], dim=1)  # [L, H, D, D]
    return {"conv": conv.reshape(conv.shape[0], -1, conv.shape[-1]), "recurrent": recurrent}
