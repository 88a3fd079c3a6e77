"""kernels/vision: the per-image SDPA path equals the naive oracle on fresh random inputs; the registry serves it."""

from __future__ import annotations

import pytest
import torch

from kernels.registry import chosen_backend, get_kernel
from kernels.vision.naive import varlen_attention_naive
from kernels.vision.torch_sdpa import varlen_attention


def _inputs(lengths: list[int], heads: int, dim: int, seed: int, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    q, k, v = (torch.randn(total, heads, dim, generator=gen).to(dtype) for _ in range(3))
    cu = torch.tensor([0] + lengths).cumsum(0)
    return q, k, v, cu


@pytest.mark.parametrize("lengths", [[37], [16, 16, 16], [5, 64, 1, 64, 9], [12, 0, 7], [1]])
def test_sdpa_matches_naive(lengths):
    q, k, v, cu = _inputs(lengths, heads=3, dim=16, seed=sum(lengths))
    want = varlen_attention_naive(q, k, v, cu, 16 ** -0.5)
    got = varlen_attention(q, k, v, cu, 16 ** -0.5)
    assert got.shape == q.shape and got.dtype == q.dtype
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_images_never_see_each_other():
    """Changing image 1's keys and values leaves images 0 and 2 exactly as they were, in both paths."""
    q, k, v, cu = _inputs([6, 9, 4], heads=2, dim=8, seed=1)
    k2, v2 = k.clone(), v.clone()
    k2[6:15] += 5.0
    v2[6:15] -= 3.0
    for attention in (varlen_attention_naive, varlen_attention):
        a, b = attention(q, k, v, cu, 0.3), attention(q, k2, v2, cu, 0.3)
        assert torch.equal(a[:6], b[:6]) and torch.equal(a[15:], b[15:])
        assert not torch.allclose(a[6:15], b[6:15])


def test_naive_is_plain_softmax_attention():
    q, k, v, cu = _inputs([5], heads=1, dim=4, seed=2)
    weights = torch.softmax(q[:, 0] @ k[:, 0].T * 0.5, dim=-1)  # [5, 5]
    torch.testing.assert_close(varlen_attention_naive(q, k, v, cu, 0.5)[:, 0], weights @ v[:, 0])


def test_bfloat16_stays_close():
    q, k, v, cu = _inputs([20, 33], heads=2, dim=32, seed=3, dtype=torch.bfloat16)
    got = varlen_attention(q, k, v, cu, 32 ** -0.5)
    assert got.dtype == torch.bfloat16
    want = varlen_attention_naive(q.float(), k.float(), v.float(), cu, 32 ** -0.5)
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)


def test_registry_serves_the_torch_path_on_cpu():
    assert chosen_backend("vision_attention", "cpu") == "torch"
    assert get_kernel("vision_attention", "cpu") is varlen_attention
