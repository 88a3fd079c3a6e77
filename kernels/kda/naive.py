"""Token-by-token Kimi Delta Attention: the readable oracle every faster KDA backend is tested against.

Contract (per sequence and head; the state S is [K, V] and kept in fp32, or fp64 when the inputs are fp64):

    S <- S * exp(g_t)[:, None]                 # per-key-channel decay
    u  = v_t - S^T k_t                         # what the state mispredicts for k_t
    S <- S + beta_t * outer(k_t, u)            # delta-rule write
    o_t = S^T (scale * q_t)

q and k arrive already L2-normalised; g (log-decay, <= 0) and beta arrive precomputed. Tensors are packed
variable-length batches: q, k [T, H, K]; v [T, H, V]; g [T, H, K]; beta [T, H]; `cu_seqlens` [N+1] (None: one
sequence of length T); `initial_state` [N, H, K, V] or None (zeros).
Returns (o [T, H, V] in v's dtype, final_state [N, H, K, V]).
"""

from __future__ import annotations

import torch


def compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """fp64 when any input is fp64, else fp32: the precision every KDA backend accumulates in."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def default_cu_seqlens(cu_seqlens: torch.Tensor | None, total: int, device: torch.device) -> torch.Tensor:
    """`cu_seqlens` as an int64 tensor; None means one sequence covering all `total` tokens."""
    if cu_seqlens is None:
        return torch.tensor([0, total], dtype=torch.int64, device=device)
    return cu_seqlens.to(device=device, dtype=torch.int64)


def kda_naive(q, k, v, g, beta, scale, initial_state=None, cu_seqlens=None):
    """Reference KDA over a packed batch, one token at a time (see the module docstring)."""
    dtype = compute_dtype(q, k, v, g, beta)
    T, H, K = k.shape
    V = v.shape[-1]
    cu = default_cu_seqlens(cu_seqlens, T, q.device).tolist()
    num_seqs = len(cu) - 1
    o = torch.zeros(T, H, V, dtype=dtype, device=q.device)
    final = torch.zeros(num_seqs, H, K, V, dtype=dtype, device=q.device)
    for n in range(num_seqs):
        S = torch.zeros(H, K, V, dtype=dtype, device=q.device)  # [H, K, V]
        if initial_state is not None:
            S = initial_state[n].to(dtype).clone()
        for t in range(cu[n], cu[n + 1]):
            q_t, k_t, v_t, g_t = (x[t].to(dtype) for x in (q, k, v, g))  # [H, K] / [H, V]
            b_t = beta[t].to(dtype)  # [H]
            S = S * torch.exp(g_t)[:, :, None]
            u = v_t - torch.einsum("hk,hkv->hv", k_t, S)  # [H, V]
            S = S + b_t[:, None, None] * k_t[:, :, None] * u[:, None, :]
            o[t] = torch.einsum("hk,hkv->hv", scale * q_t, S)
        final[n] = S
    return o.to(v.dtype), final


def kda_verify_naive(q, k, v, g, beta, scale, state_pool, state_indices, cu_seqlens, out_slots):
    """Oracle of the `kda_verify` op: sequence n starts from `state_pool[state_indices[n]]`; the state after token
    t is written to `state_pool[out_slots[t]]` when that is >= 0 (all reads before any write). Returns o."""
    cu = default_cu_seqlens(cu_seqlens, k.shape[0], q.device).tolist()
    outs, writes = [], []
    for n in range(len(cu) - 1):
        state = state_pool[int(state_indices[n])].unsqueeze(0)  # [1, H, K, V]
        for t in range(cu[n], cu[n + 1]):
            o, state = kda_naive(q[t: t + 1], k[t: t + 1], v[t: t + 1], g[t: t + 1], beta[t: t + 1], scale, state)
            outs.append(o)
            if int(out_slots[t]) >= 0:
                writes.append((int(out_slots[t]), state[0]))
    for slot, state in writes:
        state_pool[slot] = state.to(state_pool.dtype)
    return torch.cat(outs) if outs else v.new_zeros(0, *v.shape[1:])
