"""Triton KDA decode: one token per sequence against the state pool, updated in place.

Contract: same as `kernels.kda.recurrent.kda_decode_pooled(q, k, v, g, beta, scale, state_pool, state_indices) -> o`:
q, k, g [N, H, K]; v [N, H, V]; beta [N, H]; `state_pool` [S, H, K, V] fp32 (contiguous, updated in place);
`state_indices` [N] int64 (no repeats). The kernel reads and writes the slots through `state_indices` directly; no
other slot is touched. Computes in fp32 (fp16/bf16/fp32 inputs); fp64 inputs are rejected (use the torch backend).

Design: one program per (sequence, head, block of V columns). The delta rule never mixes V columns (u = v - S^T k is
per column), so each program holds a [K, BV] tile of S in registers, applies decay, delta write and readout, and stores
the tile back. K must fit one block (K <= 256 here; the released models use 128).
On CPU it runs only under `TRITON_INTERPRET=1` (tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _kda_decode_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, o_ptr, pool_ptr, idx_ptr, scale,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    vb = tl.program_id(2)
    slot = tl.load(idx_ptr + n).to(tl.int64)
    ok = tl.arange(0, BK)
    ov = vb * BV + tl.arange(0, BV)
    mk = ok < K
    mv = ov < V
    row_k = (n * H + h) * K  # q, k, g are [N, H, K]
    row_v = (n * H + h) * V  # v, o are [N, H, V]
    q = tl.load(q_ptr + row_k + ok, mask=mk, other=0.0).to(tl.float32) * scale  # [BK]
    k = tl.load(k_ptr + row_k + ok, mask=mk, other=0.0).to(tl.float32)  # [BK]
    g = tl.load(g_ptr + row_k + ok, mask=mk, other=0.0).to(tl.float32)  # [BK]
    v = tl.load(v_ptr + row_v + ov, mask=mv, other=0.0).to(tl.float32)  # [BV]
    b = tl.load(beta_ptr + n * H + h).to(tl.float32)
    s_ptrs = pool_ptr + (slot * H + h) * K * V + ok[:, None] * V + ov[None, :]
    s_mask = mk[:, None] & mv[None, :]
    S = tl.load(s_ptrs, mask=s_mask, other=0.0)  # [BK, BV]
    S = S * tl.exp(g)[:, None]
    u = b * (v - tl.sum(k[:, None] * S, axis=0))  # [BV]
    S = S + k[:, None] * u[None, :]
    o = tl.sum(q[:, None] * S, axis=0)  # [BV]
    tl.store(o_ptr + row_v + ov, o.to(o_ptr.dtype.element_ty), mask=mv)
    tl.store(s_ptrs, S, mask=s_mask)


def kda_decode_pooled(q, k, v, g, beta, scale, state_pool, state_indices, state_slots=None):
    """One decode step per sequence in Triton; see the module docstring. Returns o [N, H, V] in v's dtype.
    `state_slots` (the torch op's in-place hint) is not needed: the kernel indexes the pool directly."""
    check_triton_inputs(state_pool, q, k, v, g, beta)
    N, H, K = k.shape
    V = v.shape[-1]
    o = torch.empty(N, H, V, dtype=v.dtype, device=v.device)
    if N == 0:
        return o
    BK = triton.next_power_of_2(K)
    BV = min(64, triton.next_power_of_2(V))
    grid = (N, H, triton.cdiv(V, BV))
    _kda_decode_kernel[grid](
        q.contiguous(), k.contiguous(), v.contiguous(), g.contiguous(), beta.contiguous(), o, state_pool,
        state_indices.to(torch.int64).contiguous(), float(scale), H=H, K=K, V=V, BK=BK, BV=BV,
    )
    return o


def check_triton_inputs(state_pool, q, k, v, g, beta):
    """Rejects what the Triton KDA kernels do not handle: a non-fp32 or strided pool, fp64 activations, K > 256."""
    if state_pool.dtype != torch.float32 or not state_pool.is_contiguous():
        raise ValueError("the Triton KDA kernels need a contiguous fp32 state_pool")
    if any(t.dtype == torch.float64 for t in (q, k, v, g, beta)):
        raise TypeError("the Triton KDA kernels compute in fp32; use the torch backend for fp64 inputs")
    if k.shape[-1] > 256:
        raise ValueError("the Triton KDA kernels support head dims K <= 256")
