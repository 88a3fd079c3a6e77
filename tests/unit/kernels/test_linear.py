"""Dense projections (kernels/linear.py): oneDNN's prepacked path equals F.linear within rounding and is row-invariant;
its cache follows in-place writes and dies with the weight; the MKL fallback stays bitwise equal to F.linear. The
small-batch kernel that takes 1-8 fp32 rows first (kernels/cpu/small_gemm.py) is switched off here, so
these tests reach the paths behind it; tests/unit/kernels/test_small_gemm.py tests it and its routing."""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F

from kernels import linear as linear_module
from kernels.linear import linear, onednn_bf16, packed_bytes, packed_weight


@pytest.fixture(autouse=True)
def _without_small_gemm(monkeypatch):
    from kernels.cpu import small_gemm

    monkeypatch.setattr(small_gemm, "runs", lambda x, weight: False)


def amx_tiles() -> bool:
    """Whether this CPU has AMX (bf16 tiles): oneDNN then multiplies bf16 products of 64 rows or more on tiles,
    which round differently from its AVX-512 kernels for fewer rows (seen on a Sapphire Rapids Xeon)."""
    try:
        return "amx_bf16" in open("/proc/cpuinfo").read()
    except OSError:
        return False


def _spy_packed(monkeypatch) -> list[tuple[int, ...]]:
    calls: list[tuple[int, ...]] = []
    real = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(linear_module, "_onednn_linear", lambda x, p: calls.append(tuple(x.shape)) or real(
        x, p, None, "none", [None], ""))
    return calls


@pytest.mark.parametrize("rows", [1, 2, 7, 32, 128, 129, 600])
@pytest.mark.parametrize("out_features", [64, 2048, 2576, 8192])
def test_equals_f_linear(rows, out_features):
    gen = torch.Generator().manual_seed(rows * 31 + out_features)
    x = torch.randn(rows, 96, generator=gen)
    weight = torch.randn(out_features, 96, generator=gen)
    torch.testing.assert_close(linear(x, weight), F.linear(x, weight), atol=1e-4, rtol=1e-5)
    xb, wb = x.bfloat16(), weight.bfloat16()
    torch.testing.assert_close(linear(xb, wb).float(), F.linear(xb, wb).float(), atol=0.1, rtol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_rows_do_not_depend_on_the_batch(dtype, monkeypatch):
    """Each row of an M-row call equals that row computed in a 2-row call, bitwise (decode at batch 32 equals
    decode alone); negative control: a perturbed row changes only its own output. On an AMX CPU bf16 calls of 64
    rows or more (prefill chunks, not decode batches) take oneDNN's tile kernels: equal within bf16 rounding."""
    calls = _spy_packed(monkeypatch)
    gen = torch.Generator().manual_seed(5)
    weight = torch.randn(3206, 768, generator=gen).to(dtype)
    x = torch.randn(600, 768, generator=gen).to(dtype)
    if dtype == torch.bfloat16 and not onednn_bf16():  # an AVX2-only CPU: bf16 never takes the packed path
        torch.testing.assert_close(linear(x[:4], weight).float(), F.linear(x[:4], weight).float(), atol=0.1,
                                   rtol=2e-2)
        assert calls == []
        return
    pairs = torch.cat([linear(x[i : i + 2], weight) for i in range(0, 64, 2)])  # [64, N]
    for rows in (4, 7, 32, 64, 600):
        got, want = linear(x[:rows], weight)[: min(rows, 64)], pairs[: min(rows, 64)]
        if rows >= 64 and dtype == torch.bfloat16 and amx_tiles():
            torch.testing.assert_close(got.float(), want.float(), atol=1.0, rtol=2e-2)
        else:
            assert torch.equal(got, want)
    assert len(calls) == 32 + 5
    moved = x[:8].clone()
    moved[3] += 1
    out = linear(moved, weight)
    assert torch.equal(out[:3], pairs[:3]) and not torch.equal(out[3], pairs[3])


def test_which_products_are_packed(monkeypatch):
    calls = _spy_packed(monkeypatch)
    wide = torch.randn(1024, 512)  # 2^19 elements
    linear(torch.randn(1, 512), wide)  # one fp32 row: MKL's GEMV
    linear(torch.randn(4, 512), torch.randn(64, 512))  # a small fp32 weight: MKL
    assert calls == []
    linear(torch.randn(4, 512), wide)
    linear(torch.randn(1, 512).bfloat16(), torch.randn(64, 512).bfloat16())  # bf16: any size, any rows (where
    packed = [(4, 512), (1, 512)] if onednn_bf16() else [(4, 512)]  # the CPU has oneDNN bf16: AVX-512 or NE)
    assert calls == packed
    weight = torch.randn(1024, 512, requires_grad=True)
    x = torch.randn(4, 512)
    out = linear(x, weight)  # autograd records it: F.linear, differentiable
    out.sum().backward()
    assert calls == packed and torch.allclose(weight.grad, x.sum(0).expand(1024, 512))
    with torch.inference_mode():
        frozen = torch.randn(1024, 512)  # an inference tensor has no version counter: never packed
        linear(torch.randn(4, 512), frozen)
    assert calls == packed


def test_the_packed_copy_follows_writes_and_dies_with_the_weight():
    gen = torch.Generator().manual_seed(9)
    weight = torch.randn(1024, 512, generator=gen)
    x = torch.randn(4, 512, generator=gen)
    before = packed_bytes()
    first = linear(x, weight)
    assert packed_weight(weight, x) is packed_weight(weight, x)  # made once
    assert packed_bytes() == before + weight.numel() * 4
    with torch.no_grad():
        weight.mul_(2)  # in place: the version counter moves, the copy is remade
    torch.testing.assert_close(linear(x, weight), 2 * first, atol=1e-4, rtol=1e-5)
    weight.data = torch.randn(1024, 512, generator=gen)  # rebound: another data pointer
    torch.testing.assert_close(linear(x, weight), F.linear(x, weight), atol=1e-4, rtol=1e-5)
    del weight
    gc.collect()
    assert packed_bytes() == before


def test_small_wide_products_are_sliced_and_others_are_not(monkeypatch):
    """The MKL fallback (here: oneDNN off): column slices, bitwise equal to F.linear."""
    monkeypatch.setattr(linear_module, "packed_weight", lambda weight, x: None)
    calls = []
    real = F.linear
    monkeypatch.setattr(linear_module.F, "linear", lambda x, w: calls.append(w.shape[0]) or real(x, w))
    weight = torch.randn(2576, 16)
    x = torch.randn(32, 16)
    assert torch.equal(linear(x, weight), real(x, weight))
    assert calls == [512] * 5 + [16]  # 2,576 columns in 512-wide slices
    calls.clear()
    linear(torch.randn(1, 16), weight)  # one row: a GEMV, unsliced
    linear(torch.randn(2048, 16), weight)  # prefill-sized: unsliced
    linear(torch.randn(32, 16), torch.randn(768, 16))  # narrow weight: unsliced
    assert calls == [2576, 2576, 768]


def test_leading_dimensions_are_kept():
    x = torch.randn(2, 3, 16)
    weight = torch.randn(4096, 16)
    out = linear(x, weight)
    assert out.shape == (2, 3, 4096)
    torch.testing.assert_close(out, F.linear(x, weight), atol=1e-4, rtol=1e-5)
