"""Routed experts with tokens grouped by expert: one grouped matmul per projection over expert-contiguous rows.

Contract: same signature and result as `kernels.moe.naive.moe_experts_naive` (equal to fp32 rounding), including
its rule for ids outside `[0, E)`: such an assignment belongs to another rank's experts (expert parallelism) and
adds nothing. The T·k (token, expert) assignments are sorted by expert id once (stable argsort, so each expert's
tokens stay in token order; out-of-range ones last); expert e's assignments are then the contiguous rows
`[offset_e, offset_e + count_e)` of the sorted order. The gathered rows go through w1/w3 → act → w2 in `x.dtype`:
- as `torch.nn.functional.grouped_mm` calls over all experts at once (fp32/bf16/fp16 where torch has it, on CPU),
  else one matmul pair per non-empty expert (`bincount(...).tolist()` is then the only host sync; the
  grouped_mm form reads nothing back: offsets stay on the device, and assignments off this rank sort last, past
  the last offset, where `combine` masks them with `where`);
- gate and up run as ONE matmul when `w1` and `w3` are the two halves of one `[E, 2I, D]` tensor
  (`gate_up_storage`, as `engine.model.moe.StackedExperts` lays them out), else as two.
Each token's output is `Σ_k weight_k · out_k` in fp32: the rows are un-permuted with one gather and reduced by one
batched [1, k] × [k, D] matmul (scatters and `index_add_` with repeated indices are serial on CPU), returned in
`x.dtype`. The gathered rows and the un-permuted outputs live in `kernels.workspace` scratch buffers (fresh 25 MB
tensors per 2,048-token chunk were page-fault bound on CPU). `sort_assignments` / `combine` are shared with the
packed-MXFP4 path (kernels/moe/mxfp4.py).

Small batches (decode, verification) read nothing back to the host either way; the choice depends only on shapes:
- `T·k <= E` with input-major experts bound as `[E, D, 2I]` (`bag_layout`; how engine/model/fused.py
  `lay_out_for_gemv` stores them on CPU): `moe_experts_bagged` reads each assignment's expert rows in place, each
  product a weighted `embedding_bag` over the rows `e·K + j` (no weights copied; E = 32 top-4, 1 token, 8 layers
  with cold caches: 4.0-4.3 ms vs 3.9-4.5 ms gathered, both at ~9 GB/s; a demo-k3 decode step 1.05x, small-linear
  1.01x, paired in one process). In fp32 where kernels/cpu/small_gemm.py is built, the same rows go through its
  kernel instead (kernels/cpu/expert_gemm.py: each chosen expert's rows one contiguous block, streamed as any
  input-major weight — the bags ran at ~14 GB/s in small-linear's compiled step); the routing weights scale the
  activations before the down products, which sum a token's choices. The other paths read either layout (no
  reshape of the weights).
- `3·T·k <= E` (`moe_experts_gathered`, `GATHER_TRAFFIC`): each assignment's expert weights are gathered and
  multiplied in one batched matrix-vector product per projection — no sort, no counts. The copy costs each chosen
  expert three passes over its weights, so more assignments take the sorted form, which reads each used expert
  once (bench, E=32 top-4, CPU: gathered 0.64 ms vs sorted 0.75 at 1 token, 5.4 vs 3.1 at 4).
- A compiled step cannot inspect storages, so `bag_layout` says None there; engine/model/moe.py hands it the
  bound gate/up tensor instead (`bag_layout_of_fused`, strides only) and calls `moe_experts_bags` (inductor
  would lower the gathered form's one-row products to a strided multiply-and-sum: 4.4 ms of a 21 ms small-linear
  step).
- Inside a compiled step (which cannot trace fp32 `grouped_mm`) up to `DENSE_MAX_TOKENS` tokens run every expert
  on every token (`moe_experts_every_expert`: one matmul over all experts' gate/up, one batched matmul for down,
  dense [T, E] routing weights, zero for experts not chosen); larger compiled batches would take the sorted form.
Assignments outside `[0, E)` (another rank's experts) get weight zero on both paths.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.casting import cast, fp32
from kernels.cpu import expert_gemm
from kernels.moe.activation import GatedActivation
from kernels.workspace import gathered

GROUPED_MM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
DENSE_MAX_TOKENS = 64  # compiled batches up to this many tokens (not gathered) run every expert on every token
# Gathering an assignment's expert weights copies them once and reads them twice (the copy, the product): it beats
# the sorted form only while GATHER_TRAFFIC * T * k <= E.
GATHER_TRAFFIC = 3
# With input-major expert weights, reading each assignment's expert rows in place (no copy) beats the sorted form
# while T * k <= this * E (bench/bench_decode_step.py, small-linear: E = 32, top-4 -> up to 8 tokens).
BAG_MAX_ASSIGNMENTS_PER_EXPERT = 1
# Through the small-batch kernel (kernels/cpu/expert_gemm.py) the assignments are grouped by expert, up to 8 rows a
# product, so each chosen expert is read about once while T * k <= 8 * E: a verification or a decode batch takes it
# instead of running every expert on every token (demo-k3, 4 rows x 4 tokens: 16 x 8 products instead of 16 x 2).
KERNEL_MAX_ASSIGNMENTS_PER_EXPERT = 8
_grouped_mm = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


@dataclass(frozen=True)
class Assignments:
    """The T·k (token, expert) pairs sorted by expert; those on another rank's experts sort last (no host read:
    how many are on this rank is never needed on the host)."""

    order: torch.Tensor  # [T*k] int64, sorted position -> flat assignment index
    counts: torch.Tensor  # [E] int64, assignments per local expert
    on_rank: torch.Tensor  # [T*k] bool, per flat assignment: its expert is on this rank


def sort_assignments(topk_ids: torch.Tensor, num_experts: int) -> Assignments:
    flat_ids = topk_ids.reshape(-1)  # [T*k]
    on_rank = (flat_ids >= 0) & (flat_ids < num_experts)
    keyed = torch.where(on_rank, flat_ids, num_experts)  # sorted after every local expert
    order = torch.argsort(keyed, stable=True)  # assignments grouped by expert, token order within an expert
    counts = torch.bincount(keyed, minlength=num_experts + 1)[:num_experts]  # [E]
    return Assignments(order, counts, on_rank)


def combine(out: torch.Tensor, plan: Assignments, topk_weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """out [T*k, D] expert outputs in sorted order (rows of assignments off this rank are never read: they may hold
    anything) -> [T, D] weighted sums (fp32, returned in `dtype`)."""
    T, k = topk_weights.shape
    D = out.shape[-1]
    unsorted = torch.empty_like(plan.order)
    unsorted[plan.order] = torch.arange(plan.order.numel(), device=plan.order.device)  # sorted position of each
    per_choice = fp32(gathered(out, unsorted, "moe.per_choice")).view(T, k, D)  # [T, k, D]
    per_choice = torch.where(plan.on_rank.view(T, k, 1), per_choice, 0.0)  # `where`: garbage rows never leak
    return cast(torch.bmm(fp32(topk_weights).view(T, 1, k), per_choice).view(T, D), dtype)


def gate_up_storage(w1: torch.Tensor, w3: torch.Tensor) -> torch.Tensor | None:
    """The `[E, 2I, D]` tensor whose rows `[:, :I]` are `w1` and `[:, I:]` are `w3`, when they are laid out so
    (None inside a compiled step, which cannot inspect storages: gate and up then run as two products)."""
    if torch.compiler.is_compiling():
        return None
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


def gate_up_input_major(w1: torch.Tensor, w3: torch.Tensor) -> torch.Tensor | None:
    """The contiguous `[E, D, 2I]` tensor whose columns `[..., :I]` are `w1` and `[..., I:]` are `w3` (each
    `[E, I, D]` stored input-major, as `engine.model.fused.lay_out_for_gemv` lays the routed experts out on CPU),
    or None (other layouts, or inside a compiled step, which cannot inspect storages)."""
    if torch.compiler.is_compiling():
        return None
    E, I, D = w1.shape
    if w3.shape != w1.shape or w1.dtype != w3.dtype or w1.device != w3.device or D == 0 or I == 0:
        return None
    if w1.stride() != (2 * I * D, 1, 2 * I) or w3.stride() != w1.stride():
        return None
    if w1.untyped_storage().data_ptr() != w3.untyped_storage().data_ptr():
        return None
    if w3.storage_offset() != w1.storage_offset() + I:
        return None
    return w1.as_strided((E, D, 2 * I), (2 * I * D, 2 * I, 1))


def bound_gate_up(w1: torch.Tensor, w3: torch.Tensor) -> torch.Tensor | None:
    """The `[E, 2I, D]` view over `w1` and `w3` bound into one tensor, row- or input-major, else None."""
    gate_up = gate_up_storage(w1, w3)
    if gate_up is not None:
        return gate_up
    gate_up = gate_up_input_major(w1, w3)
    return None if gate_up is None else gate_up.transpose(1, 2)


@dataclass(frozen=True)
class BagLayout:
    """Expert weights as embedding-bag tables: row `e * K + j` is input `j` of expert `e`'s product."""

    gate_up: torch.Tensor  # [E*D, 2I] gate and up outputs of each (expert, input)
    down: torch.Tensor  # [E*I, D] down outputs of each (expert, intermediate unit)


