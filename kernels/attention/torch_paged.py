"""Torch MLA attention over a paged latent cache (the CPU path), and the cache write.

Contract: `mla_paged_attention(q, kv_cache, block_tables, cu_seqlens_q, seq_lens, scale, v_dim) -> o [T, H, v_dim]`
computes exactly what `kernels.attention.naive.mla_paged_attention_naive` documents (absorbed MLA = MQA with one
shared key/value "head"; queries are each sequence's last q_len positions; causal; fp32 softmax; `o` in `q.dtype`).
Mixed batches of prefill, continued prefill and decode are fine.

Memory and work: per sequence, queries go in chunks and keys in block-aligned chunks of about `KEY_CHUNK` positions
with an online (running max / running sum) softmax, so the fp32 working set is one score tile of at most
`SCORE_TILE_ELEMS` values plus one key chunk — never a whole sequence's keys or a [L, H, S] score tensor. A query
chunk reads only keys up to its last position, and only the chunk that holds its own positions is masked. This
path never reads cache entries past `seq_lens[n]`.

Decode batches (one query per sequence) run batched over sequences instead: groups of sequences whose gathered keys
(every block of the table's width — the runner trims tables to the longest sequence's blocks) fit in
`DECODE_KEY_ELEMS` values, one batched matmul for the scores and one for the output per group. Such a gather also
copies the rest of each sequence's last block and unused block-table entries; those values are zeroed and their
scores masked before use, so they never affect the result. A table too wide for one group takes the chunked path
above. The decode path reads nothing back to the host (it runs inside compiled and captured steps).

`write_kv_cache(kv_cache, slot_mapping [T] int64, latent [T, Dk])` writes token t's latent to flat slot
`slot_mapping[t] = block * block_size + offset` in place (valid, distinct slots; padding rows write a scratch block).

An FP8 cache (`kernels.attention.fp8_latent`: uint8 rows of e4m3 values and a per-token scale) is read the same
way: gathered rows are dequantised to fp32 where the model-dtype path casts them, and `write_kv_cache` quantises.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kernels.attention.fp8_latent import as_fp32_rows, is_fp8_cache, quantize_rows

SCORE_TILE_ELEMS = 1 << 24  # fp32 scores per (query chunk x key chunk) tile: 64 MiB
KEY_CHUNK = 4096  # key positions per inner step (rounded down to whole blocks)
DECODE_KEY_ELEMS = 1 << 24  # gathered key values per group of batched decodes (64 MiB fp32)


def _gather_keys(kv_cache: torch.Tensor, block_table: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """Cache entries of positions [start, end) of one sequence as fp32 [end - start, Dk]; `start` is block-aligned."""
    block_size = kv_cache.shape[1]
    blocks = block_table[start // block_size : -(-end // block_size)].to(torch.int64)
    return as_fp32_rows(kv_cache[blocks].reshape(-1, kv_cache.shape[2])[: end - start])


def _attend_chunk(
    qc: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, q_pos0: int, key_chunk: int,
    scale: float, v_dim: int,
) -> torch.Tensor:
    """Causal attention of `rows` consecutive query positions q_pos0.. over keys 0..q_pos0+rows-1.

    qc [rows, H, Dk] -> [rows, H, v_dim] fp32, online softmax over block-aligned key chunks.
    """
    rows, H, Dk = qc.shape
    k_end = q_pos0 + rows
    q2 = qc.to(torch.float32).reshape(rows * H, Dk)
    run_max = torch.full((rows * H, 1), float("-inf"), device=qc.device)
    run_sum = torch.zeros(rows * H, 1, device=qc.device)
    acc = torch.zeros(rows * H, v_dim, device=qc.device)
    for k0 in range(0, k_end, key_chunk):
        k1 = min(k_end, k0 + key_chunk)
        kv = _gather_keys(kv_cache, block_table, k0, k1)  # [n, Dk] fp32
        scores = torch.matmul(q2, kv.t()).mul_(scale)  # [rows*H, n]
        if k1 > q_pos0 + 1:  # some key in this chunk lies after some query: mask key > query position
            q_pos = torch.arange(q_pos0, k_end, device=qc.device)  # [rows]
            k_pos = torch.arange(k0, k1, device=qc.device)  # [n]
            future = (k_pos[None, :] > q_pos[:, None])[:, None, :]  # [rows, 1, n]
            scores.view(rows, H, k1 - k0).masked_fill_(future, float("-inf"))
        new_max = torch.maximum(run_max, scores.amax(-1, keepdim=True))  # finite: every query sees key 0
        probs = scores.sub_(new_max).exp_()  # in place: one score tile alive at a time
        rescale = torch.exp(run_max - new_max)
        run_sum = run_sum * rescale + probs.sum(-1, keepdim=True)
        acc = acc.mul_(rescale).addmm_(probs, kv[:, :v_dim])
        run_max = new_max
    return acc.div_(run_sum).view(rows, H, v_dim)


def _attend_sequence(
    q_seq: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int, scale: float, v_dim: int,
    out: torch.Tensor,
) -> None:
    """One sequence's last L positions. q_seq [L, H, Dk] -> out [L, H, v_dim] (any float dtype), written in place."""
    L, H, _ = q_seq.shape
    block_size = kv_cache.shape[1]
    key_chunk = max(block_size, KEY_CHUNK // block_size * block_size)
    rows = max(1, SCORE_TILE_ELEMS // (H * min(key_chunk, seq_len)))
    first = seq_len - L  # position of the first query
    for a in range(0, L, rows):
        b = min(L, a + rows)
        out[a:b] = _attend_chunk(q_seq[a:b], kv_cache, block_table, first + a, key_chunk, scale, v_dim)


def _attend_decodes(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                    scale: float, v_dim: int) -> torch.Tensor:
    """One query per sequence, all sequences at once. q [N, H, Dk] -> [N, H, v_dim] fp32.

    Every block of `block_tables` [N, nb] is gathered into one [N, nb * block_size, Dk] tensor; entries past a
    sequence's length (a partly filled last block, blocks of shorter sequences) are zeroed and their scores masked,
    so they never reach the result. Nothing is read back: the width comes from the table's shape."""
    N, H, Dk = q.shape
    block_size = kv_cache.shape[1]
    num_blocks = block_tables.shape[1]
    tables = block_tables.to(torch.int64).clamp(min=0)  # [N, nb]; unused entries may be -1
    rows = kv_cache.index_select(0, tables.reshape(-1))  # [N * nb, block_size, row]
    kv = as_fp32_rows(rows.view(N, num_blocks * block_size, rows.shape[-1]))  # [N, S, Dk] fp32
    past = torch.arange(kv.shape[1], device=q.device) >= seq_lens.to(torch.int64)[:, None]  # [N, S]
    kv.masked_fill_(past[:, :, None], 0.0)
    scores = torch.bmm(q.to(torch.float32), kv.transpose(1, 2)).mul_(scale)  # [N, H, S]
    scores.masked_fill_(past[:, None, :], float("-inf"))
    probs = scores.sub_(scores.amax(-1, keepdim=True)).exp_()  # every sequence has key 0: the max is finite
    total = probs.sum(-1, keepdim=True)  # [N, H, 1]
    return torch.bmm(probs, kv[:, :, :v_dim]).div_(total)  # [N, H, v_dim]


def mla_paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor,
                        seq_lens: torch.Tensor, scale: float, v_dim: int,
                        host: tuple[Sequence[int], Sequence[int]] | None = None) -> torch.Tensor:
    """`host`: `(cu_seqlens_q, seq_lens)` as host ints (the runner has them) for the per-sequence path, so nothing
    is read back; None reads the tensors. Decode batches never read anything back."""
    T, H, _ = q.shape
    out = torch.empty(T, H, v_dim, dtype=q.dtype, device=q.device)
    if T == seq_lens.shape[0] and T > 0:  # one query per sequence: batched over sequences, in groups
        per_seq = block_tables.shape[1] * kv_cache.shape[1] * kv_cache.shape[2]  # gathered keys per sequence
        group = DECODE_KEY_ELEMS // max(per_seq, 1)
        if group >= 1:
            for a in range(0, T, group):
                b = min(T, a + group)
                out[a:b] = _attend_decodes(q[a:b], kv_cache, block_tables[a:b], seq_lens[a:b], scale, v_dim)
            return out
    bounds, lens = host if host is not None else (cu_seqlens_q.tolist(), seq_lens.tolist())
    for n, seq_len in enumerate(lens):
        start, end = bounds[n], bounds[n + 1]
        if end > start:
            _attend_sequence(q[start:end], kv_cache, block_tables[n], seq_len, scale, v_dim, out[start:end])
    return out


def write_kv_cache(kv_cache: torch.Tensor, slot_mapping: torch.Tensor, latent: torch.Tensor) -> None:
    """Writes latent [T, Dk] into kv_cache [num_blocks, block_size, Dk] at flat slots slot_mapping [T] (in place).
    Slots must be valid and distinct (padding rows of a bucketed step write to a scratch block): no host read."""
    flat = kv_cache.view(-1, kv_cache.shape[-1])  # [num_blocks * block_size, row]; needs a contiguous cache
    rows = quantize_rows(latent) if is_fp8_cache(kv_cache) else latent.to(flat.dtype)  # [T, row]
    flat.index_copy_(0, slot_mapping.to(torch.int64), rows)
