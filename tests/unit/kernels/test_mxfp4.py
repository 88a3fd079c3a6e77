"""MXFP4 experts on CPU: the decoders against the `compressed-tensors` package's own MXFP4 decompression, and the
packed experts op against the dense grouped one on the dequantised weights (also with ids of other ranks' experts)."""

from __future__ import annotations

import pytest
import torch

from engine.model.mxfp4 import dequantize_mxfp4, quantize_mxfp4
from kernels.moe.activation import GatedActivation
from kernels.moe.grouped import moe_experts_grouped
from kernels.moe.mxfp4 import MXFP4Weight, dequantize, moe_experts_mxfp4
from kernels.moe.naive import moe_experts_naive
from kernels.moe.router import route

SITU = GatedActivation("situ", beta=4.0, linear_beta=25.0)


def _compressed_tensors_decompress(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    ct = pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    assert ct.__version__
    args = QuantizationArgs(num_bits=4, type="float", strategy="group", group_size=32, scale_dtype=torch.uint8)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    return MXFP4PackedCompressor.decompress({"weight_packed": packed, "weight_scale": scale}, scheme)["weight"]


def _random_codes(rows: int, cols: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Every byte value and a spread of exponents (bf16-representable: the package decodes to bf16)."""
    packed = torch.randint(0, 256, (rows, cols // 2), generator=gen, dtype=torch.uint8)
    scale = torch.randint(127 - 20, 127 + 20, (rows, cols // 32), generator=gen, dtype=torch.uint8)
    return packed, scale


def test_decoders_equal_compressed_tensors():
    gen = torch.Generator().manual_seed(0)
    packed, scale = _random_codes(64, 256, gen)
    expected = _compressed_tensors_decompress(packed, scale).float()  # exact: e2m1 · 2^e fits bf16
    assert torch.equal(dequantize_mxfp4(packed, scale), expected)
    assert torch.equal(dequantize(packed, scale), expected)
    assert torch.equal(dequantize(packed, scale, torch.bfloat16), expected.bfloat16())


def test_every_byte_value_decodes_as_the_package_does():
    packed = torch.arange(256, dtype=torch.uint8).reshape(16, 16)  # [16, 16]: 32 columns per row
    scale = torch.full((16, 1), 127, dtype=torch.uint8)
    assert torch.equal(dequantize(packed, scale), _compressed_tensors_decompress(packed, scale).float())


def test_compressed_tensors_compress_gives_our_bytes():
    """The package's compressor, fed our scales and our dequantised values, writes our packed bytes."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    w = torch.randn(32, 128, generator=torch.Generator().manual_seed(1))
    packed, scale = quantize_mxfp4(w)
    args = QuantizationArgs(num_bits=4, type="float", strategy="group", group_size=32, scale_dtype=torch.uint8)
    out = MXFP4PackedCompressor.compress({"weight": dequantize_mxfp4(packed, scale).bfloat16(),
                                          "weight_scale": torch.exp2(scale.float() - 127).bfloat16()},
                                         QuantizationScheme(targets=["Linear"], weights=args))
    assert torch.equal(out["weight_packed"], packed) and torch.equal(out["weight_scale"], scale)


def _packed_experts(E: int, I: int, D: int, gen: torch.Generator, fused: bool):
    def one(n, k):
        codes = [quantize_mxfp4(torch.randn(n, k, generator=gen) / k ** 0.5) for _ in range(E)]
        return torch.stack([c[0] for c in codes]), torch.stack([c[1] for c in codes])

    (p1, s1), (p3, s3), (p2, s2) = one(I, D), one(I, D), one(D, I)
    if fused:  # w1/w3 as halves of one [E, 2I, ·] tensor, as StackedExperts binds them
        p13, s13 = torch.cat([p1, p3], 1), torch.cat([s1, s3], 1)
        p1, p3, s1, s3 = p13[:, :I], p13[:, I:], s13[:, :I], s13[:, I:]
    return MXFP4Weight(p1, s1), MXFP4Weight(p3, s3), MXFP4Weight(p2, s2)


@pytest.mark.parametrize("fused", [True, False], ids=["fused_gate_up", "separate"])
@pytest.mark.parametrize("T,E", [(41, 8), (3, 16)])
def test_packed_experts_equal_grouped_on_dequantised(fused, T, E):
    gen = torch.Generator().manual_seed(2)
    D, I, k = 64, 32, 3
    w1, w3, w2 = _packed_experts(E, I, D, gen, fused)
    x = torch.randn(T, D, generator=gen)
    weights, ids = route(torch.randn(T, E, generator=gen), torch.zeros(E), k, 1, 1, True, 2.446)
    dense = [dequantize(w.packed, w.scale) for w in (w1, w3, w2)]
    out = moe_experts_mxfp4(x, w1, w3, w2, weights, ids, SITU)
    torch.testing.assert_close(out, moe_experts_grouped(x, *dense, weights, ids, SITU), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("impl", ["naive", "grouped", "mxfp4"])
def test_ids_of_other_ranks_add_nothing(impl):
    """Expert parallelism: a rank with experts [4, 8) of 8 sees local ids −4..3; the two ranks' sums are the whole."""
    gen = torch.Generator().manual_seed(3)
    T, E, D, I, k = 23, 8, 64, 32, 3
    w1, w3, w2 = _packed_experts(E, I, D, gen, fused=True)
    dense = [dequantize(w.packed, w.scale) for w in (w1, w3, w2)]
    x = torch.randn(T, D, generator=gen)
    weights, ids = route(torch.randn(T, E, generator=gen), torch.zeros(E), k, 1, 1, True, 2.446)
    whole = moe_experts_naive(x, *dense, weights, ids, SITU)
    parts = []
    for first in (0, 4):
        local = ids - first
        if impl == "mxfp4":
            halves = [MXFP4Weight(w.packed[first : first + 4], w.scale[first : first + 4]) for w in (w1, w3, w2)]
            parts.append(moe_experts_mxfp4(x, *halves, weights, local, SITU))
        else:
            fn = moe_experts_naive if impl == "naive" else moe_experts_grouped
            parts.append(fn(x, *(w[first : first + 4] for w in dense), weights, local, SITU))
    torch.testing.assert_close(parts[0] + parts[1], whole, atol=1e-5, rtol=1e-5)
    none_here = moe_experts_grouped(x, *dense, weights, ids + 100, SITU)  # no assignment on this rank
    assert torch.equal(none_here, torch.zeros_like(x))
