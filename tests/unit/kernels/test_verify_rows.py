"""The compiled verification step's kernels (every sequence verifies Q tokens: `causal_conv1d_verify_rows`,
`kda_verify_rows`, `verify_attention_one_tile`) against the eager ops' oracles: outputs, and the state kept after
every token in its out-slot; in-slots and unnamed slots untouched; the causal mask is needed (negative control)."""

from __future__ import annotations

import torch

from kernels.attention.naive import mla_paged_attention_naive
from kernels.attention.torch_paged import verify_attention_one_tile, write_kv_cache
from kernels.conv.naive import causal_conv1d_verify_naive
from kernels.conv.torch_ops import causal_conv1d_verify_rows
from kernels.kda.naive import kda_verify_naive
from kernels.kda.recurrent import kda_verify_rows

N, Q, H, D, C, W, S = 3, 4, 2, 8, 12, 4, 16
IN_SLOTS = torch.tensor([0, 5, 2])
OUT_SLOTS = torch.tensor([6, 7, 8, 9, 10, 11, 12, 13, 1, 3, 4, 14])  # N*Q distinct, none an in-slot
CU = torch.arange(0, N * Q + 1, Q)


def test_conv_verify_rows_matches_the_oracle():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(N * Q, C, generator=g), torch.randn(C, W, generator=g)
    pool = torch.randn(S, C, W - 1, generator=g)
    ref_pool = pool.clone()
    y = causal_conv1d_verify_rows(x, w, pool, IN_SLOTS, OUT_SLOTS, Q)
    y_ref = causal_conv1d_verify_naive(x, w, ref_pool, IN_SLOTS, CU, OUT_SLOTS)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pool, ref_pool, rtol=1e-5, atol=1e-5)
    assert torch.equal(pool[IN_SLOTS], ref_pool[IN_SLOTS]) and torch.equal(pool[15], ref_pool[15])


def test_kda_verify_rows_matches_the_oracle():
    g = torch.Generator().manual_seed(1)
    q = torch.nn.functional.normalize(torch.randn(N * Q, H, D, generator=g), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(N * Q, H, D, generator=g), dim=-1)
    v = torch.randn(N * Q, H, D, generator=g)
    gate = -torch.rand(N * Q, H, D, generator=g)
    beta = torch.rand(N * Q, H, generator=g)
    pool = torch.randn(S, H, D, D, generator=g)
    ref_pool = pool.clone()
    o = kda_verify_rows(q, k, v, gate, beta, D ** -0.5, pool, IN_SLOTS, OUT_SLOTS, Q)
    o_ref = kda_verify_naive(q, k, v, gate, beta, D ** -0.5, ref_pool, IN_SLOTS, CU, OUT_SLOTS)
    torch.testing.assert_close(o, o_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pool, ref_pool, rtol=1e-5, atol=1e-5)
    assert torch.equal(pool[IN_SLOTS], ref_pool[IN_SLOTS]) and torch.equal(pool[15], ref_pool[15])


def _attention_case(seed: int):
    g = torch.Generator().manual_seed(seed)
    block_size, dk, v_dim, blocks = 4, 10, 8, 12
    kv_cache = torch.randn(blocks, block_size, dk, generator=g)
    seq_lens = torch.tensor([9, Q, 14])  # the second sequence is only its verified tokens
    tables = torch.tensor([[3, 7, 1, 0], [5, 0, 0, 0], [2, 8, 9, 4]], dtype=torch.int32)
    q = torch.randn(N * Q, H, dk, generator=g)
    latent = torch.randn(N * Q, dk, generator=g)
    slots = torch.tensor([int(tables[n, p // block_size]) * block_size + p % block_size
                          for n, length in enumerate(seq_lens.tolist()) for p in range(length - Q, length)])
    write_kv_cache(kv_cache, slots, latent)
    return q, kv_cache, tables, seq_lens, v_dim


def test_verify_attention_matches_the_oracle():
    q, kv_cache, tables, seq_lens, v_dim = _attention_case(2)
    o = verify_attention_one_tile(q, kv_cache, tables, seq_lens, Q, 0.3, v_dim)
    o_ref = mla_paged_attention_naive(q, kv_cache, tables, CU, seq_lens, 0.3, v_dim)
    torch.testing.assert_close(o, o_ref.float(), rtol=1e-5, atol=1e-5)


def test_verify_attention_needs_its_causal_mask():
    """Negative control: the oracle with every query seeing its whole row (no causal mask) differs from it."""
    q, kv_cache, tables, seq_lens, v_dim = _attention_case(2)
    o = verify_attention_one_tile(q, kv_cache, tables, seq_lens, Q, 0.3, v_dim)
    each_query = torch.arange(N * Q + 1)  # every query its own sequence over the row's full length
    unmasked = mla_paged_attention_naive(q, kv_cache, tables.repeat_interleave(Q, 0), each_query,
                                         seq_lens.repeat_interleave(Q), 0.3, v_dim)
    assert not torch.allclose(o, unmasked.float(), atol=1e-3)
