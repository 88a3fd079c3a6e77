"""Chunkwise-parallel Kimi Delta Attention in torch (the WY / UT-transform form): the fast CPU path for prompts.

Contract: the math and layouts of `kernels.kda.naive`, computed in fp32 (fp64 for fp64 inputs), o in v's dtype.

- `chunk_kda(q, k, v, g, beta, scale, initial_state=None, cu_seqlens=None, chunk_size=32) -> (o, final_state)`;
  32 measured fastest on CPU (vs 64, with batches of ~1 MB per tensor; bench/bench_kda.py).
- `kda_prefill_pooled(q, k, v, g, beta, scale, cu_seqlens, state_pool, state_indices) -> o`: sequence n starts from
  `state_pool[state_indices[n]]` ([S, H, K, V] fp32) and its final state is written back to that slot in place; no
  other slot is read or written. `state_indices` must not repeat.

Algorithm, per sequence and head, for a chunk of C tokens starting from state S0 (positions i, j in the chunk,
G_i = cumsum of g up to and including i, relative to the chunk start, so G is non-increasing and <= 0):

    A[i, j]   = sum_k k_i k_j exp(G_i - G_j)             (j < i)      k-k scores with relative decay
    Aqk[i, j] = sum_k q_i k_j exp(G_i - G_j)             (j <= i)
    X = (I + diag(beta) A)^-1 diag(beta)                 (blocked unit lower triangular inverse)
    W = X (k * exp(G)),  U0 = X v
    U = U0 - W S0                                        the delta-rule "new values" of the chunk
    S1 = exp(G_last) * S0 + (k * exp(G_last - G))^T U    (the sequential part: two matmuls per chunk)
    o = scale * ((q * exp(G)) S0 + Aqk U)                (batched over chunks once all S0 and U are known)

Numerics (fp32 without loss): every exponent is a sum of gates over a contiguous token range, formed *as such a sum*
(a prefix or suffix sum restarted at a block boundary, or the sum of two of them), never as the difference of two
cumulative sums. All terms have the same sign, so the exponent carries a relative error of a few ulps, each exp()
factor is <= 1 with a relative error of a few ulps whatever the gates (strong decays followed by weak ones included),
and a product of two such factors keeps that. The score matrices are built by recursive halving: at level L (1, 2, 4,
.. C/2) every 2L-block's lower-left [L, L] quadrant (rows in the right half Y, columns in the left half X) factors
around the boundary R between X and Y, exp(G_i - G_j) = exp(G_i - G_R) exp(G_R - G_j), where G_i - G_R is the prefix
sum of Y restarted at L and G_R - G_j the suffix sum of X after j: one batched matmul per level. Moving to level 2L
adds the left half's total to the right half's prefix and the right half's total to the left half's suffix; after
the last level these are G (prefix from the chunk start) and G_last - G. Chunk sizes that are not a power of two are
padded (g = 0, q = k = 0) to one inside the score computation. Exponents that underflow give 0 (or subnormals, which
are slow on CPU unless `torch.set_flush_denormal(True)`, as the model forward sets).

Layout and batching: chunk-major [B, H, C, *] (B chunks), so a step's chunks are contiguous rows for the state
matmul. Sequences are cut into chunks; a sequence's last chunk is padded with beta = 0 (its new value is zero, so it
writes nothing) and g = 0 (it decays nothing). All state-independent work runs batched over many chunks, heads and
sequences; only U and S1 loop, once per chunk index, over all sequences that still have that chunk (longest
first, so they are a prefix) and records S0 and U for the batched output.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.kda.naive import compute_dtype, default_cu_seqlens

_SUB = 16  # diagonal block size of the blocked triangular inverse
_GROUP_ELEMENTS = 1 << 22  # element budget of one batch of chunks (per-batch tensors of ~1 MB stay in cache)
# Exponents are clamped here before exp(): the result is still a normal number (an absolute error below 1e-34), and
# CPU exp of arguments whose result is subnormal or zero is an order of magnitude slower.
_EXP_FLOOR = {torch.float32: -80.0, torch.float64: -700.0}


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


def chunk_kda(q, k, v, g, beta, scale, initial_state=None, cu_seqlens=None, chunk_size=32):
    """KDA over a packed variable-length batch in the chunkwise WY form (see the module docstring)."""
    dtype = compute_dtype(q, k, v, g, beta)
    T, H, K = k.shape
    V = v.shape[-1]
    device = q.device
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    cu = default_cu_seqlens(cu_seqlens, T, device)
    plan = plan_chunks(cu, T, chunk_size)
    num_seqs = cu.numel() - 1
    if initial_state is None:
        state = torch.zeros(num_seqs, H, K, V, dtype=dtype, device=device)  # [N, H, K, V], sorted sequence order
    else:
        state = initial_state[plan.order].to(dtype)  # indexing copies: the caller's tensor is never written
    o = torch.empty(T + 1, H, V, dtype=dtype, device=device)  # row T collects padding
    group = max(1, _GROUP_ELEMENTS // (H * chunk_size * (K + V) * 8))
    for batch in _batches(_units(plan, group), group):
        first = batch[0][0]
        rows = plan.tokens[first : batch[-1][1]]  # [B, C]
        prep = _prepare(*_gather_chunks(rows, T, q, k, v, g, beta, dtype))
        s_in = torch.empty(rows.shape[0], H, K, V, dtype=dtype, device=device)  # state at each chunk's start
        u = torch.empty_like(prep.u0)  # [B, H, C, V] U
        for lo, hi, seq_lo in batch:
            chunks = slice(lo - first, hi - first)
            seqs = state[seq_lo : seq_lo + hi - lo]  # contiguous [n, H, K, V]
            s_in[chunks] = seqs
            flat = seqs.view(-1, K, V)
            torch.baddbmm(prep.u0[chunks].flatten(0, 1), prep.w[chunks].flatten(0, 1), flat, alpha=-1,
                          out=u[chunks].view(-1, chunk_size, V))  # U = U0 - W S0
            seqs.mul_(prep.decay_end[chunks])
            flat.baddbmm_(prep.k_to_end[chunks].flatten(0, 1), u[chunks].view(-1, chunk_size, V))
        s = s_in.flatten(0, 1)
        qs = prep.q_decayed.flatten(0, 1) @ s
        o_rows = torch.baddbmm(qs, prep.scores_qk.flatten(0, 1), u.flatten(0, 1), beta=scale, alpha=scale)
        o[rows] = o_rows.view(u.shape).transpose(1, 2)  # [B, C, H, V]
    final = torch.empty_like(state)
    final[plan.order] = state
    return o[:T].to(v.dtype), final


def kda_prefill_pooled(q, k, v, g, beta, scale, cu_seqlens, state_pool, state_indices):
    """Chunked KDA whose initial and final states live in `state_pool` slots (see the module docstring)."""
    idx = state_indices.to(device=state_pool.device, dtype=torch.int64)
    o, final = chunk_kda(q, k, v, g, beta, scale, state_pool.index_select(0, idx), cu_seqlens)
    state_pool.index_copy_(0, idx, final.to(state_pool.dtype))
    return o


def _gather_chunks(rows, total, q, k, v, g, beta, dtype):
    """Token rows [B, C] (padding marked `total`) of [T, H, *] inputs -> q, k, v, g, beta as [B, H, C, *] in `dtype`.

    Padding gets beta = 0 (its new value is zero, so it writes nothing) and g = 0 (it decays nothing); its q, k, v
    are copies of a real token, and its outputs are dropped.
    """
    B, C = rows.shape
    flat = rows.reshape(-1).clamp(max=total - 1)

    def take(x):
        picked = x.index_select(0, flat).view(B, C, *x.shape[1:]).transpose(1, 2)  # [B, H, C, *]
        return torch.empty(picked.shape, dtype=dtype, device=x.device).copy_(picked)

    q_c, k_c, v_c, g_c, beta_c = (take(x) for x in (q, k, v, g, beta))
    pad = rows >= total  # [B, C]
    if bool(pad.any()):
        g_c.masked_fill_(pad[:, None, :, None], 0.0)
        beta_c.masked_fill_(pad[:, None, :], 0.0)
    return q_c, k_c, v_c, g_c, beta_c


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
    """State-independent per-chunk tensors, [B, H, *, *] (see the module docstring for the formulas)."""

    q_decayed: torch.Tensor  # [B, H, C, K] q * exp(G)
    w: torch.Tensor  # [B, H, C, K] W
    u0: torch.Tensor  # [B, H, C, V] U0
    scores_qk: torch.Tensor  # [B, H, C, C] Aqk (unscaled)
    k_to_end: torch.Tensor  # [B, H, K, C] (k * exp(G_last - G))^T
    decay_end: torch.Tensor  # [B, H, K, 1] exp(G_last)


def _prepare(q, k, v, g, beta) -> _Prepared:
    """The state-independent part of a batch of chunks. q, k, g: [B, H, C, K]; v: [B, H, C, V]; beta: [B, H, C]."""
    floor = _EXP_FLOOR[q.dtype]
    scores_kk, scores_qk, decay, to_end = _scores_and_exponents(q, k, g)
    decay = decay.clamp_(min=floor).exp_()  # [B, H, C, K] exp(G)
    inverse = unit_lower_inverse(scores_kk.mul_(beta.unsqueeze(-1)), _SUB)  # (I + diag(beta) A)^-1
    inverse.mul_(beta.unsqueeze(-2))  # X = (I + diag(beta) A)^-1 diag(beta)
    return _Prepared(
        q_decayed=q * decay,
        w=inverse @ (k * decay),
        u0=inverse @ v,
        scores_qk=scores_qk,
        k_to_end=(k * to_end.clamp_(min=floor).exp_()).transpose(-1, -2),
        decay_end=decay[..., -1, :].unsqueeze(-1),
    )


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


def intra_chunk_scores(q, k, g):
    """Decayed score matrices of a batch of chunks.

    q, k: [..., C, K]; g: [..., C, K] per-token log-decay (<= 0), all in the compute dtype.
    Returns (A [..., C, C] strictly lower: sum_k k_i k_j exp(G_i - G_j),
             Aqk [..., C, C] lower incl. diagonal: sum_k q_i k_j exp(G_i - G_j)), unscaled, G = cumsum(g).
    """
    scores_kk, scores_qk, _, _ = _scores_and_exponents(q, k, g)
    return scores_kk, scores_qk


def _scores_and_exponents(q, k, g):
    """`intra_chunk_scores` plus the exponents G (prefix sums from the chunk start) and G_last - G (suffix sums after
    each token), [..., C, K] each; see the module docstring for the recursive halving."""
    *lead, C, K = k.shape
    floor = _EXP_FLOOR[k.dtype]
    size = 1 << max(C - 1, 0).bit_length()  # C rounded up to a power of two
    q, k, prefix = (x.contiguous() if size == C else F.pad(x, (0, 0, 0, size - C)) for x in (q, k, g))
    if prefix is g:
        prefix = g.clone()
    suffix = torch.zeros_like(prefix)
    scores_kk = k.new_zeros(*lead, size, size)
    scores_qk = k.new_zeros(*lead, size, size)
    half = 1
    while half < size:
        n = size // (2 * half)
        shape = (*lead, n, 2, half, K)  # [..., pair, left X / right Y, token, K]
        pre, suf, kb, qb = (x.view(shape) for x in (prefix, suffix, k, q))
        # pre (Y) = G_i - G_R for rows i in Y; suf (X) = G_R - G_j for columns j in X; both sums, both <= 0.
        # Clamping them in place at the floor keeps every later sum built from them within exp(floor) of exact.
        cols = kb[..., 0, :, :] if half == 1 else kb[..., 0, :, :] * suf[..., 0, :, :].clamp_(min=floor).exp()
        cols = cols.transpose(-1, -2)  # [..., n, K, half]
        to_row = pre[..., 1, :, :].clamp_(min=floor).exp()
        block_kk = (kb[..., 1, :, :] * to_row) @ cols  # [..., n, half, half]
        block_qk = to_row.mul_(qb[..., 1, :, :]) @ cols
        for scores, block in ((scores_kk, block_kk), (scores_qk, block_qk)):
            quads = scores.view(*lead, n, 2 * half, n, 2 * half).diagonal(dim1=-4, dim2=-2)  # [..., 2h, 2h, n]
            quads[..., half:, :half, :].copy_(block.movedim(-3, -1))
        suf[..., 0, :, :] += pre[..., 1, -1:, :]  # left half's suffix now runs to the end of the 2h-block
        pre[..., 1, :, :] += pre[..., 0, -1:, :]  # right half's prefix now starts at the 2h-block start
        half *= 2
    scores_qk.diagonal(dim1=-2, dim2=-1).copy_((q * k).sum(-1))
    if size != C:
        return scores_kk[..., :C, :C], scores_qk[..., :C, :C], prefix[..., :C, :], suffix[..., :C, :]
    return scores_kk, scores_qk, prefix, suffix
