"""Decode-context parallelism (DCP) for the MLA latent cache: which rank holds a token, and attention over the
tokens one rank holds, as a partial output with its log-sum-exp.

Layout (token interleave 1, as vLLM's default `dcp_kv_cache_interleave_size`): with N ranks in a DCP group and the
engine's (logical) block size `B` (a multiple of N), each rank's physical block holds `B / N` rows, and the block
ids are the same on every rank. A token at flat logical slot `s = block * B + offset` (the engine's slot mapping)
lives on DCP rank `s % N` at local flat slot `s // N` (that is, row `offset // N` of the same block). Since B is a
multiple of N, position p of a sequence lives on rank `p % N`, and rank r's rows of a sequence, read through the
same block table with block size `B / N`, are its positions r, r + N, r + 2N, ... in order: rank r holds
`local_len(L, r, N) = ceil((L - r) / N)` of a sequence's first L tokens. Per-rank latent bytes for the same token
capacity are exactly 1/N of the replicated cache's.

Contract:
- `owner_and_local_slot(slots [T], size) -> (owner [T], local [T])`; `local_write_slots(slots, rank, size,
  scratch_slot)`: the local slot of each token this rank owns, `scratch_slot` for the others (they are written to
  a scratch row, never read). Device ops only.
- `partial_attention(q [T, H, Dk], kv_cache (this rank's), block_tables, cu_seqlens, seq_lens, scale, v_dim, rank,
  size, host) -> (o [T, H, v_dim] fp32, lse [T, H] fp32)`: the attention of each query over only this rank's keys
  (causal in global positions: a query at position p sees this rank's keys at positions <= p), normalised over
  them, and the log-sum-exp of its scaled scores (-inf where it sees none; `o` is then zero). Merging the N ranks'
  pairs with `split_kv.merge_partials` gives `naive.mla_paged_attention_naive` over the whole context. Decode
  batches (one query per sequence) run batched and split over the context (no host read); others go per sequence
  with an online softmax over key chunks (the `host` ints, as in `torch_paged`).
- `gather_blocks(parts)` / `scatter_blocks(full, rank, size)`: blocks between the N ranks' local rows
  `[..., n, B / N, row]` (rank order) and the DCP-independent layout `[..., n, B, row]` that handoffs and the cache
  service carry; `scatter_blocks(gather_blocks(p), r, N)` equals `p[r]` bitwise.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kernels.attention.split_kv import merge_partials_lse
from kernels.attention.torch_paged import DECODE_KEY_ELEMS, KEY_CHUNK, SCORE_TILE_ELEMS, _decode_partial, _gather_keys


def owner_and_local_slot(slots: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """slots [T] int64 logical flat slots -> (owning DCP rank [T], local flat slot [T])."""
    return slots % size, torch.div(slots, size, rounding_mode="floor")


def local_write_slots(slots: torch.Tensor, rank: int, size: int, scratch_slot: int) -> torch.Tensor:
    """[T] int64: this rank's local slot for the tokens it owns, `scratch_slot` for the others."""
    owner, local = owner_and_local_slot(slots.to(torch.int64), size)
    return torch.where(owner == rank, local, torch.full_like(local, scratch_slot))


