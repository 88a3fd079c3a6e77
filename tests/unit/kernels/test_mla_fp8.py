"""The FP8 latent cache (kernels/attention/fp8_latent.py): the row format, and the torch and Triton (interpreter)
MLA kernels over FP8 rows against the naive oracle run on the dequantised latents."""

import pytest
import torch

from kernels.attention import torch_paged
from kernels.attention.fp8_latent import FP8_MAX, SCALE_BYTES, dequantize_rows, latent_dim, quantize_rows
from kernels.attention.naive import mla_paged_attention_naive
from tests import triton_child

KV_LORA, ROPE = 32, 16
DK = KV_LORA + ROPE
SCALE = DK**-0.5
MIXED = dict(seq_lens=[19, 7, 33, 1, 16], q_lens=[19, 1, 6, 1, 16])  # prefill, decode, continued prefill, ...
DECODES = dict(seq_lens=[5, 40, 17], q_lens=[1, 1, 1])


def test_rows_round_trip_within_e4m3_precision():
    torch.manual_seed(0)
    latent = torch.randn(64, DK) * torch.logspace(-3, 3, 64)[:, None]  # rows of very different magnitudes
    latent[5] = 0.0
    rows = quantize_rows(latent)
    assert rows.dtype == torch.uint8 and rows.shape == (64, DK + SCALE_BYTES)
    back = dequantize_rows(rows)
    row_max = latent.abs().amax(-1, keepdim=True).clamp(min=1e-30)
    assert ((back - latent).abs() / row_max).max() <= 2**-4  # e4m3: 3 mantissa bits, each row scaled to its max
    assert back[5].abs().max() == 0.0
    assert torch.equal(quantize_rows(latent), rows)  # deterministic bytes: handoffs can be compared exactly
    assert dequantize_rows(rows).abs().amax(-1).le(row_max.squeeze(-1) * (1 + 2**-4)).all()
    assert latent_dim(rows) == DK and float(FP8_MAX) == 448.0


def _fp8_batch(seq_lens, q_lens, H, block_size, spare_blocks=5):
    """An FP8 cache poisoned with 0xFF (e4m3 NaN values, NaN scales) holding each sequence's latents through
    shuffled block tables, written by `write_kv_cache`; also the dequantised latents for the oracle."""
    latents = [torch.randn(s, DK) for s in seq_lens]
    needed = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(needed) + spare_blocks
    cache = torch.full((num_blocks, block_size, DK + SCALE_BYTES), 255, dtype=torch.uint8)
    oracle = torch.full((num_blocks, block_size, DK), float("nan"))
    tables = torch.full((len(seq_lens), max(needed) + 2), -1, dtype=torch.int32)
    free = torch.randperm(num_blocks).tolist()
    for n, lat in enumerate(latents):
        blocks = [free.pop() for _ in range(needed[n])]
        tables[n, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        pos = torch.arange(lat.shape[0])
        slots = torch.tensor(blocks)[pos // block_size] * block_size + pos % block_size
        torch_paged.write_kv_cache(cache, slots, lat)
        torch_paged.write_kv_cache(oracle, slots, dequantize_rows(quantize_rows(lat)))
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(int(cu[-1]), H, DK)
    return q, cache, oracle, tables, cu, torch.tensor(seq_lens, dtype=torch.int32)


@pytest.mark.parametrize("shape", [MIXED, DECODES], ids=["mixed", "decodes"])
@pytest.mark.parametrize("block_size", [4, 16])
def test_torch_over_fp8_rows_equals_oracle_on_dequantised_latents(shape, block_size):
    torch.manual_seed(1)
    q, cache, oracle, tables, cu, lens = _fp8_batch(**shape, H=4, block_size=block_size)
    ref = mla_paged_attention_naive(q, oracle, tables, cu, lens, SCALE, KV_LORA)
    out = torch_paged.mla_paged_attention(q, cache, tables, cu, lens, SCALE, KV_LORA)
    assert not out.isnan().any(), "poisoned FP8 rows leaked into the output"
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(mla_paged_attention_naive(q, cache, tables, cu, lens, SCALE, KV_LORA), ref)


def test_chunked_path_over_fp8_rows(monkeypatch):
    monkeypatch.setattr(torch_paged, "SCORE_TILE_ELEMS", 3 * 4 * 16)
    monkeypatch.setattr(torch_paged, "KEY_CHUNK", 8)
    torch.manual_seed(2)
    q, cache, oracle, tables, cu, lens = _fp8_batch(seq_lens=[40, 25, 9], q_lens=[40, 11, 1], H=4, block_size=4)
    ref = mla_paged_attention_naive(q, oracle, tables, cu, lens, SCALE, KV_LORA)
    torch.testing.assert_close(torch_paged.mla_paged_attention(q, cache, tables, cu, lens, SCALE, KV_LORA), ref,
                               atol=1e-5, rtol=1e-5)


def test_negative_control_a_wrong_scale_is_caught():
    """The comparison above can fail: doubling one used row's scale changes the output."""
    torch.manual_seed(3)
    q, cache, oracle, tables, cu, lens = _fp8_batch(**DECODES, H=4, block_size=4)
    ref = mla_paged_attention_naive(q, oracle, tables, cu, lens, SCALE, KV_LORA)
    row = cache[int(tables[1, 0]), 0]
    row[DK:] = (row[DK:].view(torch.float32) * 2).view(torch.uint8)
    out = torch_paged.mla_paged_attention(q, cache, tables, cu, lens, SCALE, KV_LORA)
    assert not torch.allclose(out, ref, atol=1e-5, rtol=1e-5)


# --- Triton checks: one TRITON_INTERPRET=1 child for the module (tests/triton_child.py) ---------------------------

TRITON_CHECKS = triton_child.ChildChecks(__name__)
triton_check = TRITON_CHECKS.check


def _triton_matches_torch_fp8(shape, H, block_size):
    torch.manual_seed(4)
    q, cache, _, tables, cu, lens = _fp8_batch(**shape, H=H, block_size=block_size)
    triton_mla = triton_child.import_interpreted("kernels.attention.triton_paged", "_mla_paged_kernel")
    ref = torch_paged.mla_paged_attention(q, cache, tables, cu, lens, SCALE, KV_LORA)
    out = triton_mla.mla_paged_attention(q, cache, tables, cu, lens, SCALE, KV_LORA)
    assert not out.isnan().any()
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@triton_check
def triton_fp8_mixed_batch():
    _triton_matches_torch_fp8(MIXED, H=3, block_size=4)


@triton_check
def triton_fp8_decodes():
    _triton_matches_torch_fp8(DECODES, H=5, block_size=16)


test_triton_interpreted = TRITON_CHECKS.pytest_test()
