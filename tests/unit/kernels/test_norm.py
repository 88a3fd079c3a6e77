"""Norm ops against transformers' Kimi Linear modules and direct formulas."""

import importlib

import pytest
import torch

from kernels.norm import gated_rms_norm, l2_normalize, rms_norm, rms_norm_no_weight

kimi = importlib.import_module("transformers.models.kimi_linear.modeling_kimi_linear")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_kimi_linear_rmsnorm(dtype):
    x = torch.randn(5, 7, 64).to(dtype)
    ref = kimi.KimiLinearRMSNorm(64, eps=1e-5).to(dtype)
    with torch.no_grad():
        ref.weight.copy_(torch.randn(64))
        expected = ref(x)
    got = rms_norm(x, ref.weight.detach(), 1e-5)
    assert got.dtype == expected.dtype
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_rms_norm_casts_before_weight():
    """bf16: normalise in fp32, round to bf16, then multiply — not one fp32 product rounded once."""
    x = torch.randn(256, 64).to(torch.bfloat16)
    w = (torch.rand(64) * 3).to(torch.bfloat16)
    x32 = x.float()
    normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16)
    torch.testing.assert_close(rms_norm(x, w, 1e-6), w * normed, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_rms_norm_matches_kimi_linear_gated(dtype):
    x = torch.randn(3, 4, 32).to(dtype)
    gate = torch.randn(3, 4, 32).to(dtype)
    ref = kimi.KimiLinearRMSNormGated(32, eps=1e-6)
    with torch.no_grad():
        ref.weight.copy_(torch.randn(32))
        expected = ref(x, gate)
    got = gated_rms_norm(x, ref.weight.detach(), gate, 1e-6)
    assert got.dtype == dtype
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_rms_norm_no_weight_is_fp32():
    x = torch.randn(6, 48).to(torch.bfloat16)
    got = rms_norm_no_weight(x, 1e-6)
    assert got.dtype == torch.float32
    x32 = x.float()
    torch.testing.assert_close(got, x32 / torch.sqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_l2_normalize_formula(dtype):
    x = torch.randn(4, 3, 128).to(dtype)
    got = l2_normalize(x)
    x32 = x.float()
    expected = (x32 / torch.sqrt(x32.pow(2).sum(-1, keepdim=True) + 1e-6)).to(dtype)
    assert got.dtype == dtype
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(got.float().norm(dim=-1), torch.ones(4, 3), atol=1e-2, rtol=0)
