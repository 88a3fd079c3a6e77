"""Recurrent (one token at a time) Kimi Delta Attention in torch, vectorised over sequences and heads.

Contract: the math and layouts of `kernels.kda.naive` (S <- S*exp(g); S <- S + beta*k (v - k^T S)^T; o = S^T (scale*q)),
computed in fp32 (fp64 for fp64 inputs), o returned in v's dtype.

- `fused_recurrent_kda(q, k, v, g, beta, scale, initial_state=None, cu_seqlens=None) -> (o, final_state)`: packed
  variable-length batch, a Python loop over time steps (the longest sequence's length), everything else batched.
  Meant for short inputs (decode, speculative verification); long prompts go to `kernels.kda.chunked`.
- On CPU in fp32 where `kernels.kda.cpu_step.runs`, `kda_step`, `kda_decode_pooled` and `kda_verify_rows` step
  the states on that kernel (the same math in two passes over the states, in place on the pool: no gather or scatter); elsewhere the
  torch form below.
- `kda_decode_pooled(q, k, v, g, beta, scale, state_pool, state_indices, state_slots=None) -> o`: one token per
  sequence (q, k, g [N, H, K]; v [N, H, V]; beta [N, H]); sequence n reads its state from
  `state_pool[state_indices[n]]` ([S, H, K, V] fp32) and the updated state is written back to the same slot in
  place. Other slots are untouched. `state_indices` must not repeat. With `state_slots` (a host `slice` equal to
  consecutive `state_indices`, kernels/indexing.py; the engine hands running slots out lowest first) the states are
  stepped in place in the pool, with no gather or scatter copy; without it they are gathered and scattered by
  index. Nothing is read back to the host.
- `kda_verify_pooled(q, k, v, g, beta, scale, state_pool, state_indices [N], cu_seqlens [N+1], out_slots [T]) -> o`
  (speculative verification): sequence n starts from `state_pool[state_indices[n]]`; the state after token t is
  written to `state_pool[out_slots[t]]` when that is >= 0 (-1: not kept). Every state is read before any is
  written (an out-slot may be an in-slot); out-slots must not repeat. Sequences that keep a state before their last
  token, and single tokens, are stepped with `kda_step` (a decode's numerics); the others (prefill chunks in the
  same batch) run in the chunked form (`kernels.kda.chunked.chunk_kda`). With `host=(cu_seqlens, out_slots)` as
  host ints, the Python loops read those and no tensor is read back to the host.
- `kda_verify_rows(q, k, v, g, beta, scale, state_pool, state_indices [N], out_slots [N*Q], tokens_per_row Q)
  -> o [N*Q, H, V]` (a compiled verification step, engine/decode_graphs.py): every sequence verifies Q tokens
  (rows n*Q … n*Q+Q-1), stepped with `kda_step`; the state after each token goes to its out-slot, which must be a
  real slot (the caller points unkept ones at a scratch slot). Every state is read before any is written. No
  Python value depends on the data, so a compiled step traces it as plain ops.
"""

from __future__ import annotations

import torch

from kernels.casting import cast
from kernels.kda import cpu_step
from kernels.kda.naive import compute_dtype, default_cu_seqlens


def kda_step(state, q, k, v, g, beta, scale):
    """One delta-rule step for a batch of states, updating `state` IN PLACE; returns (o [B, H, V], state).

    state [B, H, K, V] (contiguous); q, k, g [B, H, K]; v [B, H, V]; beta [B, H]; all in the compute dtype.
    Decode is bound by passes over the states, so it makes three: one read, for both k^T S' and q^T S' at once from
    the undecayed S (S' = exp(g) ⊙ S, so k^T S' = (k ⊙ exp(g))^T S), then the in-place decay and rank-1 write
    (`mul_`, `baddbmm_`). With u = beta (v - k^T S'), o = q^T (S' + k u^T) = q^T S' + (q·k) u.
    """
    B, H, K, V = state.shape
    if cpu_step.runs(state, q) and state.is_contiguous():  # the CPU kernel: two passes over the states, in place
        return cpu_step.decode_(state, torch.arange(B), q, k, v, g, beta, scale), state
    decay = torch.exp(g)  # [B, H, K]
    flat = state.view(B * H, K, V)
    rows = torch.stack([k * decay, (scale * q) * decay], dim=2).view(B * H, 2, K)  # [BH, 2, K]
    read = torch.bmm(rows, flat).view(B, H, 2, V)  # k^T S', scale q^T S'
    u = beta.unsqueeze(-1) * (v - read[:, :, 0])  # [B, H, V]
    state.mul_(decay.unsqueeze(-1))
    flat.baddbmm_(k.reshape(B * H, K, 1), u.reshape(B * H, 1, V))  # S' += k u^T
    qk = (scale * q * k).sum(-1, keepdim=True)  # [B, H, 1]
    o = torch.addcmul(read[:, :, 1], qk, u)  # [B, H, V]
    return o, state


