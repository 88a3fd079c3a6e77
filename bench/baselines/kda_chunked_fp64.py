"""The previous chunked KDA (fp64 exponents, [H, B, ...] layout, per-chunk state pass), kept only as the "before"
column of `bench/bench_kda.py`; `kernels.kda.chunked` is the implementation in use.

Chunkwise-parallel Kimi Delta Attention in torch (the WY / UT-transform form).

Contract: the math and layouts of `kernels.kda.naive`, computed in fp32 (fp64 for fp64 inputs), o in v's dtype.

- `chunk_kda(q, k, v, g, beta, scale, initial_state=None, cu_seqlens=None, chunk_size=64) -> (o, final_state)`
- `kda_prefill_pooled(q, k, v, g, beta, scale, cu_seqlens, state_pool, state_indices) -> o`: sequence n starts from
  `state_pool[state_indices[n]]` ([S, H, K, V] fp32) and its final state is written back to that slot in place; no
  other slot is read or written. `state_indices` must not repeat.

Algorithm, per sequence and head, for a chunk of C tokens starting from state S0 (positions i, j in the chunk,
G_i = cumsum of g up to and including i, relative to the chunk start, so G is non-increasing and <= 0):

    A[i, j]   = sum_k k_i k_j exp(G_i - G_j)             (j < i)      k-k scores with relative decay
    Aqk[i, j] = scale * sum_k q_i k_j exp(G_i - G_j)     (j <= i)
    (I + diag(beta) A) [W | U0] = [beta * k * exp(G) | beta * v]     (blocked unit lower triangular inverse)
    U   = U0 - W S0                                      the delta-rule "new values" of the chunk
    o   = scale * (q * exp(G)) S0 + Aqk U
    S1  = exp(G_last) * S0 + (k * exp(G_last - G))^T U

Numerics: every exponent is a difference G_i - G_j with i >= j (or G itself), so each exp() factor is <= 1 and nothing
overflows however negative the gate is. The exponent arguments are formed in fp64 from an fp64 cumsum, so a strongly
decayed channel does not lose the small relative decays that follow it. A chunk's score matrix is built from
sub-blocks of `_SUB` tokens: blocks below the diagonal factor exp(G_i - G_j) = exp(G_i - R) exp(R - G_j) around R, the
decay at the end of the column block (both factors <= 1), so they are plain matmuls; diagonal blocks use the same
factorisation around the block start when the block's total decay is small enough for exp(+x) to be finite (the usual
case), and otherwise an exact masked [sub, sub, K] tensor.

Batching: sequences are cut into chunks; a sequence's last chunk is padded with beta = 0 (its new value is zero, so it
writes nothing) and g = 0 (it decays nothing). All state-independent work (scores, the triangular inverse, and
U0, W) runs batched over many chunks, heads and sequences; only the state pass (three small matmuls per chunk) loops,
once per chunk index, over all sequences that still have that chunk (longest first, so they are a prefix).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.kda.naive import compute_dtype, default_cu_seqlens

_SUB = 16  # sub-block size of the intra-chunk score matrix
_GROUP_ELEMENTS = 1 << 26  # rough element budget of one batch of chunks in the state-independent phase
# Max decay inside a diagonal sub-block for the factored form: exp(+limit) * K must stay finite and exp(-limit) normal.
_FACTORED_LIMIT = {torch.float32: 80.0, torch.float64: 600.0}
_EXP_FLOOR = {torch.float32: -80.0, torch.float64: -700.0}  # exp(floor) is still a normal number


@dataclass(frozen=True)
class ChunkPlan:
    """How a packed batch is cut into chunks, ordered step-major: all first chunks, then all second chunks, ...

    Sequences are sorted longest first (`order`), so the sequences that have a chunk at step c are the first
    `active[c]` of that order and their chunks are the contiguous rows `offsets[c] : offsets[c] + active[c]`.
    """

    order: torch.Tensor  # [N] sequence index for each sorted position
    tokens: torch.Tensor  # [num_chunks, C] token index per chunk row; T marks padding
    active: list[int]  # [num_steps]
    offsets: list[int]  # [num_steps]


def plan_chunks(cu_seqlens: torch.Tensor, total: int, chunk_size: int) -> ChunkPlan:
    """Builds the step-major chunk table for a packed batch (see `ChunkPlan`)."""
    lens = cu_seqlens[1:] - cu_seqlens[:-1]  # [N]
    num_chunks = (lens + chunk_size - 1) // chunk_size  # [N]
    chunks_sorted, order = torch.sort(num_chunks, descending=True, stable=True)
    max_steps = int(chunks_sorted[0]) if chunks_sorted.numel() else 0
    steps = torch.arange(max_steps, device=lens.device)
    has_chunk = chunks_sorted.unsqueeze(0) > steps.unsqueeze(1)  # [steps, N]
    step_of, seq_of = has_chunk.nonzero(as_tuple=True)  # row-major: step-major, sorted sequences within a step
    start = cu_seqlens[:-1][order][seq_of] + step_of * chunk_size  # [num_chunks]
    length = (lens[order][seq_of] - step_of * chunk_size).clamp(max=chunk_size)  # [num_chunks]
    pos = torch.arange(chunk_size, device=lens.device)
    tokens = torch.where(pos < length.unsqueeze(1), start.unsqueeze(1) + pos, total)  # [num_chunks, C]
    active = has_chunk.sum(1).tolist()
    offsets = [0] * max_steps
    for c in range(1, max_steps):
        offsets[c] = offsets[c - 1] + active[c - 1]
    return ChunkPlan(order=order, tokens=tokens, active=active, offsets=offsets)


def chunk_kda(q, k, v, g, beta, scale, initial_state=None, cu_seqlens=None, chunk_size=64):
    """KDA over a packed variable-length batch in the chunkwise WY form (see the module docstring)."""
    dtype = compute_dtype(q, k, v, g, beta)
    T, H, K = k.shape
    V = v.shape[-1]
    device = q.device
    if chunk_size % _SUB and chunk_size > _SUB:
        raise ValueError(f"chunk_size must be <= {_SUB} or a multiple of it, got {chunk_size}")
    cu = default_cu_seqlens(cu_seqlens, T, device)
    plan = plan_chunks(cu, T, chunk_size)
    num_seqs = cu.numel() - 1
    # Heads lead everywhere below ([H, ...]): a batch's gather lands directly in matmul-ready layout.
    state = torch.zeros(H, num_seqs, K, V, dtype=dtype, device=device)  # [H, N, K, V], sorted sequence order
    if initial_state is not None:
        state = initial_state[plan.order].to(dtype).transpose(0, 1).contiguous()
    heads_first = [x.transpose(0, 1) for x in (q, k, v, g, beta)]  # views [H, T, *]; no copy of the whole input
    o = torch.zeros(H, T + 1, V, dtype=dtype, device=device)  # [H, T+1, V]; column T collects padding
    group = max(1, _GROUP_ELEMENTS // (H * chunk_size * (K + V) * 8))
    for batch in _batches(_units(plan, group), group):
        first = batch[0][0]
        rows = plan.tokens[first : batch[-1][1]]  # [B, C]
        prep = _prepare(*_gather_chunks(rows, T, *heads_first, dtype), scale=scale)
        o_rows = torch.empty(H, rows.shape[0], chunk_size, V, dtype=dtype, device=device)  # [H, B, C, V]
        for lo, hi, seq_lo in batch:
            chunks = slice(lo - first, hi - first)
            seqs = slice(seq_lo, seq_lo + hi - lo)
            o_rows[:, chunks], state[:, seqs] = _state_pass(prep, chunks, state[:, seqs])
        o[:, rows] = o_rows
    final = torch.empty(num_seqs, H, K, V, dtype=dtype, device=device)
    final[plan.order] = state.transpose(0, 1)
    return o[:, :T].transpose(0, 1).to(v.dtype).contiguous(), final


def kda_prefill_pooled(q, k, v, g, beta, scale, cu_seqlens, state_pool, state_indices):
    """Chunked KDA whose initial and final states live in `state_pool` slots (see the module docstring)."""
    idx = state_indices.to(device=state_pool.device, dtype=torch.int64)
    o, final = chunk_kda(q, k, v, g, beta, scale, state_pool.index_select(0, idx), cu_seqlens)
    state_pool.index_copy_(0, idx, final.to(state_pool.dtype))
    return o


def _gather_chunks(rows, total, q, k, v, g, beta, dtype):
    """Token rows [B, C] (padding marked `total`) of [H, T, *] inputs -> q, k, v, g, beta as [H, B, C, *].

    g comes back in fp64 (exponents are formed from its cumsum). Padding gets beta = 0 (its new value is zero, so it
    writes nothing) and g = 0 (it decays nothing); its q, k, v are copies of a real token, and its outputs are dropped.
    """
    valid = rows < total  # [B, C]
    idx = rows.clamp(max=total - 1)
    beta_c = beta[:, idx].to(dtype) * valid  # [H, B, C]
    g_c = (g[:, idx] * valid.unsqueeze(-1)).to(torch.float64)  # [H, B, C, K]
    return q[:, idx].to(dtype), k[:, idx].to(dtype), v[:, idx].to(dtype), g_c, beta_c


def _units(plan: ChunkPlan, group: int) -> list[tuple[int, int, int]]:
    """Work units (chunk_lo, chunk_hi, first sorted sequence): one step's chunks, at most `group` at a time."""
    units = []
    for offset, active in zip(plan.offsets, plan.active):
        for lo in range(0, active, group):
            units.append((offset + lo, offset + min(active, lo + group), lo))
    return units


