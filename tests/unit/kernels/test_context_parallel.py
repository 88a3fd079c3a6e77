"""Decode-context parallelism's kernels (kernels/attention/context_parallel.py) against the naive MLA attention:
N ranks' caches built from one replicated cache by the token layout, each rank's partial (o, lse) merged with the
log-sum-exp equals attention over the whole context — decode batches (with context splits) and prefill chunks over
cached context. Negative controls: merging without the LSE correction, and a rank reading another's token share."""

from __future__ import annotations

import pytest
import torch

from kernels.attention import torch_paged
from kernels.attention.context_parallel import (gather_blocks, local_write_slots, owner_and_local_slot,
                                                partial_attention, scatter_blocks)
from kernels.attention.fp8_latent import allocate_latent_cache
from kernels.attention.naive import mla_paged_attention_naive
from kernels.attention.split_kv import merge_partials

H, DK, V, BS, NUM_BLOCKS = 4, 24, 16, 8, 40


def _setup(seed: int, seq_lens: list[int], q_lens: list[int]):
    g = torch.Generator().manual_seed(seed)
    cache = torch.randn(NUM_BLOCKS, BS, DK, generator=g)
    perm = torch.randperm(NUM_BLOCKS, generator=g).to(torch.int32)
    width = max(-(-s // BS) for s in seq_lens)
    tables = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    at = 0
    for n, s in enumerate(seq_lens):
        k = -(-s // BS)
        tables[n, :k] = perm[at: at + k]
        at += k
    cu = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int64)
    q = torch.randn(int(cu[-1]), H, DK, generator=g)
    return q, cache, tables, cu, torch.tensor(seq_lens)


def _rank_caches(cache: torch.Tensor, size: int) -> list[torch.Tensor]:
    """Each rank's local cache, built by writing every slot's latent through `local_write_slots`."""
    slots = torch.arange(NUM_BLOCKS * BS)
    latents = cache.reshape(-1, DK)
    out = []
    for r in range(size):
        local = torch.full((NUM_BLOCKS + 1, BS // size, DK), float("nan"))  # NaN: an unwritten row would show
        scratch = NUM_BLOCKS * (BS // size)
        torch_paged.write_kv_cache(local, local_write_slots(slots, r, size, scratch), latents)
        local[-1] = 0.0
        out.append(local)
    return out


def _dcp(q, caches, tables, cu, lens, size, lse_fix=True, shift=0):
    parts = [partial_attention(q, caches[(r + shift) % size], tables, cu, lens, 0.3, V, r, size)
             for r in range(size)]
    o = torch.stack([p[0] for p in parts])
    lse = torch.stack([p[1] for p in parts])
    if not lse_fix:  # negative control: each rank's normalised output averaged, the LSE ignored
        return o.mean(0)
    return merge_partials(o, lse)


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("kind", ["decode", "prefill"])
def test_merged_partials_equal_whole_context_attention(size, kind):
    seq_lens = [1, 3, 37, 90] if kind == "decode" else [1, 21, 90]
    q_lens = [1] * 4 if kind == "decode" else [1, 21, 13]  # whole prompt, a chunk over cached context
    q, cache, tables, cu, lens = _setup(size, seq_lens, q_lens)
    want = mla_paged_attention_naive(q, cache, tables, cu, lens, 0.3, V)
    caches = _rank_caches(cache, size)
    got = _dcp(q, caches, tables, cu, lens, size)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert (got - _dcp(q, caches, tables, cu, lens, size, lse_fix=False)).abs().max() > 1e-2
    assert (got - _dcp(q, caches, tables, cu, lens, size, shift=1)).abs().max() > 1e-2


def test_decode_splits_over_a_long_local_context(monkeypatch):
    """Forces several context splits per rank: their (o, lse) pairs merge before the ranks' merge."""
    monkeypatch.setattr("kernels.attention.context_parallel.DECODE_KEY_ELEMS", 2 * (BS // 2) * DK)
    q, cache, tables, cu, lens = _setup(3, [70, 33], [1, 1])
    want = mla_paged_attention_naive(q, cache, tables, cu, lens, 0.3, V)
    torch.testing.assert_close(_dcp(q, _rank_caches(cache, 2), tables, cu, lens, 2), want, atol=1e-5, rtol=1e-5)


def test_fp8_rank_caches_equal_the_replicated_fp8_cache():
    """FP8 rows move between layouts as bytes: the DCP result equals the replicated FP8 cache's."""
    q, cache, tables, cu, lens = _setup(4, [45, 17], [1, 1])
    fp8 = allocate_latent_cache(NUM_BLOCKS, BS, DK, True, torch.float32, "cpu")
    torch_paged.write_kv_cache(fp8, torch.arange(NUM_BLOCKS * BS), cache.reshape(-1, DK))
    want = mla_paged_attention_naive(q, fp8, tables, cu, lens, 0.3, V)
    caches = [torch.cat([scatter_blocks(fp8, r, 2), torch.zeros(1, BS // 2, fp8.shape[-1], dtype=torch.uint8)])
              for r in range(2)]
    torch.testing.assert_close(_dcp(q, caches, tables, cu, lens, 2), want, atol=1e-5, rtol=1e-5)


def test_layout_round_trips_and_matches_the_write_rule():
    cache = torch.randn(NUM_BLOCKS, BS, DK)
    parts = [scatter_blocks(cache, r, 4) for r in range(4)]
    assert torch.equal(gather_blocks(parts), cache)
    rank_caches = _rank_caches(cache, 4)
    assert all(torch.equal(rank_caches[r][:NUM_BLOCKS], parts[r]) for r in range(4))
    owner, local = owner_and_local_slot(torch.tensor([0, 1, 5, 8, 13]), 4)
    assert owner.tolist() == [0, 1, 1, 0, 1] and local.tolist() == [0, 0, 1, 2, 3]
    assert parts[0].numel() * 4 == cache.numel()  # a rank's rows: exactly a quarter of the bytes
