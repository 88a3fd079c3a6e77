"""Column-sliced small-batch projections (kernels/linear.py) equal F.linear bit for bit, sliced or not."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import linear as linear_module
from kernels.linear import linear


@pytest.mark.parametrize("rows", [1, 2, 7, 32, 128, 129, 600])
@pytest.mark.parametrize("out_features", [64, 2048, 2576, 8192])
def test_equals_f_linear_bitwise(rows, out_features):
    gen = torch.Generator().manual_seed(rows * 31 + out_features)
    x = torch.randn(rows, 96, generator=gen)
    weight = torch.randn(out_features, 96, generator=gen)
    assert torch.equal(linear(x, weight), F.linear(x, weight))


def test_small_wide_products_are_sliced_and_others_are_not(monkeypatch):
    calls = []
    real = F.linear
    monkeypatch.setattr(linear_module.F, "linear", lambda x, w: calls.append(w.shape[0]) or real(x, w))
    weight = torch.randn(2576, 16)
    linear(torch.randn(32, 16), weight)
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
    assert out.shape == (2, 3, 4096) and torch.equal(out, F.linear(x, weight))