def bag_layout(w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor) -> BagLayout | None:
    """`BagLayout` views (no copy) of input-major experts with gate/up bound into one tensor, else None."""
    gate_up = gate_up_input_major(w1, w3)
    if gate_up is None or w2.dtype != w1.dtype:
        return None
    E, D, I = w2.shape
    if w2.stride() != (D * I, 1, D):  # w2 [E, D, I] input-major: its transpose [E, I, D] is contiguous
        return None
    return BagLayout(gate_up.view(E * D, 2 * I), w2.transpose(1, 2).view(E * I, D))


def moe_experts_grouped(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor,
                        topk_weights: torch.Tensor, topk_ids: torch.Tensor, act: GatedActivation) -> torch.Tensor:
    T, D = x.shape
    k = topk_ids.shape[1]
    if bags_fit(topk_ids, w1.shape[0], x) and bag_layout(w1, w3, w2) is not None:
        return moe_experts_bagged(x, w1, w3, w2, topk_weights, topk_ids, act)
    if GATHER_TRAFFIC * T * k <= w1.shape[0]:
        return moe_experts_gathered(x, w1, w3, w2, topk_weights, topk_ids, act)
    if torch.compiler.is_compiling() and T <= DENSE_MAX_TOKENS:  # grouped_mm has no fp32 tracing support
        return moe_experts_every_expert(x, w1, w3, w2, topk_weights, topk_ids, act)
    plan = sort_assignments(topk_ids, w1.shape[0])
    rows = gathered(x, plan.order // k, "moe.rows")  # [T*k, D] source token of each assignment, sorted
    if _grouped_mm is not None and x.dtype in GROUPED_MM_DTYPES and x.device.type == "cpu":
        out = _experts_grouped_mm(rows, w1, w3, w2, plan.counts, act)
    else:
        out = _experts_loop(rows, w1, w3, w2, plan.counts, act)
    return combine(out, plan, topk_weights, x.dtype)


def _experts_grouped_mm(rows, w1, w3, w2, counts, act) -> torch.Tensor:
    """rows [R, D] sorted by expert, counts [E] -> [R, D] expert outputs in sorted order."""
    I = w1.shape[1]
    offs = counts.cumsum(0).to(torch.int32)  # [E] end row of each expert
    gate_up = bound_gate_up(w1, w3)
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
    gate_up = bound_gate_up(w1, w3)
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


def _local_weights(topk_weights: torch.Tensor, topk_ids: torch.Tensor, num_experts: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 weights [T, k] zeroed off this rank's experts, ids [T, k] clamped into [0, E)): no host read."""
    on_rank = (topk_ids >= 0) & (topk_ids < num_experts)
    return fp32(topk_weights) * on_rank, topk_ids.clamp(0, num_experts - 1)


def moe_experts_gathered(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor,
                         topk_weights: torch.Tensor, topk_ids: torch.Tensor, act: GatedActivation) -> torch.Tensor:
    """Each (token, choice) with its expert's weights gathered: [T·k] batched matmuls. x [T, D] -> [T, D]."""
    T, D = x.shape
    k = topk_ids.shape[1]
    E, I, _ = w1.shape
    weights, ids = _local_weights(topk_weights, topk_ids, E)
    flat = ids.reshape(-1)  # [T*k]
    rows = x.unsqueeze(1).expand(T, k, D).reshape(T * k, 1, D)  # [Tk, 1, D]
    gate_up = bound_gate_up(w1, w3)
    if gate_up is not None:
        h = torch.bmm(rows, gate_up.index_select(0, flat).transpose(1, 2))  # [Tk, 1, 2I]
        gate, up = h[..., :I], h[..., I:]
    else:
        gate = torch.bmm(rows, w1.index_select(0, flat).transpose(1, 2))  # [Tk, 1, I]
        up = torch.bmm(rows, w3.index_select(0, flat).transpose(1, 2))
    out = torch.bmm(act(gate, up), w2.index_select(0, flat).transpose(1, 2))  # [Tk, 1, D]
    return cast(torch.bmm(weights.view(T, 1, k), fp32(out.view(T, k, D))).view(T, D), x.dtype)


def bag_layout_of_fused(gate_up: torch.Tensor, w2: torch.Tensor) -> BagLayout | None:
    """`BagLayout` views of a bound gate/up tensor `[E, 2I, D]` and `w2` `[E, D, I]`, both input-major, else None.
    Decided from shapes and strides only, so a compiled step can take it (the caller vouches that `gate_up` is
    the tensor w1 and w3 are halves of: `engine.model.fused.ParamGroup.tensor()`)."""
    E, two_i, D = gate_up.shape
    I = two_i // 2
    if (gate_up.stride() != (two_i * D, 1, two_i) or w2.shape != (E, D, I) or w2.stride() != (D * I, 1, D)
            or w2.dtype != gate_up.dtype):
        return None
    return BagLayout(gate_up.transpose(1, 2).reshape(E * D, two_i), w2.transpose(1, 2).reshape(E * I, D))


def bags_fit(topk_ids: torch.Tensor, num_experts: int, x: torch.Tensor) -> bool:
    """Whether a step's assignments are few enough for the bagged products of `x` (from shapes and dtypes: more
    where the small-batch kernel takes them, grouped by expert)."""
    kernel = x.device.type == "cpu" and x.dtype == torch.float32 and expert_gemm.small_gemm.available()
    per_expert = KERNEL_MAX_ASSIGNMENTS_PER_EXPERT if kernel else BAG_MAX_ASSIGNMENTS_PER_EXPERT
    return topk_ids.shape[0] * topk_ids.shape[1] <= per_expert * num_experts


def moe_experts_bagged(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor,
                       topk_weights: torch.Tensor, topk_ids: torch.Tensor, act: GatedActivation) -> torch.Tensor:
    """Each (token, choice)'s products read its expert's input-major rows in place, as weighted embedding bags:
    `W @ v = Σ_j v_j · W[:, j]`, the bag of rows `e·K + j` weighted by `v` (no weights copied, no host read).
    x [T, D] -> [T, D]; needs `bag_layout(w1, w3, w2)`."""
    return moe_experts_bags(x, bag_layout(w1, w3, w2), w1.shape[0], topk_weights, topk_ids, act)


def moe_experts_bags(x: torch.Tensor, tables: BagLayout, num_experts: int, topk_weights: torch.Tensor,
                     topk_ids: torch.Tensor, act: GatedActivation) -> torch.Tensor:
    """`moe_experts_bagged` over given tables (`bag_layout` / `bag_layout_of_fused`). x [T, D] -> [T, D]."""
    T, D = x.shape
    k = topk_ids.shape[1]
    E, I = num_experts, tables.gate_up.shape[1] // 2
    weights, ids = _local_weights(topk_weights, topk_ids, E)
    gate_up, down = tables.gate_up.view(E, D, 2 * I), tables.down.view(E, I, D)  # each expert input-major
    if expert_gemm.runs(x, gate_up) and expert_gemm.runs(x, down):  # the same rows through our kernel
        h = expert_gemm.products(x, gate_up, ids)  # [T, k, 2I]
        scaled = act(h[..., :I], h[..., I:]) * weights.view(T, k, 1)  # [T, k, I]
        return expert_gemm.products_sum(scaled, down, ids)  # [T, D]
    flat = ids.reshape(-1, 1)  # [Tk, 1]
    rows_in = (flat * D + torch.arange(D, device=x.device)).view(-1)  # [Tk*D] table rows of each assignment
    starts_in = torch.arange(0, T * k * D, D, device=x.device)  # [Tk] one bag per assignment
    h = F.embedding_bag(rows_in, tables.gate_up, starts_in, mode="sum",
                        per_sample_weights=x.repeat_interleave(k, dim=0).view(-1))  # [Tk, 2I]
    hidden = act(h[:, :I], h[:, I:])  # [Tk, I]
    rows_mid = (flat * I + torch.arange(I, device=x.device)).view(-1)  # [Tk*I]
    if x.dtype == torch.float32:  # the routing weights scale the bags' inputs: one bag per token sums its choices
        scaled = (hidden.view(T, k, I) * weights.view(T, k, 1)).view(-1)
        starts = torch.arange(0, T * k * I, k * I, device=x.device)  # [T]
        return F.embedding_bag(rows_mid, tables.down, starts, mode="sum", per_sample_weights=scaled)
    starts = torch.arange(0, T * k * I, I, device=x.device)  # [Tk]: outputs per choice, summed in fp32
    out = F.embedding_bag(rows_mid, tables.down, starts, mode="sum", per_sample_weights=hidden.reshape(-1))
    return cast(torch.bmm(weights.view(T, 1, k), fp32(out.view(T, k, D))).view(T, D), x.dtype)


def moe_experts_every_expert(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor,
                             topk_weights: torch.Tensor, topk_ids: torch.Tensor, act: GatedActivation) -> torch.Tensor:
    """Every expert on every token, summed with dense routing weights [T, E]. x [T, D] -> [T, D]."""
    T, D = x.shape
    E, I, _ = w1.shape
    weights, ids = _local_weights(topk_weights, topk_ids, E)
    dense = torch.zeros(T, E, dtype=torch.float32, device=x.device).scatter_add_(1, ids, weights)  # [T, E]
    gate_up = bound_gate_up(w1, w3)  # products by expert: no reshape, which would copy input-major weights
    if gate_up is not None:
        h = torch.matmul(x, gate_up.transpose(1, 2))  # [E, T, 2I]
        gate, up = h[..., :I], h[..., I:]
    else:
        gate, up = torch.matmul(x, w1.transpose(1, 2)), torch.matmul(x, w3.transpose(1, 2))  # [E, T, I]
    out = torch.bmm(act(gate, up), w2.transpose(1, 2))  # [E, T, D]
    per_token = fp32(out.transpose(0, 1))  # [T, E, D]
    return cast(torch.bmm(dense.unsqueeze(1), per_token).view(T, D), x.dtype)  # [T, 1, E] x [T, E, D]