def _batches(units: list[tuple[int, int, int]], group: int) -> list[list[tuple[int, int, int]]]:
    """Consecutive units merged while their chunks (a contiguous range of chunk rows) stay within `group`."""
    batches: list[list[tuple[int, int, int]]] = []
    for unit in units:
        if batches and unit[1] - batches[-1][0][0] <= group:
            batches[-1].append(unit)
        else:
            batches.append([unit])
    return batches


@dataclass(frozen=True)
class _Prepared:
    """State-independent per-chunk tensors, [H, B, *, *] (see the module docstring for the formulas)."""

    lhs: torch.Tensor  # [H, B, 2C, K] rows: W; Q = scale * q * exp(G) (one matmul with S for both)
    u0: torch.Tensor  # [H, B, C, V] U0
    scores_qk: torch.Tensor  # [H, B, C, C] scale * Aqk
    k_to_end: torch.Tensor  # [H, B, K, C] (k * exp(G_last - G))^T
    decay_end: torch.Tensor  # [H, B, K, 1] exp(G_last)


def _prepare(q, k, v, g, beta, scale) -> _Prepared:
    """The state-independent part of a batch of chunks. q, k: [H, B, C, K]; v: [H, B, C, V]; g: [H, B, C, K] fp64;
    beta: [H, B, C]."""
    dtype = q.dtype
    beta = beta.unsqueeze(-1)  # [H, B, C, 1]
    gc = g.cumsum(-2)  # [H, B, C, K] fp64
    g_last = gc[..., -1:, :]  # [H, B, 1, K]
    decay = _exp(gc, dtype)  # [H, B, C, K] exp(G) <= 1
    scores_kk, scores_qk = intra_chunk_scores(q, k, gc, _SUB)
    scores_qk = scale * scores_qk
    inverse = unit_lower_inverse(scores_kk * beta, _SUB)  # (I + diag(beta) A)^-1
    w = inverse @ (beta * k * decay)  # [H, B, C, K]
    u0 = inverse @ (beta * v)  # [H, B, C, V]
    return _Prepared(
        lhs=torch.cat([w, scale * q * decay], dim=-2),
        u0=u0,
        scores_qk=scores_qk,
        k_to_end=(k * _exp(g_last - gc, dtype)).transpose(-1, -2),
        decay_end=_exp(g_last, dtype).transpose(-1, -2),
    )


