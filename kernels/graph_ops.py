"""The decode step's cache ops as torch custom ops (`torch.library`), for compiled and captured steps.

Contract: each op below calls the registry's implementation for its device (`kernels.registry.get_kernel`) with the
same arguments and results as calling that implementation directly, and never reads a tensor back to the host. As
custom ops with declared mutations (`mutates_args`), `torch.compile` keeps each one as a single opaque call whose
pool writes stay in place (no functionalised copy of a cache pool), and a CUDA graph records whatever kernels the
implementation launches. The model uses them only when a `ForwardBatch` is `traced` (engine/model/batch.py); eager
steps call the implementations directly (a custom op's dispatch costs a few microseconds more per call).

- `kdamesh::conv_decode(x [N, C], weight [C, W], conv_state_pool! [S, C, W-1], state_indices [N]) -> [N, C]`
- `kdamesh::kda_decode(q, k, g [N, H, K], v [N, H, V], beta [N, H], scale, state_pool! [S, H, K, V], state_indices
  [N]) -> [N, H, V]`
- `kdamesh::write_kv(kv_cache! [B, bs, Dk], slot_mapping [T], latent [T, Dk]) -> ()`
- `kdamesh::mla_decode(q [N, H, Dk], kv_cache, block_tables [N, nb], seq_lens [N], scale, v_dim) -> [N, H, v_dim]`
  (one query per sequence; `cu_seqlens` is implied): the registry's `mla_decode_graph` op (Triton on CUDA, torch
  elsewhere; not FlashInfer, whose wrapper plans on the host).
"""

from __future__ import annotations

import torch

from kernels.registry import get_kernel


@torch.library.custom_op("kdamesh::conv_decode", mutates_args=("conv_state_pool",))
def conv_decode(x: torch.Tensor, weight: torch.Tensor, conv_state_pool: torch.Tensor,
                state_indices: torch.Tensor) -> torch.Tensor:
    return get_kernel("conv_decode", x.device)(x, weight, conv_state_pool, state_indices)


@conv_decode.register_fake
def _conv_decode_fake(x, weight, conv_state_pool, state_indices):
    return torch.empty_like(x)


@torch.library.custom_op("kdamesh::kda_decode", mutates_args=("state_pool",))
def kda_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, scale: float,
               state_pool: torch.Tensor, state_indices: torch.Tensor) -> torch.Tensor:
    return get_kernel("kda_decode", q.device)(q, k, v, g, beta, scale, state_pool, state_indices)


@kda_decode.register_fake
def _kda_decode_fake(q, k, v, g, beta, scale, state_pool, state_indices):
    return v.new_empty(v.shape)


@torch.library.custom_op("kdamesh::write_kv", mutates_args=("kv_cache",))
def write_kv(kv_cache: torch.Tensor, slot_mapping: torch.Tensor, latent: torch.Tensor) -> None:
    from kernels.attention.torch_paged import write_kv_cache

    write_kv_cache(kv_cache, slot_mapping, latent)


@write_kv.register_fake
def _write_kv_fake(kv_cache, slot_mapping, latent):
    return None


@torch.library.custom_op("kdamesh::mla_decode", mutates_args=())
def mla_decode(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
               scale: float, v_dim: int) -> torch.Tensor:
    n = q.shape[0]
    cu = torch.arange(n + 1, dtype=torch.int64, device=q.device)  # one query per sequence
    return get_kernel("mla_decode_graph", q.device)(q, kv_cache, block_tables, cu, seq_lens, scale, v_dim)


@mla_decode.register_fake
def _mla_decode_fake(q, kv_cache, block_tables, seq_lens, scale, v_dim):
    return q.new_empty(q.shape[0], q.shape[1], v_dim)
