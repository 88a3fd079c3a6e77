"""MLA prefill in the non-absorbed form over the paged latent cache (the way vLLM computes prompts), per sequence,
with the cached context merged chunk by chunk (online softmax): memory is bounded per chunk.

Contract:
`mla_prefill_attention(q [T, H, nope+rope], kv_cache, w_uk [H, nope, lora], w_uv [H, v, lora], block_tables,
 host=(cu_seqlens_q, seq_lens), scale, min_queries) -> o [T, H, v]` (in `q.dtype`)

- Same semantics as the absorbed kernels (kernels/attention/naive.py): the queries of sequence n are its last q_len
  positions, causal, fp32 scores and softmax; only the representation differs. Absorbed: the query goes into the
  latent space (`q_nope · W_uk`) and attends the 576-wide latents; the latent output goes back through `W_uv`.
  Non-absorbed: each key chunk's latents are expanded to per-head keys `[c · W_ukᵀ, k_rope]` and values `c · W_uvᵀ`,
  and the query attends them directly — (nope + rope) + v multiply-adds per query, head and key instead of
  (lora + rope) + lora, for lora · (nope + v) per head and key to expand. So the non-absorbed form pays off for
  sequences with at least `non_absorbed_min_queries(...)` queries in the step (the break-even, from the dims);
  shorter ones (decodes, verifications, small chunks) take the absorbed torch path here, with the same results.
- Key chunks are block-aligned, KEY_CHUNK positions; query chunks keep the fp32 score tile at SCORE_TILE_ELEMS.
  Cache entries past `seq_lens[n]` are never read. FP8 caches (kernels/attention/fp8_latent.py) are dequantised
  per chunk.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kernels.attention import torch_paged
from kernels.attention.fp8_latent import as_fp32_rows

SCORE_TILE_ELEMS = 1 << 24  # fp32 scores per (query chunk x key chunk) tile
KEY_CHUNK = 2048  # key positions expanded at a time (rounded down to whole blocks)


def non_absorbed_min_queries(lora: int, nope: int, rope: int, v: int) -> int:
    """Queries from which the non-absorbed form does less work for a sequence: expanding a key costs
    lora·(nope+v) per head, and each query then saves (lora+rope+lora) − (nope+rope+v) per head and key."""
    saved = (lora + rope + lora) - (nope + rope + v)
    return -(-lora * (nope + v) // saved) if saved > 0 else 1 << 62


def _expand(rows: torch.Tensor, w_uk: torch.Tensor, w_uv: torch.Tensor, lora: int):
    """Latent rows [n, lora+rope] (fp32) -> keys_nope [H, n, nope], k_rope [n, rope], values [H, n, v]."""
    c, k_rope = rows[:, :lora], rows[:, lora:]
    return torch.matmul(w_uk, c.t()).transpose(1, 2), k_rope, torch.matmul(w_uv, c.t()).transpose(1, 2)


def _attend_rows(q_nope: torch.Tensor, q_rope: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                 q_pos0: int, w_uk: torch.Tensor, w_uv: torch.Tensor, scale: float, key_chunk: int) -> torch.Tensor:
    """Causal non-absorbed attention of consecutive queries q_pos0.. (q_nope [H, rows, nope], q_rope [H, rows,
    rope], fp32) over keys 0..q_pos0+rows-1 -> [rows, H, v] fp32, online softmax over key chunks."""
    H, rows, _ = q_nope.shape
    lora = w_uk.shape[-1]
    k_end = q_pos0 + rows
    run_max = torch.full((H, rows, 1), float("-inf"), device=q_nope.device)
    run_sum = torch.zeros(H, rows, 1, device=q_nope.device)
    acc = torch.zeros(H, rows, w_uv.shape[1], device=q_nope.device)
    for k0 in range(0, k_end, key_chunk):
        k1 = min(k_end, k0 + key_chunk)
        keys, k_rope, values = _expand(_gather(kv_cache, block_table, k0, k1), w_uk, w_uv, lora)
        scores = torch.matmul(q_nope, keys.transpose(1, 2)).add_(torch.matmul(q_rope, k_rope.t())).mul_(scale)
        if k1 > q_pos0 + 1:  # some key in this chunk lies after some query
            future = torch.arange(k0, k1)[None, :] > torch.arange(q_pos0, k_end)[:, None]  # [rows, n]
            scores.masked_fill_(future.to(scores.device)[None], float("-inf"))
        new_max = torch.maximum(run_max, scores.amax(-1, keepdim=True))  # finite: every query sees key 0
        probs = scores.sub_(new_max).exp_()  # [H, rows, n]
        rescale = torch.exp(run_max - new_max)
        run_sum = run_sum * rescale + probs.sum(-1, keepdim=True)
        acc = acc.mul_(rescale).add_(torch.matmul(probs, values))  # [H, rows, v]
        run_max = new_max
    return acc.div_(run_sum).transpose(0, 1)  # [rows, H, v]


def _gather(kv_cache: torch.Tensor, block_table: torch.Tensor, start: int, end: int) -> torch.Tensor:
    block_size = kv_cache.shape[1]
    blocks = block_table[start // block_size : -(-end // block_size)].to(torch.int64)
    return as_fp32_rows(kv_cache[blocks].reshape(-1, kv_cache.shape[2])[: end - start])  # [end-start, lora+rope]


def _sequence(q: torch.Tensor, kv_cache: torch.Tensor, w_uk: torch.Tensor, w_uv: torch.Tensor,
              block_table: torch.Tensor, seq_len: int, scale: float) -> torch.Tensor:
    """One sequence's last L queries, non-absorbed: q [L, H, nope+rope] -> [L, H, v] fp32."""
    L, H, _ = q.shape
    nope = w_uk.shape[1]
    block_size = kv_cache.shape[1]
    key_chunk = max(block_size, KEY_CHUNK // block_size * block_size)
    rows = max(1, SCORE_TILE_ELEMS // (H * min(key_chunk, seq_len)))
    qf = q.to(torch.float32).transpose(0, 1)  # [H, L, nope+rope]
    out = torch.empty(L, H, w_uv.shape[1], device=q.device)
    for a in range(0, L, rows):
        b = min(L, a + rows)
        out[a:b] = _attend_rows(qf[:, a:b, :nope], qf[:, a:b, nope:], kv_cache, block_table, seq_len - L + a,
                                w_uk, w_uv, scale, key_chunk)
    return out


def mla_prefill_attention(q: torch.Tensor, kv_cache: torch.Tensor, w_uk: torch.Tensor, w_uv: torch.Tensor,
                          block_tables: torch.Tensor, host: tuple[Sequence[int], Sequence[int]], scale: float,
                          min_queries: int) -> torch.Tensor:
    """See the module docstring. `host`: (cu_seqlens_q, seq_lens) as host ints."""
    T, H, _ = q.shape
    nope, lora = w_uk.shape[1], w_uk.shape[2]
    w_uk32, w_uv32 = w_uk.to(torch.float32), w_uv.to(torch.float32)  # [H, nope, lora], [H, v, lora]
    out = torch.empty(T, H, w_uv.shape[1], dtype=q.dtype, device=q.device)
    bounds, lens = host
    for n, seq_len in enumerate(lens):
        start, end = bounds[n], bounds[n + 1]
        if end - start >= min_queries:
            out[start:end] = _sequence(q[start:end], kv_cache, w_uk32, w_uv32, block_tables[n], seq_len, scale)
        elif end > start:  # the absorbed form: the query into the latent space, the latent output back out
            qn = q[start:end].to(torch.float32)
            q_abs = torch.cat([torch.einsum("thn,hnl->thl", qn[..., :nope], w_uk32), qn[..., nope:]], dim=-1)
            o_latent = torch.empty(end - start, H, lora, device=q.device)
            torch_paged._attend_sequence(q_abs, kv_cache, block_tables[n], seq_len, scale, lora, o_latent)
            out[start:end] = torch.einsum("thl,hvl->thv", o_latent, w_uv32)
    return out