def _state_pass(prep: _Prepared, chunks: slice, state: torch.Tensor):
    """Applies one chunk per sequence to `state` [H, n, K, V]; returns (o [H, n, C, V], new state)."""
    ws, qs = (prep.lhs[:, chunks] @ state).chunk(2, dim=-2)  # [H, n, C, V] each
    u = prep.u0[:, chunks] - ws
    o = qs + prep.scores_qk[:, chunks] @ u
    state = prep.decay_end[:, chunks] * state + prep.k_to_end[:, chunks] @ u
    return o, state


def unit_lower_inverse(lower: torch.Tensor, sub: int) -> torch.Tensor:
    """(I + L)^-1 for strictly lower triangular L [..., C, C] (the diagonal of `lower` is ignored).

    Blocked: the [sub, sub] diagonal blocks are inverted by one batched triangular solve, then block row i of the
    inverse is -X_ii * sum_{m < i} L_im X_m,: (plain matmuls), which is much faster than one large batched solve.
    """
    C = lower.shape[-1]
    sub = min(sub, C)
    nb = C // sub
    blocks = [slice(b * sub, (b + 1) * sub) for b in range(nb)]
    diag = torch.stack([lower[..., blk, blk] for blk in blocks], dim=-3)  # [..., nb, sub, sub]
    eye = torch.eye(sub, dtype=lower.dtype, device=lower.device).expand(diag.shape)
    diag_inv = torch.linalg.solve_triangular(diag, eye, upper=False, unitriangular=True)
    inverse = torch.zeros_like(lower)
    for b, blk in enumerate(blocks):
        inverse[..., blk, blk] = diag_inv[..., b, :, :]
    for i in range(1, nb):
        done = slice(0, i * sub)
        below = lower[..., blocks[i], done] @ inverse[..., done, done]  # [..., sub, i*sub]
        inverse[..., blocks[i], done] = -(diag_inv[..., i, :, :] @ below)
    return inverse


