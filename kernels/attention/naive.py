"""Readable reference for MLA attention over a paged latent cache (absorbed form: MQA with one shared KV head).

Contract:
`mla_paged_attention_naive(q [T, H, Dk], kv_cache [num_blocks, block_size, Dk], block_tables [N, MB] int32,
 cu_seqlens_q [N+1], seq_lens [N], scale, v_dim) -> o [T, H, v_dim]`

- Each cache entry is `[c (v_dim = kv_lora channels), k_rope]`; the key is the whole entry, the value its first
  `v_dim` channels. Token position p of sequence n lives at `kv_cache[block_tables[n, p // bs], p % bs]`.
- The queries of sequence n (`q[cu_seqlens_q[n]:cu_seqlens_q[n+1]]`) are its LAST q_len positions
  `seq_lens[n]-q_len .. seq_lens[n]-1` (their latents are already in the cache); causal: position p attends 0..p.
- Scores and softmax in fp32; `o` in `q.dtype`. Cache entries past `seq_lens[n]` are never read.
- An FP8 cache (uint8 rows, `kernels.attention.fp8_latent`) holds `Dk` e4m3 values and a scale per entry; its
  entries are dequantised before use.
"""

from __future__ import annotations

import torch

from kernels.attention.fp8_latent import as_fp32_rows


def gather_sequence_kv(kv_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The first `seq_len` cache entries of one sequence, contiguous: [seq_len, Dk]."""
    block_size = kv_cache.shape[1]
    num_blocks = -(-seq_len // block_size)
    blocks = block_table[:num_blocks].to(torch.int64)
    return kv_cache[blocks].reshape(num_blocks * block_size, kv_cache.shape[2])[:seq_len]


def mla_paged_attention_naive(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                              cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                              v_dim: int) -> torch.Tensor:
    T, H, _ = q.shape
    out = torch.empty(T, H, v_dim, dtype=q.dtype, device=q.device)
    bounds = cu_seqlens_q.tolist()
    for n, seq_len in enumerate(seq_lens.tolist()):
        start, end = bounds[n], bounds[n + 1]
        q_len = end - start
        if q_len == 0:
            continue
        kv = as_fp32_rows(gather_sequence_kv(kv_cache, block_tables[n], seq_len))  # [S, Dk] fp32
        qn = q[start:end].to(torch.float32)  # [L, H, Dk]
        scores = torch.einsum("lhd,sd->lhs", qn, kv) * scale  # [L, H, S]
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)  # [L]
        k_pos = torch.arange(seq_len, device=q.device)  # [S]
        future = k_pos[None, :] > q_pos[:, None]  # [L, S]
        scores = scores.masked_fill(future[:, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[start:end] = torch.einsum("lhs,sd->lhd", probs, kv[:, :v_dim]).to(q.dtype)
    return out


def merge_partials_naive(o: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """Reference for `kernels.attention.split_kv.merge_partials`: o [S, N, H, V], lse [S, N, H] -> [N, H, V] fp32,
    each split weighted by its share exp(lse_s - logsumexp(lse)) of the whole softmax denominator."""
    S, N, H, V = o.shape
    out = torch.zeros(N, H, V, device=o.device)
    for n in range(N):
        for h in range(H):
            total = torch.logsumexp(lse[:, n, h].double(), 0)
            for s in range(S):
                if lse[s, n, h] > float("-inf"):
                    out[n, h] += (torch.exp(lse[s, n, h].double() - total) * o[s, n, h].double()).float()
    return out
