"""The speculative verification ops (`conv_verify`, `kda_verify`) against their token-by-token oracles: outputs and
the state kept after every named token, a batch mixing a verification, a decode and a prefill chunk; slots not
named are untouched, and an out-slot may be the in-slot (everything is read before anything is written)."""

from __future__ import annotations

import torch

from kernels import get_kernel
from kernels.conv.naive import causal_conv1d_verify_naive
from kernels.kda.naive import kda_verify_naive

H, D, C, W, S = 2, 8, 12, 4, 9


def _batch():
    cu = torch.tensor([0, 4, 5, 12])  # a verification of 4, a decode, a prefill chunk of 7
    state_indices = torch.tensor([0, 4, 6])
    out_slots = torch.tensor([1, 2, 3, 0, 4] + [-1] * 6 + [6])  # the verification's last state lands in its in-slot
    return cu, state_indices, out_slots


def test_conv_verify_matches_the_oracle():
    g = torch.Generator().manual_seed(0)
    cu, idx, out = _batch()
    x, w = torch.randn(12, C, generator=g), torch.randn(C, W, generator=g)
    pool = torch.randn(S, C, W - 1, generator=g)
    ref_pool = pool.clone()
    y = get_kernel("conv_verify")(x, w, pool, idx, cu, out)
    y_ref = causal_conv1d_verify_naive(x, w, ref_pool, idx, cu, out)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pool, ref_pool, rtol=1e-5, atol=1e-5)
    assert torch.equal(pool[5], ref_pool[5]) and torch.equal(pool[7], ref_pool[7])


def test_kda_verify_matches_the_oracle():
    g = torch.Generator().manual_seed(1)
    cu, idx, out = _batch()
    q = torch.nn.functional.normalize(torch.randn(12, H, D, generator=g), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(12, H, D, generator=g), dim=-1)
    v = torch.randn(12, H, D, generator=g)
    gate = -torch.rand(12, H, D, generator=g)
    beta = torch.rand(12, H, generator=g)
    pool = torch.randn(S, H, D, D, generator=g)
    ref_pool = pool.clone()
    o = get_kernel("kda_verify")(q, k, v, gate, beta, D ** -0.5, pool, idx, cu, out)
    o_ref = kda_verify_naive(q, k, v, gate, beta, D ** -0.5, ref_pool, idx, cu, out)
    torch.testing.assert_close(o, o_ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(pool, ref_pool, rtol=1e-4, atol=1e-4)
    before = torch.randn(S, H, D, D, generator=torch.Generator().manual_seed(99))
    pool2 = before.clone()
    get_kernel("kda_verify")(q, k, v, gate, beta, D ** -0.5, pool2, idx, cu, out)
    for slot in (5, 7, 8):  # named by no token: never written
        assert torch.equal(pool2[slot], before[slot])
