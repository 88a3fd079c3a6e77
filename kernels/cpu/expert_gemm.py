"""Routed experts' one-row products on CPU through the small-batch kernel (kernels/cpu/small_gemm.c).

Contract:
- `runs(x, experts)`: whether `products`/`products_sum` can take a batch — the kernel `available` (built, see
  kernels/cpu/small_gemm.py), fp32 CPU inputs, experts `[E, K, N]` contiguous (each expert input-major: the
  layout `bag_layout` views decode's experts in, kernels/moe/grouped.py) in fp32 or bf16 (an exact bf16 copy,
  widened as the kernel loads it: `StackedExperts.compact_gate_up` and `compact_w2`, engine/model/moe.py), no
  autograd.
- `products(x, experts, ids)`: x [T, K], ids [T, c] int64 in [0, E) -> [T, c, N], (t, j) = x[t] @ experts[ids[t, j]].
- `products_sum(h, experts, ids)`: h [T, c, K] -> [T, N], t = Σ_j h[t, j] @ experts[ids[t, j]] (choices added in
  order). Both equal the embedding-bag form within fp32 rounding, and a token's result does not depend on the
  tokens beside it (bitwise). The assignments are grouped by expert (up to 8 rows a product), so tokens that chose
  one expert (a verification's, a batch's) read its weight once: small-k3's verify step 3.8 -> 3.3 ms in experts. They call `torch.ops.kdamesh_cpu.expert_gemm` / `expert_gemm_sum` (registered by
  kernels/cpu/small_gemm_op.cpp), eagerly and from a compiled step alike (opaque to inductor, shape-checked by
  their fakes); an id outside [0, E) is refused with a message.

Why: each chosen expert's rows are one contiguous K x N block, which the kernel reads like any other input-major
weight; `embedding_bag` over the same rows ran at ~14 GB/s in small-linear's compiled step (2.3 ms of 15.7), the
kernel's products at ~20 (see docs/benchmarks.md, wave 3 session 10).
"""

from __future__ import annotations

import torch

from kernels.cpu import small_gemm

def runs(x: torch.Tensor, experts: torch.Tensor) -> bool:
    """Whether the kernel takes this batch (see the module docstring)."""
    if not (x.device.type == "cpu" and x.dtype == torch.float32 and experts.dtype in small_gemm.WEIGHT_DTYPES
            and experts.dim() == 3 and experts.is_contiguous()):
        return False
    if torch.is_grad_enabled() and (x.requires_grad or experts.requires_grad):
        return False
    return small_gemm.available()


@torch.library.register_fake("kdamesh_cpu::expert_gemm")
def _(x: torch.Tensor, experts: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], ids.shape[1], experts.shape[2])


@torch.library.register_fake("kdamesh_cpu::expert_gemm_sum")
def _(h: torch.Tensor, experts: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return h.new_empty(h.shape[0], experts.shape[2])


def products(x: torch.Tensor, experts: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """x [T, K] x experts [E, K, N] chosen by ids [T, c] -> [T, c, N]; the caller checked `runs`."""
    return torch.ops.kdamesh_cpu.expert_gemm(x, experts, ids)


def products_sum(h: torch.Tensor, experts: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """h [T, c, K] x experts [E, K, N] chosen by ids [T, c], summed over c -> [T, N]; the caller checked `runs`."""
    return torch.ops.kdamesh_cpu.expert_gemm_sum(h, experts, ids)
