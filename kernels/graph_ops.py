"""The decode step's cache ops as torch custom ops (`torch.library`), for compiled and captured steps.

Contract: each op calls the registry's implementation for its device (`kernels.registry.get_kernel`) exactly as an
eager step would, and never reads a tensor back to the host. The cache pools are NOT arguments: an op names its
cache by the key `register_cache` returned and its layer by index, and finds the pool tensor there (vLLM's forward
context does the same). So, to `torch.compile`, an op is a pure function of activations and index tensors with one
opaque call — no functionalised copy of a cache pool, no reordering hazard (a layer's cache write and read are one
op) — and a CUDA graph records whatever kernels the implementation launches, on the pools it was captured with.
The model uses them only when a `ForwardBatch` is `traced` (engine/model/batch.py); eager steps call the
implementations directly.

- `register_cache(cache) -> int`: a key for `CacheTensors` (kept while the caller holds the cache).
- `kdamesh::conv_decode(x [N, C], weight [C, W], state_indices [N], cache_key, layer) -> [N, C]`: the layer's conv
  windows shift in place.
- `kdamesh::kda_decode(q, k, g [N, H, K], v [N, H, V], beta [N, H], scale, state_indices [N], cache_key, layer)
  -> [N, H, V]`: the layer's recurrent states advance in place.
- `conv_decode_step(x, weight, state_indices, cache, layer, inline)` / `kda_decode_step(q, k, v, g, beta, scale,
  state_indices, cache, layer, inline)` / `mla_decode_step(q, latent, slot_mapping, block_tables, seq_lens, scale,
  v_dim, cache, layer, inline)`: what a traced layer calls. `inline=False`: the custom ops above.
  `inline=True` (a CPU step compiled by inductor): the registry's torch implementation on the layer's pool,
  traced as plain ops — inductor fuses the gather, the update and the in-place scatter into the pool with the math
  around them (one generated kernel instead of ~10 dispatched ops and a custom-op call), and writes the pool in
  place; MLA inline only while the step's keys fit one gathered tile (longer contexts use the op's split-KV) (no functionalised copy: tests/unit/engine/test_decode_graphs.py checks the pool's storage and values).
  Not for CUDA graphs or the aot_eager backend, which would copy the pool.
- A verification step (engine/decode_graphs.py: every sequence verifies Q = `tokens_per_row` tokens) passes
  `out_slots` [N*Q] to `conv_decode_step` / `kda_decode_step` and Q to `mla_decode_step`: the inline forms only
  (`kernels.conv.torch_ops.causal_conv1d_verify_rows`, `kernels.kda.recurrent.kda_verify_rows`,
  `kernels.attention.torch_paged.verify_attention_one_tile` while the gather fits one tile); the in-slots keep
  their state, each token's goes to its out-slot. The caller runs these steps eager where that does not hold.
- `kdamesh::mla_decode(q [N, H, Dk], latent [N, Dk], slot_mapping [N], block_tables [N, nb], seq_lens [N], scale,
  v_dim, cache_key, layer) -> [N, H, v_dim]`: writes the new latents at `slot_mapping`, then attends (one query per
  sequence) with the registry's `mla_decode_graph` op (Triton on CUDA, torch elsewhere; not FlashInfer, whose
  wrapper plans on the host).
"""

from __future__ import annotations

import weakref

import torch

from kernels.registry import get_kernel

_caches: "weakref.WeakValueDictionary[int, object]" = weakref.WeakValueDictionary()


def register_cache(cache) -> int:
    """A key the ops find `cache` (a `CacheTensors`) by, while it lives."""
    key = id(cache)
    _caches[key] = cache
    return key


def _cache(key: int):
    return _caches[key]


@torch.library.custom_op("kdamesh::conv_decode", mutates_args=())
def conv_decode(x: torch.Tensor, weight: torch.Tensor, state_indices: torch.Tensor, cache_key: int,
                layer: int) -> torch.Tensor:
    pool = _cache(cache_key).conv[layer]
    return get_kernel("conv_decode", x.device)(x, weight, pool, state_indices)


@conv_decode.register_fake
def _conv_decode_fake(x, weight, state_indices, cache_key, layer):
    return torch.empty_like(x)


@torch.library.custom_op("kdamesh::kda_decode", mutates_args=())
def kda_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, scale: float,
               state_indices: torch.Tensor, cache_key: int, layer: int) -> torch.Tensor:
    pool = _cache(cache_key).recurrent[layer]
    return get_kernel("kda_decode", q.device)(q, k, v, g, beta, scale, pool, state_indices)


@kda_decode.register_fake
def _kda_decode_fake(q, k, v, g, beta, scale, state_indices, cache_key, layer):
    return v.new_empty(v.shape)