def local_len(seq_lens: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """Tokens of each sequence's first `seq_lens` that rank `rank` holds: ceil((L - rank) / size), >= 0."""
    return torch.div(seq_lens.to(torch.int64) - rank + size - 1, size, rounding_mode="floor").clamp_(min=0)


def partial_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, cu_seqlens: torch.Tensor,
                      seq_lens: torch.Tensor, scale: float, v_dim: int, rank: int, size: int,
                      host: tuple[Sequence[int], Sequence[int]] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """See the module docstring. q [T, H, Dk] -> (o [T, H, v_dim] fp32, lse [T, H] fp32)."""
    T, H, _ = q.shape
    if T == seq_lens.shape[0] and T > 0:  # one query per sequence: all of them are at the sequence's end
        return _decode(q, kv_cache, block_tables, local_len(seq_lens, rank, size), scale, v_dim)
    o = torch.zeros(T, H, v_dim, device=q.device)
    lse = torch.full((T, H), float("-inf"), device=q.device)
    bounds, lens = host if host is not None else (cu_seqlens.tolist(), seq_lens.tolist())
    for n, seq_len in enumerate(lens):
        start, end = bounds[n], bounds[n + 1]
        if end > start:
            o[start:end], lse[start:end] = _sequence(q[start:end], kv_cache, block_tables[n], seq_len, scale, v_dim,
                                                     rank, size)
    return o, lse


def _decode(q: torch.Tensor, kv_cache: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor, scale: float,
            v_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One query per sequence over its first `lens` local rows. Split over the table's width like
    `torch_paged.decode_attention` (split count from shapes only); the splits merge into one (o, lse) pair."""
    per_block = kv_cache.shape[1] * kv_cache.shape[2]
    split_blocks = max(1, DECODE_KEY_ELEMS // per_block)
    parts = [_decode_partial(q, kv_cache, tables[:, b: b + split_blocks], lens, b, scale, v_dim)
             for b in range(0, max(1, tables.shape[1]), split_blocks)]
    if len(parts) == 1:
        return parts[0]
    return merge_partials_lse(torch.stack([o for o, _ in parts]), torch.stack([s for _, s in parts]))


def _sequence(q_seq: torch.Tensor, kv_cache: torch.Tensor, table: torch.Tensor, seq_len: int, scale: float,
              v_dim: int, rank: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's last L queries over this rank's keys: q_seq [L, H, Dk] -> (o [L, H, v] fp32, lse [L, H])."""
    L, H, Dk = q_seq.shape
    block_size = kv_cache.shape[1]
    key_chunk = max(block_size, KEY_CHUNK // block_size * block_size)
    keys = (seq_len - 1 - rank + size) // size  # local rows the last query sees
    pos = torch.arange(seq_len - L, seq_len, device=q_seq.device)  # [L] global query positions
    visible = torch.div(pos - rank + size, size, rounding_mode="floor")  # [L] local rows each query sees
    rows = max(1, SCORE_TILE_ELEMS // (H * max(1, min(key_chunk, keys))))
    o = torch.zeros(L, H, v_dim, device=q_seq.device)
    lse = torch.full((L, H), float("-inf"), device=q_seq.device)
    for a in range(0, L, rows):
        b = min(L, a + rows)
        o[a:b], lse[a:b] = _online(q_seq[a:b], kv_cache, table, keys, visible[a:b], key_chunk, scale, v_dim)
    return o, lse


def _online(qc: torch.Tensor, kv_cache: torch.Tensor, table: torch.Tensor, keys: int, visible: torch.Tensor,
            key_chunk: int, scale: float, v_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """qc [R, H, Dk] over local rows [0, keys), row k visible to query i when k < visible[i]: online softmax."""
    R, H, Dk = qc.shape
    q2 = qc.to(torch.float32).reshape(R * H, Dk)
    run_max = torch.full((R * H, 1), float("-inf"), device=qc.device)
    run_sum = torch.zeros(R * H, 1, device=qc.device)
    acc = torch.zeros(R * H, v_dim, device=qc.device)
    limit = visible.repeat_interleave(H)[:, None]  # [R*H, 1]
    for k0 in range(0, keys, key_chunk):
        k1 = min(keys, k0 + key_chunk)
        kv = _gather_keys(kv_cache, table, k0, k1)  # [n, Dk] fp32
        scores = torch.matmul(q2, kv.t()).mul_(scale)  # [R*H, n]
        scores.masked_fill_(torch.arange(k0, k1, device=qc.device)[None, :] >= limit, float("-inf"))
        new_max = torch.maximum(run_max, scores.amax(-1, keepdim=True))
        safe = torch.where(torch.isfinite(new_max), new_max, torch.zeros_like(new_max))  # a query that sees none yet
        probs = scores.sub_(safe).exp_()
        rescale = torch.exp(run_max - safe)
        run_sum = run_sum * rescale + probs.sum(-1, keepdim=True)
        acc = acc.mul_(rescale).addmm_(probs, kv[:, :v_dim])
        run_max = new_max
    safe = torch.where(torch.isfinite(run_max), run_max, torch.zeros_like(run_max))
    o = acc.div_(torch.where(run_sum > 0, run_sum, torch.ones_like(run_sum)))
    return o.view(R, H, v_dim), torch.log(run_sum).add_(safe).view(R, H)


def gather_blocks(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """N ranks' rows [..., n, B/N, row] (rank order) -> [..., n, B, row]: logical row o is rank o % N's row o // N."""
    stacked = torch.stack(list(parts), dim=-2)  # [..., n, B/N, N, row]
    return stacked.reshape(*stacked.shape[:-3], stacked.shape[-3] * len(parts), stacked.shape[-1])


def scatter_blocks(full: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """[..., n, B, row] -> rank `rank`'s rows [..., n, B/N, row] (a copy)."""
    rows = full.shape[-2]
    return full.unflatten(-2, (rows // size, size))[..., rank, :].clone()