def fused_recurrent_kda(q, k, v, g, beta, scale, initial_state=None, cu_seqlens=None):
    """KDA over a packed variable-length batch, stepping through time (see the module docstring)."""
    dtype = compute_dtype(q, k, v, g, beta)
    T, H, K = k.shape
    V = v.shape[-1]
    device = q.device
    cu = default_cu_seqlens(cu_seqlens, T, device)
    lens = cu[1:] - cu[:-1]  # [N]
    num_seqs = lens.numel()
    # Longest first, so the sequences still running at step t are a prefix of the order.
    lens_sorted, order = torch.sort(lens, descending=True, stable=True)
    starts = cu[:-1][order]  # [N]
    state = torch.zeros(num_seqs, H, K, V, dtype=dtype, device=device)
    if initial_state is not None:
        state = initial_state[order].to(dtype).clone()
    qc, kc, vc, gc, bc = (x.to(dtype) for x in (q, k, v, g, beta))
    o = torch.zeros(T, H, V, dtype=dtype, device=device)
    num_active = _active_counts(lens_sorted)
    for t, active in enumerate(num_active):
        tok = starts[:active] + t  # [a]
        o[tok], _ = kda_step(state[:active], qc[tok], kc[tok], vc[tok], gc[tok], bc[tok], scale)  # prefix: contiguous
    final = torch.empty_like(state)
    final[order] = state
    return o.to(v.dtype), final


def _active_counts(lens_sorted: torch.Tensor) -> list[int]:
    """For sorted-descending lengths, how many sequences are still running at each time step."""
    if lens_sorted.numel() == 0 or int(lens_sorted[0]) == 0:
        return []
    steps = torch.arange(int(lens_sorted[0]), device=lens_sorted.device)
    return (lens_sorted.unsqueeze(0) > steps.unsqueeze(1)).sum(1).tolist()


def kda_decode_pooled(q, k, v, g, beta, scale, state_pool, state_indices, state_slots=None):
    """One decode token per sequence against a state pool, updated in place; returns o [N, H, V] in v's dtype."""
    dtype = compute_dtype(q, k, v, g, beta, state_pool)
    inputs = [cast(x, dtype) for x in (q, k, v, g, beta)]
    if cpu_step.runs(state_pool, inputs[0]):  # the CPU kernel steps the pool's states in place: no gather, no scatter
        return cast(cpu_step.decode_(state_pool, state_indices, *inputs, scale), v.dtype)
    rows = state_slots
    if rows is not None and state_pool.dtype == dtype and state_pool.is_contiguous():  # consecutive: in place
        o, _ = kda_step(state_pool[rows], *inputs, scale)
        return cast(o, v.dtype)
    idx = state_indices.to(device=state_pool.device, dtype=torch.int64)
    state = cast(state_pool.index_select(0, idx), dtype).contiguous()  # [N, H, K, V], a private copy
    o, state = kda_step(state, *inputs, scale)
    state_pool.index_copy_(0, idx, cast(state, state_pool.dtype))
    return cast(o, v.dtype)