def _exp(x64: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """exp of an fp64 exponent x <= 0, in the compute dtype.

    Rounding x first costs a relative error eps*|x| in the result, i.e. an absolute error <= eps/e, and the product of
    two such factors keeps that bound; so this is only for factors <= 1 (see `_diagonal_block_scores` for the others).
    x is floored at `_EXP_FLOOR` (an absolute error below 1e-34): results in the subnormal range make CPU exp and the
    products that follow an order of magnitude slower.
    """
    return x64.to(dtype).clamp(min=_EXP_FLOOR[dtype]).exp_()  # clamp makes a new tensor: x64 stays intact


def intra_chunk_scores(q, k, gc, sub):
    """Decayed score matrices of a batch of chunks.

    q, k: [..., C, K] (compute dtype); gc: [..., C, K] fp64 in-chunk cumulative log-decay.
    Returns (A [..., C, C] strictly lower: sum_k k_i k_j exp(gc_i - gc_j),
             Aqk [..., C, C] lower incl. diagonal: sum_k q_i k_j exp(gc_i - gc_j)), unscaled.
    """
    *lead, C, K = k.shape
    sub = min(sub, C)
    nb = C // sub
    dtype = k.dtype
    a_kk = k.new_zeros(*lead, C, C)
    a_qk = k.new_zeros(*lead, C, C)
    # Diagonal blocks, relative to the decay at the end of the previous block.
    ends = gc[..., sub - 1 :: sub, :]  # [..., nb, K]
    prev = torch.cat([torch.zeros_like(ends[..., :1, :]), ends[..., :-1, :]], dim=-2)
    local = gc.unflatten(-2, (nb, sub)) - prev.unsqueeze(-2)  # [..., nb, sub, K] fp64, <= 0
    d_kk, d_qk = _diagonal_block_scores(q.unflatten(-2, (nb, sub)), k.unflatten(-2, (nb, sub)), local, dtype)
    for b in range(nb):
        blk = slice(b * sub, (b + 1) * sub)
        a_kk[..., blk, blk] = d_kk[..., b, :, :]
        a_qk[..., blk, blk] = d_qk[..., b, :, :]
    # Blocks below the diagonal, column block by column block, factored around the column block's last decay.
    for s in range(nb - 1):
        cols = slice(s * sub, (s + 1) * sub)
        rows = slice((s + 1) * sub, C)
        ref = gc[..., (s + 1) * sub - 1 : (s + 1) * sub, :]  # [..., 1, K]
        right = (k[..., cols, :] * _exp(ref - gc[..., cols, :], dtype)).transpose(-1, -2)  # [..., K, sub]
        to_row = _exp(gc[..., rows, :] - ref, dtype)  # [..., rows, K]
        a_kk[..., rows, cols] = (k[..., rows, :] * to_row) @ right
        a_qk[..., rows, cols] = (q[..., rows, :] * to_row) @ right
    return a_kk.tril(-1), a_qk.tril(0)


def _diagonal_block_scores(qb, kb, local, dtype):
    """Scores inside each sub-block. qb, kb: [..., sub, K]; local: [..., sub, K] fp64 decay (<= 0) from the block start.

    Returns ([..., sub, sub] k-k, [..., sub, sub] q-k) with entries above the diagonal undefined (finite).
    """
    span = float(-local.min()) if local.numel() else 0.0  # largest decay inside any block
    if span <= _FACTORED_LIMIT[dtype]:
        # exp in fp64: the two factors are large and small, and only exact-ish factors give an exact product.
        decay = torch.exp(local)  # fp64
        to_row = decay.to(dtype)  # <= 1
        from_col = (kb * decay.reciprocal().to(dtype)).transpose(-1, -2)  # <= exp(limit)
        return (kb * to_row) @ from_col, (qb * to_row) @ from_col
    sub = local.shape[-2]
    tril = torch.ones(sub, sub, dtype=torch.bool, device=local.device).tril().unsqueeze(-1)  # [sub, sub, 1]
    diff = (local.unsqueeze(-2) - local.unsqueeze(-3)).masked_fill(~tril, float("-inf"))  # [..., i, j, K] fp64
    decayed_k = _exp(diff, dtype) * kb.unsqueeze(-3)  # [..., i, j, K]; above the diagonal: tiny, masked later
    both = torch.stack([kb, qb], dim=-2)  # [..., i, 2, K]
    scores = both @ decayed_k.transpose(-1, -2)  # [..., i, 2, j]
    return scores[..., 0, :], scores[..., 1, :]
