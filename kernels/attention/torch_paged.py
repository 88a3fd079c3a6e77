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

Decode batches (one query per sequence) run batched over sequences instead, split over the context (split-KV):
the table's width (the runner trims tables to the longest sequence's blocks) is cut into splits of as many blocks
as one sequence's gathered keys fit in `DECODE_KEY_ELEMS` values, and sequences go in groups whose split gathers
fit there too; per group and split, one batched matmul for the scores and one for the output. A table that fits in
one split is attended directly; a wider one yields a partial output and log-sum-exp per split, merged by
`kernels.attention.split_kv.merge_partials` (a split past a sequence's end is empty and weighs nothing). A gather
also copies the rest of each sequence's last block and unused block-table entries; those values are zeroed and
their scores masked before use, so they never affect the result. The decode path reads nothing back to the host
(it runs inside compiled and captured steps): group and split counts come from shapes only.

`write_kv_cache(kv_cache, slot_mapping [T] int64, latent [T, Dk])` writes token t's latent to flat slot
`slot_mapping[t] = block * block_size + offset` in place (valid, distinct slots; padding rows write a scratch block).

An FP8 cache (`kernels.attention.fp8_latent`: uint8 rows of e4m3 values and a per-token scale) is read the same
way: gathered rows are dequantised to fp32 where the model-dtype path casts them, and `write_kv_cache` quantises.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kernels.attention.fp8_latent import as_fp32_rows, is_fp8_cache, quantize_rows
from kernels.attention.split_kv import merge_partials

SCORE_TILE_ELEMS = 1 << 24  # fp32 scores per (query chunk x key chunk) tile: 64 MiB
KEY_CHUNK = 4096  # key positions per inner step (rounded down to whole blocks)
DECODE_KEY_ELEMS = 1 << 20  # gathered key values per decode tile (4 MiB fp32: cache-sized; bench_attention)
# gathered key values up to which a compiled step attends in one tile (`fits_one_tile`): inductor fuses that gather
# with its masking, which beats the eager splits of `DECODE_KEY_ELEMS` well past that tile (small-linear, AMD EPYC,
# one thread: decode at 8K context 34.3 -> 26.0 ms a step with 16 MiB; even at 16K, 42 vs 43 ms with 32 MiB)
ONE_TILE_KEY_ELEMS = 1 << 22


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


def _decode_partial(q: torch.Tensor, kv_cache: torch.Tensor, tables: torch.Tensor, seq_lens: torch.Tensor,
                    first_block: int, scale: float, v_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One query per sequence over the blocks `tables` [N, nb] (columns first_block.. of the block table).

    q [N, H, Dk] -> (o [N, H, v_dim] fp32 normalised over these keys, lse [N, H] fp32; -inf where a sequence has no
    key here). Every listed block is gathered into one [N, nb * block_size, Dk] tensor; entries past a sequence's
    length are zeroed and their scores masked, so they never reach the result. Nothing is read back."""
    N, H, Dk = q.shape
    block_size = kv_cache.shape[1]
    num_blocks = tables.shape[1]
    rows = kv_cache.index_select(0, tables.to(torch.int64).clamp(min=0).reshape(-1))  # [N*nb, bs, row]; -1 unused
    kv = as_fp32_rows(rows.view(N, num_blocks * block_size, rows.shape[-1]))  # [N, S, Dk] fp32
    key_pos = torch.arange(kv.shape[1], device=q.device) + first_block * block_size  # [S]
    past = key_pos >= seq_lens.to(torch.int64)[:, None]  # [N, S]
    kv.masked_fill_(past[:, :, None], 0.0)
    scores = torch.bmm(q.to(torch.float32), kv.transpose(1, 2)).mul_(scale)  # [N, H, S]
    scores.masked_fill_(past[:, None, :], float("-inf"))
    top = scores.amax(-1, keepdim=True)  # [N, H, 1]; -inf where the split holds no key of the sequence
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    probs = scores.sub_(top).exp_()
    total = probs.sum(-1, keepdim=True)  # [N, H, 1]
    o = torch.bmm(probs, kv[:, :, :v_dim]).div_(torch.where(total > 0, total, 1.0))  # [N, H, v_dim]
    return o, torch.log(total).add_(top).squeeze(-1)  # log(0) = -inf for empty splits


def _attend_decodes(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                    scale: float, v_dim: int, split_blocks: int) -> torch.Tensor:
    """One query per sequence, all sequences at once. q [N, H, Dk] -> [N, H, v_dim] fp32.

    The table's width is cut into splits of `split_blocks` blocks; one split is attended directly, several are
    attended one by one (partial output + log-sum-exp each) and merged by `split_kv.merge_partials`. The split
    count comes from the table's shape, so nothing is read back."""
    num_blocks = block_tables.shape[1]
    if num_blocks <= split_blocks:
        return _decode_partial(q, kv_cache, block_tables, seq_lens, 0, scale, v_dim)[0]
    parts = [_decode_partial(q, kv_cache, block_tables[:, b : b + split_blocks], seq_lens, b, scale, v_dim)
             for b in range(0, num_blocks, split_blocks)]
    return merge_partials(torch.stack([o for o, _ in parts]), torch.stack([lse for _, lse in parts]))


def mla_paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor,
                        seq_lens: torch.Tensor, scale: float, v_dim: int,
                        host: tuple[Sequence[int], Sequence[int]] | None = None) -> torch.Tensor:
    """`host`: `(cu_seqlens_q, seq_lens)` as host ints (the runner has them) for the per-sequence path, so nothing
    is read back; None reads the tensors. Decode batches never read anything back."""
    T, H, _ = q.shape
    out = torch.empty(T, H, v_dim, dtype=q.dtype, device=q.device)
    if T == seq_lens.shape[0] and T > 0:  # one query per sequence: batched over sequences and context splits
        return decode_attention(q, kv_cache, block_tables, seq_lens, scale, v_dim, out=out)
    bounds, lens = host if host is not None else (cu_seqlens_q.tolist(), seq_lens.tolist())
    for n, seq_len in enumerate(lens):
        start, end = bounds[n], bounds[n + 1]
        if end > start:
            _attend_sequence(q[start:end], kv_cache, block_tables[n], seq_len, scale, v_dim, out[start:end])
    return out


def decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                     scale: float, v_dim: int, key_elems: int | None = None,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """One query per sequence: q [N, H, Dk] -> [N, H, v_dim] in q.dtype (into `out` if given), split-KV over the
    context in tiles of `key_elems` gathered values (None: `DECODE_KEY_ELEMS`). Reads nothing back."""
    N = q.shape[0]
    out = torch.empty(N, q.shape[1], v_dim, dtype=q.dtype, device=q.device) if out is None else out
    tile = DECODE_KEY_ELEMS if key_elems is None else key_elems
    per_block = kv_cache.shape[1] * kv_cache.shape[2]  # gathered values per block
    split_blocks = max(1, tile // per_block)  # one sequence's split fits the tile
    group = max(1, tile // (min(block_tables.shape[1], split_blocks) * per_block))  # sequences per group
    for a in range(0, N, group):
        b = min(N, a + group)
        out[a:b] = _attend_decodes(q[a:b], kv_cache, block_tables[a:b], seq_lens[a:b], scale, v_dim, split_blocks)
    return out


def decode_attention_one_tile(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                              seq_lens: torch.Tensor, scale: float, v_dim: int) -> torch.Tensor:
    """One query per sequence over every listed block in one gather: q [N, H, Dk] -> [N, H, v_dim] fp32. For
    steps whose gather fits a tile (`fits_one_tile`): no Python loop over the table's width, so a compiled step
    with a dynamic width traces it as plain ops. Reads nothing back."""
    return _decode_partial(q, kv_cache, block_tables, seq_lens, 0, scale, v_dim)[0]


def verify_attention_one_tile(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                              seq_lens: torch.Tensor, tokens_per_row: int, scale: float, v_dim: int) -> torch.Tensor:
    """Q = `tokens_per_row` queries per sequence, its last Q positions (a verification): q [N*Q, H, Dk] ->
    [N*Q, H, v_dim] fp32; query t of sequence n sees keys before `seq_lens[n] - Q + 1 + t`. One gather per
    sequence, as `decode_attention_one_tile` (same fit), with a causal mask over the row's queries. Reads nothing
    back."""
    T, H, Dk = q.shape
    n, block_size = T // tokens_per_row, kv_cache.shape[1]
    rows = kv_cache.index_select(0, block_tables.to(torch.int64).clamp(min=0).reshape(-1))  # [N*nb, bs, row]
    kv = as_fp32_rows(rows.view(n, block_tables.shape[1] * block_size, rows.shape[-1]))  # [N, S, Dk] fp32
    key_pos = torch.arange(kv.shape[1], device=q.device)  # [S]
    lens = seq_lens.to(torch.int64)[:, None]  # [N, 1]
    kv.masked_fill_((key_pos >= lens)[:, :, None], 0.0)
    limits = lens - tokens_per_row + 1 + torch.arange(tokens_per_row, device=q.device)  # [N, Q]
    past = key_pos >= limits[:, :, None]  # [N, Q, S]
    scores = torch.bmm(q.to(torch.float32).view(n, tokens_per_row * H, Dk), kv.transpose(1, 2)).mul_(scale)
    scores = scores.view(n, tokens_per_row, H, -1).masked_fill_(past[:, :, None, :], float("-inf"))
    probs = scores.sub_(scores.amax(-1, keepdim=True)).exp_()  # every query sees at least its own key
    total = probs.sum(-1, keepdim=True)  # [N, Q, H, 1]
    o = torch.bmm(probs.view(n, tokens_per_row * H, -1), kv[:, :, :v_dim])  # [N, Q*H, v_dim]
    return o.view(n, tokens_per_row, H, v_dim).div_(total).view(T, H, v_dim)


def fits_one_tile(num_seqs: int, block_tables: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """Whether `num_seqs` sequences' gathered keys over `block_tables`' width fit `ONE_TILE_KEY_ELEMS` values."""
    return num_seqs * block_tables.shape[1] * kv_cache.shape[1] * kv_cache.shape[2] <= ONE_TILE_KEY_ELEMS


def write_kv_cache(kv_cache: torch.Tensor, slot_mapping: torch.Tensor, latent: torch.Tensor) -> None:
    """Writes latent [T, Dk] into kv_cache [num_blocks, block_size, Dk] at flat slots slot_mapping [T] (in place).
    Slots must be valid and distinct (padding rows of a bucketed step write to a scratch block): no host read."""
    flat = kv_cache.view(-1, kv_cache.shape[-1])  # [num_blocks * block_size, row]; needs a contiguous cache
    rows = quantize_rows(latent) if is_fp8_cache(kv_cache) else latent.to(flat.dtype)  # [T, row]
    flat.index_copy_(0, slot_mapping.to(torch.int64), rows)
