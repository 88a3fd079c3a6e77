"""FlashInfer MLA backend: `flashinfer.mla.BatchMLAPagedAttentionWrapper` over our paged latent cache (CUDA only).

Contract: same signature and result as `kernels.attention.torch_paged.mla_paged_attention`. The cache entry
`[c, k_rope]` is split into `ckv = kv_cache[..., :v_dim]` and `kpe = kv_cache[..., v_dim:]` (strided views, no copy),
the query into `q_nope = q[..., :v_dim]` and `q_pe = q[..., v_dim:]`. Pages come from `block_tables` (the first
`ceil(seq_lens[n] / block_size)` entries of row n); FlashInfer's causal mask is aligned to the end of each sequence,
which is our "queries are the last q_len positions" rule.

flashinfer is imported inside the call (the registry only picks this backend on CUDA when flashinfer imports). The
128 MiB workspace and ONE `BatchMLAPagedAttentionWrapper` per device are created on first use (`_Planner`), and the
wrapper is planned once per step for all MLA layers: every layer of a step passes the same metadata tensors
(`block_tables`, `seq_lens`, `cu_seqlens_q`, built once per step by the runner), so a plan is kept while those
objects and their in-place versions are unchanged (the planner holds them, so their ids cannot be reused by a
later step's tensors). The plan builds the CSR page list with one boolean-mask index (a host sync), once per step;
captured decode steps use the `mla_decode_graph` op instead (Triton, reads `seq_lens` on the device).

An FP8 latent cache (per-token scales, kernels/attention/fp8_latent.py) is not a layout FlashInfer's MLA wrapper
reads: those calls go to the Triton kernel, with one warning.
"""

from __future__ import annotations

from collections.abc import Sequence

import logging
from functools import cache

import torch

from kernels.attention.fp8_latent import is_fp8_cache

log = logging.getLogger(__name__)

WORKSPACE_BYTES = 128 * 1024 * 1024


@cache
def _workspace(device: torch.device) -> torch.Tensor:
    return torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)


def paged_kv_indices(
    block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashInfer's CSR page layout: (kv_indptr [N+1] int32, kv_indices [sum pages] int32) from block tables."""
    pages = (seq_lens.to(torch.int64) + block_size - 1) // block_size  # [N]
    kv_indptr = torch.cat([pages.new_zeros(1), torch.cumsum(pages, 0)]).to(torch.int32)
    used = torch.arange(block_tables.shape[1], device=block_tables.device)[None, :] < pages[:, None]  # [N, MB]
    kv_indices = block_tables[used].to(torch.int32)  # row-major: each sequence's pages contiguous, in order
    return kv_indptr, kv_indices


class _Planner:
    """One wrapper per device, planned once per step's metadata (see the module docstring)."""

    def __init__(self, device: torch.device):
        import flashinfer  # noqa: PLC0415 - CUDA-only dependency, imported on use

        self.wrapper = flashinfer.mla.BatchMLAPagedAttentionWrapper(_workspace(device))
        self.planned: tuple = ()  # (metadata tensors, their versions, the other plan arguments)
        self.num_plans = 0

    def plan(self, q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor,
             seq_lens: torch.Tensor, scale: float, v_dim: int):
        tensors = (block_tables, seq_lens, cu_seqlens_q)
        key = (tuple(t._version for t in tensors), q.shape[1], v_dim, kv_cache.shape, scale, q.dtype, kv_cache.dtype)
        if self.planned and all(a is b for a, b in zip(self.planned[0], tensors)) and self.planned[1] == key:
            return self.wrapper
        block_size = kv_cache.shape[1]
        kv_indptr, kv_indices = paged_kv_indices(block_tables, seq_lens, block_size)
        self.wrapper.plan(cu_seqlens_q.to(torch.int32), kv_indptr, kv_indices, seq_lens.to(torch.int32), q.shape[1],
                          v_dim, kv_cache.shape[2] - v_dim, block_size, True, scale, q.dtype, kv_cache.dtype)
        self.planned = (tensors, key)
        self.num_plans += 1
        return self.wrapper


@cache
def planner(device: torch.device) -> _Planner:
    return _Planner(device)


def mla_paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor,
                        seq_lens: torch.Tensor, scale: float, v_dim: int,
                        host: tuple[Sequence[int], Sequence[int]] | None = None) -> torch.Tensor:
    """`host` (the torch op's host copy of cu_seqlens_q / seq_lens) is not needed here."""
    if is_fp8_cache(kv_cache):
        return _fp8_fallback()(q, kv_cache, block_tables, cu_seqlens_q, seq_lens, scale, v_dim)
    wrapper = planner(q.device).plan(q, kv_cache, block_tables, cu_seqlens_q, seq_lens, scale, v_dim)
    q_nope, q_pe = q[..., :v_dim], q[..., v_dim:]
    ckv, kpe = kv_cache[..., :v_dim], kv_cache[..., v_dim:]
    return wrapper.run(q_nope, q_pe, ckv, kpe, return_lse=False)


@cache
def _fp8_fallback():
    log.warning("flashinfer MLA does not read kdamesh's FP8 latent rows (per-token scales): FP8 caches use the "
                "Triton MLA kernel")
    from kernels.attention.triton_paged import mla_paged_attention as triton_mla  # noqa: PLC0415 - on use

    return triton_mla
