"""Split-KV decode attention (kernels/attention/split_kv.py and the decode paths of torch_paged / triton_paged):
`merge_partials` against its naive reference and a softmax over the concatenated context, the split choice, and
split decodes against the unsplit path and the naive oracle — contexts of different lengths (shorter than a split,
so some splits are empty), block sizes 4 and 16, model-dtype and FP8 caches poisoned with NaN where nothing was
written; Triton under TRITON_INTERPRET=1 in one child (tests/triton_child.py)."""

import pytest
import torch

from kernels.attention import split_kv, torch_paged
from kernels.attention.naive import merge_partials_naive, mla_paged_attention_naive
from tests import triton_child
from tests.unit.kernels.test_mla_attention import DK, KV_LORA, SCALE, _batch
from tests.unit.kernels.test_mla_fp8 import _fp8_batch

DECODES = [33, 3, 70, 9, 48]  # one query each; 3 and 9 are shorter than one split at block_size 4 and 16
SPLIT_EDGES = [0, 5, 5, 12, 30]  # key positions cutting a 30-key context into 4 splits, one of them empty


def _partials(scores, values, edges):
    """Each split's normalised output and log-sum-exp: scores [N, H, K], values [K, V] -> o [S, N, H, V], lse."""
    outs, lses = [], []
    for a, b in zip(edges[:-1], edges[1:], strict=True):
        part = scores[..., a:b]
        lse = torch.logsumexp(part, -1) if b > a else torch.full(scores.shape[:2], float("-inf"))
        o = torch.softmax(part, -1) @ values[a:b] if b > a else torch.full((*scores.shape[:2], values.shape[1]),
                                                                           float("nan"))  # ignored: empty
        outs.append(o)
        lses.append(lse)
    return torch.stack(outs), torch.stack(lses)