def conv_decode_step(x: torch.Tensor, weight: torch.Tensor, state_indices: torch.Tensor, cache, layer: int,
                     inline: bool, out_slots: torch.Tensor | None = None) -> torch.Tensor:
    """x [N, C] -> [N, C]; the layer's conv windows shift in place (see the module docstring). With `out_slots`
    [T] a verification: x [T, C], T // N tokens per sequence."""
    if out_slots is not None:
        from kernels.conv.torch_ops import causal_conv1d_verify_rows

        _require_inline(inline)
        tokens_per_row = x.shape[0] // state_indices.shape[0]
        return causal_conv1d_verify_rows(x, weight, cache.conv[layer], state_indices, out_slots, tokens_per_row)
    if inline:
        return get_kernel("conv_decode", x.device)(x, weight, cache.conv[layer], state_indices)
    return conv_decode(x, weight, state_indices, cache.graph_key, layer)


def kda_decode_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                    scale: float, state_indices: torch.Tensor, cache, layer: int, inline: bool,
                    out_slots: torch.Tensor | None = None) -> torch.Tensor:
    """-> o [N, H, V]; the layer's recurrent states advance in place (see the module docstring). With `out_slots`
    [T] a verification: o [T, H, V], T // N tokens per sequence."""
    if out_slots is not None:
        from kernels.kda.recurrent import kda_verify_rows

        _require_inline(inline)
        tokens_per_row = q.shape[0] // state_indices.shape[0]
        return kda_verify_rows(q, k, v, g, beta, scale, cache.recurrent[layer], state_indices, out_slots,
                               tokens_per_row)
    if inline:
        return get_kernel("kda_decode", q.device)(q, k, v, g, beta, scale, cache.recurrent[layer], state_indices)
    return kda_decode(q, k, v, g, beta, scale, state_indices, cache.graph_key, layer)


@torch.library.custom_op("kdamesh::mla_decode", mutates_args=())
def mla_decode(q: torch.Tensor, latent: torch.Tensor, slot_mapping: torch.Tensor, block_tables: torch.Tensor,
               seq_lens: torch.Tensor, scale: float, v_dim: int, cache_key: int, layer: int) -> torch.Tensor:
    from kernels.attention.torch_paged import write_kv_cache

    kv_cache = _cache(cache_key).kv[layer]
    write_kv_cache(kv_cache, slot_mapping, latent)
    cu = torch.arange(q.shape[0] + 1, dtype=torch.int64, device=q.device)  # one query per sequence
    return get_kernel("mla_decode_graph", q.device)(q, kv_cache, block_tables, cu, seq_lens, scale, v_dim)


def mla_decode_step(q: torch.Tensor, latent: torch.Tensor, slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                    seq_lens: torch.Tensor, scale: float, v_dim: int, cache, layer: int,
                    inline: bool) -> torch.Tensor:
    """-> [T, H, v_dim]: writes the new latents, then attends (see the module docstring). Inline only while the
    step's gather fits one tile (a guard on the table's width: wider tables compile once more, to the op). More
    tokens than sequences: a verification, T // N tokens per sequence (inline and one tile only)."""
    from kernels.attention.torch_paged import (decode_attention_one_tile, fits_one_tile, verify_attention_one_tile,
                                               write_kv_cache)

    kv_cache = cache.kv[layer]
    tokens_per_row = q.shape[0] // seq_lens.shape[0]
    if tokens_per_row > 1:
        _require_inline(inline and fits_one_tile(seq_lens.shape[0], block_tables, kv_cache))
        write_kv_cache(kv_cache, slot_mapping, latent)
        return verify_attention_one_tile(q, kv_cache, block_tables, seq_lens, tokens_per_row, scale,
                                         v_dim).to(q.dtype)
    if inline and fits_one_tile(q.shape[0], block_tables, kv_cache):
        write_kv_cache(kv_cache, slot_mapping, latent)
        return decode_attention_one_tile(q, kv_cache, block_tables, seq_lens, scale, v_dim).to(q.dtype)
    return mla_decode(q, latent, slot_mapping, block_tables, seq_lens, scale, v_dim, cache.graph_key, layer)


@mla_decode.register_fake
def _mla_decode_fake(q, latent, slot_mapping, block_tables, seq_lens, scale, v_dim, cache_key, layer):
    return q.new_empty(q.shape[0], q.shape[1], v_dim)


def _require_inline(inline: bool) -> None:
    if not inline:
        raise NotImplementedError("a compiled verification step needs the inline cache ops (CPU, inductor) and an "
                                  "MLA gather of one tile; the decode graphs run other verifications eager")
