"""The KDA decode step on CPU through a kernel of our own (kernels/cpu/kda_step.c), in place on the state pool.

Contract:
- `runs(state_pool, q)`: whether `decode_` can take a step — the CPU kernels `available` (built, see
  kernels/cpu/small_gemm.py), a contiguous fp32 pool `[S, H, K, V]` on CPU with V a multiple of 16, fp32 inputs, no
  autograd.
- `decode_(state_pool, state_indices [N], q, k, g [N, H, K], v [N, H, V], beta [N, H], scale) -> o [N, H, V]`:
  `kernels.kda.recurrent.kda_step`'s math for the states `state_pool[state_indices[n]]`, stepped in place (indices
  distinct, in range: out-of-range ones are refused with a message). Equal to the torch form within fp32
  rounding; a sequence's result does not depend on the others in the call (bitwise). It calls the operator
  `torch.ops.kdamesh_cpu.kda_decode_`, eagerly and from a compiled step (which sees one in-place op on the pool:
  no gather, no scatter, no functionalised copy — tests/unit/kernels/test_kda_cpu_step.py).
- `verify_(state_pool, state_indices [N], out_slots [T], q, k, g [T, H, K], v [T, H, V], beta [T, H], scale) -> o
  [T, H, V]` (`kernels.kda.recurrent.kda_verify_rows`' contract): sequence n steps its Q = T // N tokens from
  `state_pool[state_indices[n]]`, the state after each token written to its out-slot; every in-state is read before
  any out-slot is written; each (sequence, head) steps its Q tokens in a private copy kept in L1/L2, so the pool is
  read once and written once per token (the torch form also gathered, cloned and scattered every token).

Why: the torch form makes five passes over the states (gather, exp-and-read, decay, rank-1 write, scatter); a
state is 12 x 128 x 128 fp32 (768 KB) per small-linear layer, so they cost ~1.6 of ~13 ms in small-linear's
compiled batch-1 step. The kernel makes two, the second from L2 (docs/benchmarks.md, wave 3 session 11).
"""

from __future__ import annotations

import torch

from kernels.cpu import small_gemm

VALUE_MULTIPLE = 16  # the kernel's value width unit (one AVX-512 vector; two AVX2 ones)


def runs(state_pool: torch.Tensor, q: torch.Tensor) -> bool:
    """Whether the kernel takes this step (see the module docstring)."""
    if not (state_pool.device.type == "cpu" and state_pool.dtype == torch.float32 and state_pool.dim() == 4
            and state_pool.shape[-1] % VALUE_MULTIPLE == 0 and q.dtype == torch.float32):
        return False
    if torch.is_grad_enabled() and (state_pool.requires_grad or q.requires_grad):
        return False
    return state_pool.is_contiguous() and small_gemm.available()


@torch.library.register_fake("kdamesh_cpu::kda_decode_")
def _(state_pool, state_indices, q, k, v, g, beta, scale):
    return v.new_empty(v.shape)


@torch.library.register_fake("kdamesh_cpu::kda_verify_")
def _(state_pool, in_idx, out_slots, q, k, v, g, beta, scale):
    return v.new_empty(v.shape)


def verify_(state_pool: torch.Tensor, state_indices: torch.Tensor, out_slots: torch.Tensor, q: torch.Tensor,
            k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, scale: float) -> torch.Tensor:
    """N sequences of Q = T // N tokens each from `state_pool[state_indices]`; the state after token t of sequence n
    goes to `state_pool[out_slots[n*Q + t]]` -> o [T, H, V]; the caller checked `runs`."""
    return torch.ops.kdamesh_cpu.kda_verify_(state_pool, state_indices.to(dtype=torch.int64),
                                             out_slots.to(dtype=torch.int64), q, k, v, g, beta, float(scale))


def decode_(state_pool: torch.Tensor, state_indices: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
            v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, scale: float) -> torch.Tensor:
    """Steps `state_pool[state_indices]` in place -> o [N, H, V]; the caller checked `runs`."""
    idx = state_indices.to(dtype=torch.int64)
    return torch.ops.kdamesh_cpu.kda_decode_(state_pool, idx, q, k, v, g, beta, float(scale))