def test_merge_partials_equals_softmax_over_the_whole_context():
    torch.manual_seed(0)
    scores, values = torch.randn(3, 4, 30) * 4, torch.randn(30, 8)
    whole = torch.softmax(scores, -1) @ values  # [N, H, V]
    o, lse = _partials(scores, values, SPLIT_EDGES)
    merged = split_kv.merge_partials(o, lse)
    assert not merged.isnan().any(), "an empty split's partial leaked into the merge"
    torch.testing.assert_close(merged, whole, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(merge_partials_naive(o, lse), whole, atol=1e-5, rtol=1e-5)


def test_negative_control_dropping_a_split_changes_the_merge():
    torch.manual_seed(1)
    scores, values = torch.randn(3, 4, 30) * 4, torch.randn(30, 8)
    o, lse = _partials(scores, values, SPLIT_EDGES)
    whole = split_kv.merge_partials(o, lse)
    lse_dropped = lse.clone()
    lse_dropped[3] = float("-inf")  # the last split (keys 12..29) as if it were empty
    assert not torch.allclose(split_kv.merge_partials(o, lse_dropped), whole, atol=1e-3)


def test_merge_of_rows_without_any_key_is_zero():
    o = torch.full((2, 1, 1, 3), float("nan"))
    lse = torch.full((2, 1, 1), float("-inf"))
    assert torch.equal(split_kv.merge_partials(o, lse), torch.zeros(1, 1, 3))


def test_split_count_follows_context_and_programs():
    choose = split_kv.choose_num_splits
    assert choose(1 << 20, programs=2) == split_kv.MAX_SPLITS  # one sequence at 1M context: many splits
    assert choose(1 << 20, programs=split_kv.TARGET_PROGRAMS) == 1  # the batch already fills the device
    assert choose(2048, programs=2) == 2048 // split_kv.MIN_SPLIT_KEYS  # no split shorter than MIN_SPLIT_KEYS
    assert choose(100, programs=1) == 1
    assert choose(8192, programs=20) == 14  # ceil(264 / 20)


def _torch_decode(q, cache, tables, lens, key_elems, monkeypatch):
    monkeypatch.setattr(torch_paged, "DECODE_KEY_ELEMS", key_elems)
    cu = torch.arange(q.shape[0] + 1, dtype=torch.int32)
    return torch_paged.mla_paged_attention(q, cache, tables, cu, lens, SCALE, KV_LORA)


@pytest.mark.parametrize("fp8", [False, True], ids=["fp32", "fp8"])
@pytest.mark.parametrize("block_size", [4, 16])
def test_torch_split_decode_equals_unsplit_and_naive(monkeypatch, block_size, fp8):
    torch.manual_seed(2)
    if fp8:
        q, cache, oracle, tables, cu, lens = _fp8_batch(DECODES, [1] * len(DECODES), H=4, block_size=block_size)
    else:
        q, cache, tables, cu, lens, _ = _batch(DECODES, [1] * len(DECODES), H=4, block_size=block_size)
        oracle = cache
    merges = []
    real_merge = torch_paged.merge_partials
    monkeypatch.setattr(torch_paged, "merge_partials", lambda o, lse: merges.append(o.shape[0]) or real_merge(o, lse))
    row = cache.shape[2]
    split = _torch_decode(q, cache, tables, lens, 2 * block_size * row, monkeypatch)  # 2 blocks per split
    assert merges and set(merges) == {-(-tables.shape[1] // 2)}, "the split path did not run"
    merged = len(merges)
    unsplit = _torch_decode(q, cache, tables, lens, 1 << 24, monkeypatch)
    assert len(merges) == merged, "the unsplit path merged"
    ref = mla_paged_attention_naive(q, oracle, tables, cu, lens, SCALE, KV_LORA)
    assert not split.isnan().any(), "poisoned cache entries leaked into the split output"
    torch.testing.assert_close(split, unsplit, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(split, ref, atol=1e-5, rtol=1e-5)


def test_torch_split_groups_of_sequences(monkeypatch):
    """Splits of 3 blocks with sequences in groups of 2 (the tile holds two sequences' splits)."""
    torch.manual_seed(3)
    q, cache, tables, cu, lens, _ = _batch(DECODES, [1] * len(DECODES), H=2, block_size=4)
    out = _torch_decode(q, cache, tables, lens, 6 * 4 * DK + 1, monkeypatch)
    torch.testing.assert_close(out, mla_paged_attention_naive(q, cache, tables, cu, lens, SCALE, KV_LORA),
                               atol=1e-5, rtol=1e-5)


# --- Triton checks: one TRITON_INTERPRET=1 child for the module --------------------------------------------------

TRITON_CHECKS = triton_child.ChildChecks(__name__)
triton_check = TRITON_CHECKS.check


def _triton_split_matches(q, cache, oracle, tables, lens, num_splits):
    triton_mla = triton_child.import_interpreted("kernels.attention.triton_paged", "_mla_paged_kernel")
    cu = torch.arange(q.shape[0] + 1, dtype=torch.int32)
    split = triton_mla.mla_paged_attention(q, cache, tables, cu, lens, SCALE, KV_LORA, num_splits=num_splits)
    unsplit = triton_mla.mla_paged_attention(q, cache, tables, cu, lens, SCALE, KV_LORA, num_splits=1)
    ref = mla_paged_attention_naive(q, oracle, tables, cu, lens, SCALE, KV_LORA)
    assert not split.isnan().any(), "poisoned cache entries leaked into the split output"
    torch.testing.assert_close(split, unsplit, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(split, ref, atol=1e-5, rtol=1e-5)


@triton_check
def triton_split_decodes_block4():
    q, cache, tables, _, lens, _ = _batch([33, 3, 70], [1, 1, 1], H=3, block_size=4)
    _triton_split_matches(q, cache, cache, tables, lens, num_splits=4)  # 32-key splits: 3 keys leave 3 empty


@triton_check
def triton_split_decodes_fp8_block16():
    q, cache, oracle, tables, _, lens = _fp8_batch([70, 9, 17], [1, 1, 1], H=5, block_size=16)
    _triton_split_matches(q, cache, oracle, tables, lens, num_splits=4)  # 32-key splits


@triton_check
def triton_split_refused_for_prefill():
    triton_mla = triton_child.import_interpreted("kernels.attention.triton_paged", "_mla_paged_kernel")
    q, cache, tables, cu, lens, _ = _batch([9, 4], [3, 1], H=2, block_size=4)
    with pytest.raises(ValueError, match="num_splits=2"):
        triton_mla.mla_paged_attention(q, cache, tables, cu, lens, SCALE, KV_LORA, num_splits=2)


test_triton_interpreted = TRITON_CHECKS.pytest_test()
