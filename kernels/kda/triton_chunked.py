"""Triton KDA prefill in the chunkwise (WY / UT-transform) form, reading and writing the state pool in place.

Contract: same as `kernels.kda.chunked.kda_prefill_pooled(q, k, v, g, beta, scale, cu_seqlens, state_pool,
state_indices) -> o`: q, k, g [T, H, K]; v [T, H, V]; beta [T, H]; `cu_seqlens` [N+1] int64; `state_pool`
[S, H, K, V] fp32 (contiguous); sequence n starts from slot `state_indices[n]` and its final state is stored back there.
Computes in fp32 (fp16/bf16/fp32 inputs; fp64 is rejected — use the torch backend); o in v's dtype.

Design (correctness first, deliberately simple): one program per (sequence, head, block of BV value columns) — the
delta rule never mixes V columns — walking its sequence chunk by chunk (`_CHUNK` tokens, the tail masked) with the
[K, BV] state tile in registers. Per chunk:
  1. scores A[i, j] = sum_k k_i k_j exp(G_i - G_j) (j < i) and Aqk (j <= i), one column j at a time; the exponent is a
     fresh masked cumsum of g over (j, i], so it is always <= 0 and never suffers cancellation;
  2. the unit lower triangular inverse X = (I + diag(beta) A)^-1 by forward substitution, one row at a time;
  3. W = X (beta k exp(G)), U = X (beta v) - W S, o = (scale q exp(G)) S + scale Aqk U,
     S <- exp(G_last) S + (k exp(G_last - G))^T U, with tl.dot in IEEE fp32 (no TF32).
Steps 1–2 cost O(C^2 K) and O(C^3) per chunk in register-level loops and are recomputed by every V block; a
production kernel would split them into separate, tensor-core kernels as flash-linear-attention does. K must fit one
block (K <= 256). On CPU it runs only under `TRITON_INTERPRET=1` (tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.kda.triton_recurrent import check_triton_inputs

_CHUNK = 32  # tokens per chunk (>= 16 for tl.dot)


@triton.jit
def _decayed_scores(q, k, g, beta, ot, scale, BT: tl.constexpr):
    """Step 1 for one chunk (q, k, g [BT, BK] fp32, beta [BT], ot = arange(BT)), column by column.

    Returns (M [BT, BT]: the strictly lower part of I + diag(beta) A, scale * Aqk [BT, BT]: lower, with diagonal)."""
    A = tl.zeros([BT, BT], dtype=tl.float32)
    Aqk = tl.zeros([BT, BT], dtype=tl.float32)
    for j in range(BT):
        k_j = tl.sum(tl.where(ot[:, None] == j, k, 0.0), axis=0)  # [BK]
        since_j = tl.cumsum(tl.where(ot[:, None] > j, g, 0.0), axis=0)  # [BT, BK] sum of g over (j, i]
        decayed = tl.where(ot[:, None] >= j, tl.exp(since_j), 0.0) * k_j[None, :]
        A = tl.where(ot[None, :] == j, tl.sum(k * decayed, axis=1)[:, None], A)
        Aqk = tl.where(ot[None, :] == j, tl.sum(q * decayed, axis=1)[:, None], Aqk)
    M = tl.where(ot[:, None] > ot[None, :], A, 0.0) * beta[:, None]
    return M, tl.where(ot[:, None] >= ot[None, :], Aqk, 0.0) * scale


@triton.jit
def _unit_lower_inverse(M, ot, BT: tl.constexpr):
    """Step 2: X = (I + M)^-1 for a strictly lower M [BT, BT], row i = e_i - sum_{j<i} M[i, j] X[j, :]."""
    X = tl.where(ot[:, None] == ot[None, :], 1.0, 0.0)
    for i in range(1, BT):
        m_i = tl.sum(tl.where(ot[:, None] == i, M, 0.0), axis=0)  # [BT], zero from column i on
        x_i = tl.where(ot == i, 1.0, 0.0) - tl.sum(m_i[:, None] * X, axis=0)
        X = tl.where(ot[:, None] == i, x_i[None, :], X)
    return X


@triton.jit
def _kda_prefill_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, o_ptr, pool_ptr, idx_ptr, cu_ptr, scale,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
):
    n = tl.program_id(0)
    h = tl.program_id(1)
    vb = tl.program_id(2)
    bos = tl.load(cu_ptr + n).to(tl.int64)
    eos = tl.load(cu_ptr + n + 1).to(tl.int64)
    slot = tl.load(idx_ptr + n).to(tl.int64)
    ot = tl.arange(0, BT)
    ok = tl.arange(0, BK)
    ov = vb * BV + tl.arange(0, BV)
    mk = ok < K
    mv = ov < V
    s_ptrs = pool_ptr + (slot * H + h) * K * V + ok[:, None] * V + ov[None, :]
    s_mask = mk[:, None] & mv[None, :]
    S = tl.load(s_ptrs, mask=s_mask, other=0.0)  # [BK, BV] fp32
    for start in range(bos, eos, BT):
        rows = start + ot  # [BT] token indices
        mt = rows < eos
        k_off = (rows[:, None] * H + h) * K + ok[None, :]  # [BT, BK]
        v_off = (rows[:, None] * H + h) * V + ov[None, :]  # [BT, BV]
        m_tk = mt[:, None] & mk[None, :]
        m_tv = mt[:, None] & mv[None, :]
        q = tl.load(q_ptr + k_off, mask=m_tk, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + k_off, mask=m_tk, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + k_off, mask=m_tk, other=0.0).to(tl.float32)  # padding: no decay
        v = tl.load(v_ptr + v_off, mask=m_tv, other=0.0).to(tl.float32)
        beta = tl.load(beta_ptr + rows * H + h, mask=mt, other=0.0).to(tl.float32)  # padding: writes nothing

        M, Aqk = _decayed_scores(q, k, g, beta, ot, scale, BT)  # 1.
        X = _unit_lower_inverse(M, ot, BT)  # 2.
        # 3. chunk output and state update
        G = tl.cumsum(g, axis=0)  # [BT, BK], <= 0
        to_end = tl.cumsum(g, axis=0, reverse=True) - g  # sum of g over (i, end]
        g_total = tl.sum(g, axis=0)  # [BK]
        w = tl.dot(X, beta[:, None] * k * tl.exp(G), input_precision="ieee")  # [BT, BK]
        u = tl.dot(X, beta[:, None] * v, input_precision="ieee")  # [BT, BV]
        u = u - tl.dot(w, S, input_precision="ieee")
        o = tl.dot(q * tl.exp(G) * scale, S, input_precision="ieee") + tl.dot(Aqk, u, input_precision="ieee")
        tl.store(o_ptr + v_off, o.to(o_ptr.dtype.element_ty), mask=m_tv)
        k_end = k * tl.exp(to_end)  # [BT, BK]
        S = S * tl.exp(g_total)[:, None] + tl.dot(tl.trans(k_end), u, input_precision="ieee")
    tl.store(s_ptrs, S, mask=s_mask)


def kda_prefill_pooled(q, k, v, g, beta, scale, cu_seqlens, state_pool, state_indices):
    """Chunked KDA prefill in Triton; see the module docstring. Returns o [T, H, V] in v's dtype."""
    check_triton_inputs(state_pool, q, k, v, g, beta)
    T, H, K = k.shape
    V = v.shape[-1]
    o = torch.empty(T, H, V, dtype=v.dtype, device=v.device)
    if cu_seqlens is None:
        cu_seqlens = torch.tensor([0, T], dtype=torch.int64, device=q.device)
    N = cu_seqlens.numel() - 1
    if N == 0:
        return o
    BK = max(16, triton.next_power_of_2(K))
    BV = max(16, min(64, triton.next_power_of_2(V)))
    grid = (N, H, triton.cdiv(V, BV))
    _kda_prefill_kernel[grid](
        q.contiguous(), k.contiguous(), v.contiguous(), g.contiguous(), beta.contiguous(), o, state_pool,
        state_indices.to(torch.int64).contiguous(), cu_seqlens.to(torch.int64).contiguous(), float(scale),
        H=H, K=K, V=V, BT=_CHUNK, BK=BK, BV=BV,
    )
    return o
