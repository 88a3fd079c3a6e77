"""MoE router for Kimi Linear / Kimi K3 (DeepSeek-V3 style sigmoid routing with a correction bias).

Contract: `route(router_logits [T, E] fp32, correction_bias [E], top_k, num_expert_group, topk_group, renormalize,
routed_scaling_factor) -> (topk_weights [T, k] fp32, topk_ids [T, k] int64)`

- `scores = sigmoid(logits)`; experts are chosen on `scores + correction_bias`.
- Grouped choice when `num_expert_group > 1` and `num_expert_group > topk_group`: a group's score is the sum of its
  two best biased scores; the best `topk_group` groups are kept and every expert of the others is masked to −inf.
- `topk_weights` are the UNBIASED scores of the chosen experts; when `renormalize` and `top_k > 1` they are divided
  by their sum + 1e-20; then multiplied by `routed_scaling_factor`.
- The set of chosen experts per token follows `torch.topk` (ties broken as torch does); the ids are returned sorted
  by descending biased score, so the order is deterministic.
"""

from __future__ import annotations

import torch

from kernels.casting import fp32


def _mask_to_best_groups(choice: torch.Tensor, num_expert_group: int, topk_group: int) -> torch.Tensor:
    """Masks experts outside each token's best `topk_group` groups to -inf. choice [T, E] -> [T, E]."""
    T, E = choice.shape
    grouped = choice.view(T, num_expert_group, E // num_expert_group)  # [T, G, E/G]
    group_scores = grouped.topk(2, dim=-1).values.sum(-1)  # [T, G]
    best_groups = group_scores.topk(topk_group, dim=-1).indices  # [T, topk_group]
    keep = torch.zeros(T, num_expert_group, dtype=torch.bool, device=choice.device)
    keep.scatter_(1, best_groups, True)
    return grouped.masked_fill(~keep[:, :, None], float("-inf")).view(T, E)


def route(
    router_logits: torch.Tensor,
    correction_bias: torch.Tensor,
    top_k: int,
    num_expert_group: int,
    topk_group: int,
    renormalize: bool,
    routed_scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    scores = torch.sigmoid(fp32(router_logits))  # [T, E]
    choice = scores + fp32(correction_bias)  # [T, E]
    if num_expert_group > 1 and num_expert_group > topk_group:
        choice = _mask_to_best_groups(choice, num_expert_group, topk_group)
    topk_ids = choice.topk(top_k, dim=-1, sorted=True).indices  # [T, k]
    topk_weights = scores.gather(1, topk_ids)  # [T, k]
    if renormalize and top_k > 1:
        topk_weights = topk_weights / (topk_weights.sum(-1, keepdim=True) + 1e-20)
    return topk_weights * routed_scaling_factor, topk_ids.to(torch.int64)