def kda_verify_pooled(q, k, v, g, beta, scale, state_pool, state_indices, cu_seqlens, out_slots, host=None):
    """See the module docstring; returns o [T, H, V] in v's dtype. `host`: `(cu_seqlens, out_slots)` as host int
    sequences (the runner has them), so nothing is read back; None reads the tensors."""
    from kernels.kda.chunked import chunk_kda

    dtype = compute_dtype(q, k, v, g, beta, state_pool)
    device = q.device
    cu, out = host if host is not None else (cu_seqlens.tolist(), out_slots.tolist())
    init = state_pool.index_select(0, state_indices.to(device=state_pool.device, dtype=torch.int64)).to(dtype)
    stepped = [n for n in range(len(cu) - 1)
               if cu[n + 1] - cu[n] == 1 or any(s >= 0 for s in out[cu[n]: cu[n + 1] - 1])]
    chunked = [n for n in range(len(cu) - 1) if cu[n + 1] > cu[n] and n not in set(stepped)]
    o = torch.empty(v.shape, dtype=dtype, device=device)  # [T, H, V]
    writes: list[tuple[int, torch.Tensor]] = []
    if chunked:
        rows = torch.cat([torch.arange(cu[n], cu[n + 1], device=device) for n in chunked])
        lens = torch.tensor([cu[n + 1] - cu[n] for n in chunked], dtype=torch.int64, device=device)
        sub_cu = torch.cat([lens.new_zeros(1), lens.cumsum(0)])
        o_c, final = chunk_kda(q[rows], k[rows], v[rows], g[rows], beta[rows], scale, init[chunked], sub_cu)
        o[rows] = o_c.to(dtype)
        writes.extend((out[cu[n + 1] - 1], final[i]) for i, n in enumerate(chunked) if out[cu[n + 1] - 1] >= 0)
    if stepped:  # `init` holds copies of every in-slot's state: kept states go straight into the pool
        _step_keeping(q, k, v, g, beta, scale, init, cu, out, stepped, o, dtype, state_pool)
    if writes:
        slots = torch.tensor([s for s, _ in writes], dtype=torch.int64, device=state_pool.device)
        state_pool.index_copy_(0, slots, torch.stack([s for _, s in writes]).to(state_pool.dtype))
    return o.to(v.dtype)


def _step_keeping(q, k, v, g, beta, scale, init, cu, out, seqs, o, dtype, state_pool):
    """Steps sequences `seqs` token by token from `init`, filling `o` and copying the state after each kept token
    into its out-slot of `state_pool` (one copy per kept state: no clone, stack and scatter)."""
    order = sorted(seqs, key=lambda n: cu[n] - cu[n + 1])  # longest first: the running ones are a prefix
    state = init[order].clone()  # [B, H, K, V]
    starts = torch.tensor([cu[n] for n in order], dtype=torch.int64, device=q.device)
    lens = [cu[n + 1] - cu[n] for n in order]
    inputs = [x.to(dtype) for x in (q, k, v, g, beta)]
    for t in range(lens[0]):
        active = sum(1 for n in lens if n > t)
        tok = starts[:active] + t  # [a]
        o[tok], _ = kda_step(state[:active], *(x[tok] for x in inputs), scale)
        for i in range(active):
            slot = out[cu[order[i]] + t]
            if slot >= 0:
                state_pool[slot].copy_(state[i])


def kda_verify_rows(q, k, v, g, beta, scale, state_pool, state_indices, out_slots, tokens_per_row: int):
    """See the module docstring; returns o [N*Q, H, V] in v's dtype."""
    dtype = compute_dtype(q, k, v, g, beta, state_pool)
    if cpu_step.runs(state_pool, cast(q, dtype)):  # the CPU kernel: each state read once, each out-state written once
        inputs = [cast(x, dtype) for x in (q, k, v, g, beta)]
        return cast(cpu_step.verify_(state_pool, state_indices, out_slots, *inputs, scale), v.dtype)
    T, H = q.shape[:2]
    n = T // tokens_per_row
    idx = state_indices.to(device=state_pool.device, dtype=torch.int64)
    state = cast(state_pool.index_select(0, idx), dtype).contiguous()  # [N, H, K, V], a private copy
    rows = [cast(x, dtype).view(n, tokens_per_row, *x.shape[1:]) for x in (q, k, v, g, beta)]
    slots = out_slots.to(device=state_pool.device, dtype=torch.int64).view(n, tokens_per_row)
    outs = []
    for t in range(tokens_per_row):
        o, state = kda_step(state, *(x[:, t] for x in rows), scale)  # [N, H, V]
        state_pool.index_copy_(0, slots[:, t], cast(state, state_pool.dtype))
        outs.append(o)
    return cast(torch.stack(outs, dim=1).view(T, H, -1), v.dtype)
