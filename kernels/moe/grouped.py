"""Routed experts with tokens grouped by expert: one grouped matmul per projection over expert-contiguous rows.

Contract: same signature and result as `kernels.moe.naive.moe_experts_naive` (equal to fp32 rounding), including
its rule for ids outside `[0, E)`: such an assignment belongs to another rank's experts (expert parallelism) and
adds nothing. The T·k (token, expert) assignments are sorted by expert id once (stable argsort, so each expert's
tokens stay in token order; out-of-range ones last); expert e's assignments are then the contiguous rows
`[offset_e, offset_e + count_e)` of the sorted order. The gathered rows go through w1/w3 → act → w2 in `x.dtype`:
- as `torch.nn.functional.grouped_mm` calls over all experts at once (fp32/bf16/fp16 where torch has it, on CPU),
  else one matmul pair per non-empty expert (`bincount(...).tolist()` is then the only host sync);
- gate and up run as ONE matmul when `w1` and `w3` are the two halves of one `[E, 2I, D]` tensor
  (`gate_up_storage`, as `engine.model.moe.StackedExperts` lays them out), else as two.
Each token's output is `Σ_k weight_k · out_k` in fp32: the rows are un-permuted with one gather and reduced by one
batched [1, k] × [k, D] matmul (scatters and `index_add_` with repeated indices are serial on CPU), returned in
`x.dtype`. The gathered rows and the un-permuted outputs live in `kernels.workspace` scratch buffers (fresh 25 MB
tensors per 2,048-token chunk were page-fault bound on CPU). `sort_assignments` / `combine` are shared with the
packed-MXFP4 path (kernels/moe/mxfp4.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.moe.activation import GatedActivation
from kernels.workspace import gathered

GROUPED_MM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_grouped_mm = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


@dataclass(frozen=True)
class Assignments:
    """The T·k (token, expert) pairs sorted by expert; only the first `num_valid` are on this rank's experts."""

    order: torch.Tensor  # [T*k] int64, sorted position -> flat assignment index
    counts: torch.Tensor  # [E] int64, assignments per local expert
    num_valid: int
    all_valid: bool


def sort_assignments(topk_ids: torch.Tensor, num_experts: int) -> Assignments:
    flat_ids = topk_ids.reshape(-1)  # [T*k]
    valid = (flat_ids >= 0) & (flat_ids < num_experts)
    all_valid = bool(valid.all())
    if not all_valid:
        flat_ids = torch.where(valid, flat_ids, num_experts)  # sorted after every local expert
    order = torch.argsort(flat_ids, stable=True)  # assignments grouped by expert, token order within an expert
    counts = torch.bincount(flat_ids, minlength=num_experts + (0 if all_valid else 1))[:num_experts]  # [E]
    num_valid = flat_ids.numel() if all_valid else int(counts.sum())
    return Assignments(order, counts, num_valid, all_valid)


def combine(out: torch.Tensor, plan: Assignments, topk_weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """out [num_valid, D] expert outputs in sorted order -> [T, D] weighted sums (fp32, returned in `dtype`)."""
    T, k = topk_weights.shape
    D = out.shape[-1]
    weights = topk_weights.to(torch.float32)
    if plan.num_valid == 0:
        return torch.zeros(T, D, dtype=dtype, device=out.device)
    unsorted = torch.empty_like(plan.order)
    unsorted[plan.order] = torch.arange(plan.order.numel(), device=plan.order.device)  # sorted position of each
    if not plan.all_valid:
        on_rank = unsorted < plan.num_valid  # [T*k]
        weights = weights * on_rank.view(T, k)
        unsorted = unsorted.clamp_max(plan.num_valid - 1)  # any valid row: its weight is zero
    per_choice = gathered(out, unsorted, "moe.per_choice").to(torch.float32).view(T, k, D)  # [T, k, D]
    return torch.bmm(weights.view(T, 1, k), per_choice).view(T, D).to(dtype)


def gate_up_storage(w1: torch.Tensor, w3: torch.Tensor) -> torch.Tensor | None:
    """The `[E, 2I, D]` tensor whose rows `[:, :I]` are `w1` and `[:, I:]` are `w3`, when they are laid out so."""
    E, I, D = w1.shape
    if w3.shape != w1.shape or w1.dtype != w3.dtype or w1.device != w3.device or D == 0 or I == 0:
        return None
    if w1.stride() != (2 * I * D, D, 1) or w3.stride() != w1.stride():
        return None
    if w1.untyped_storage().data_ptr() != w3.untyped_storage().data_ptr():
        return None
    if w3.storage_offset() != w1.storage_offset() + I * D:
        return None
    return w1.as_strided((E, 2 * I, D), w1.stride())


def moe_experts_grouped(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor,
                        topk_weights: torch.Tensor, topk_ids: torch.Tensor, act: GatedActivation) -> torch.Tensor:
    T, D = x.shape
    k = topk_ids.shape[1]
    plan = sort_assignments(topk_ids, w1.shape[0])
    rows = gathered(x, plan.order[: plan.num_valid] // k, "moe.rows")  # [R, D] source token of each assignment
    if _grouped_mm is not None and x.dtype in GROUPED_MM_DTYPES and x.device.type == "cpu":
        out = _experts_grouped_mm(rows, w1, w3, w2, plan.counts, act)
    else:
        out = _experts_loop(rows, w1, w3, w2, plan.counts, act)
    return combine(out, plan, topk_weights, x.dtype)


def _experts_grouped_mm(rows, w1, w3, w2, counts, act) -> torch.Tensor:
    """rows [R, D] sorted by expert, counts [E] -> [R, D] expert outputs in sorted order."""
    I = w1.shape[1]
    offs = counts.cumsum(0).to(torch.int32)  # [E] end row of each expert
    gate_up = gate_up_storage(w1, w3)
    if gate_up is not None:
        h = _grouped_mm(rows, gate_up.transpose(1, 2), offs=offs)  # [R, 2I]
        gate, up = h[:, :I], h[:, I:]
    else:
        gate = _grouped_mm(rows, w1.transpose(1, 2), offs=offs)  # [R, I]
        up = _grouped_mm(rows, w3.transpose(1, 2), offs=offs)  # [R, I]
    return _grouped_mm(act(gate, up), w2.transpose(1, 2), offs=offs)  # [R, D]


def _experts_loop(rows, w1, w3, w2, counts, act) -> torch.Tensor:
    """The per-expert form of `_experts_grouped_mm` (any dtype and device)."""
    I = w1.shape[1]
    gate_up = gate_up_storage(w1, w3)
    out = torch.empty(rows.shape[0], w2.shape[1], dtype=rows.dtype, device=rows.device)  # [R, D]
    start = 0
    for e, count in enumerate(counts.tolist()):
        if count == 0:
            continue
        seg = rows[start : start + count]  # [count, D]
        if gate_up is not None:
            h = seg @ gate_up[e].t()  # [count, 2I]
            gate, up = h[:, :I], h[:, I:]
        else:
            gate, up = seg @ w1[e].t(), seg @ w3[e].t()
        torch.mm(act(gate, up), w2[e].t(), out=out[start : start + count])
        start += count
    return out
