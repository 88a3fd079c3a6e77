"""kernels/cpu/expert_gemm.py: routed experts' products through the small-batch kernel equal the einsum over the
chosen experts, a token's result does not depend on the tokens beside it, a bad id is refused, a compiled graph
calls the operators without a break, and `moe_experts_bags` takes them where they run (the embedding bags
elsewhere), equal to the oracle either way."""

from __future__ import annotations

import pytest
import torch

from kernels.cpu import expert_gemm
from tests.unit.kernels.test_small_gemm import compiled_calls, kernel_here


def _experts(T: int, c: int, E: int, K: int, N: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, K, generator=gen)
    experts = torch.randn(E, K, N, generator=gen)  # [E, K, N]: each expert input-major
    ids = torch.randint(0, E, (T, c), generator=gen)
    return x, experts, ids


@pytest.mark.parametrize("T,c,E,K,N", [(1, 4, 32, 768, 256), (3, 2, 8, 96, 80), (8, 4, 16, 128, 2100)])
def test_products_equal_the_chosen_experts_and_a_token_does_not_depend_on_its_batch(T, c, E, K, N):
    if not kernel_here():
        return
    x, experts, ids = _experts(T, c, E, K, N, seed=T * 100 + N)
    assert expert_gemm.runs(x, experts)
    got = expert_gemm.products(x, experts, ids)  # [T, c, N]
    torch.testing.assert_close(got, torch.einsum("tk,tjkn->tjn", x, experts[ids]), atol=1e-4, rtol=1e-5)
    h = torch.randn(T, c, K, generator=torch.Generator().manual_seed(7))
    summed = expert_gemm.products_sum(h, experts, ids)  # [T, N]
    torch.testing.assert_close(summed, torch.einsum("tjk,tjkn->tn", h, experts[ids]), atol=1e-3, rtol=1e-5)
    alone = torch.cat([expert_gemm.products_sum(h[t:t + 1], experts, ids[t:t + 1]) for t in range(T)])
    assert torch.equal(summed, alone)  # bitwise
    other = (ids + 1) % E  # negative control: other experts are caught
    assert not torch.allclose(expert_gemm.products(x, experts, other), got, atol=1e-3)


def test_an_expert_id_out_of_range_is_refused():
    if not kernel_here():
        return
    x, experts, ids = _experts(2, 2, 4, 32, 32, seed=1)
    ids[1, 1] = 4
    with pytest.raises(RuntimeError, match="expert id 4 outside"):
        expert_gemm.products(x, experts, ids)
    with pytest.raises(RuntimeError, match="expert id -1 outside"):
        expert_gemm.products_sum(torch.randn(2, 2, 32), experts, torch.full((2, 2), -1))


def test_runs_only_where_the_kernel_applies(monkeypatch):
    from kernels.cpu import small_gemm

    monkeypatch.setattr(small_gemm, "available", lambda: True)
    x, experts, _ = _experts(1, 1, 4, 32, 32, seed=2)
    assert expert_gemm.runs(x, experts)
    assert not expert_gemm.runs(x.bfloat16(), experts.bfloat16())
    assert not expert_gemm.runs(x, experts.transpose(1, 2))  # not contiguous: not input-major experts
    assert not expert_gemm.runs(x, experts[0])  # not stacked
    with torch.enable_grad():
        assert not expert_gemm.runs(x, experts.clone().requires_grad_())
    monkeypatch.setattr(small_gemm, "available", lambda: False)
    assert not expert_gemm.runs(x, experts)


def test_a_compiled_graph_calls_the_operators_without_a_break():
    if not kernel_here():
        return
    x, experts, ids = _experts(2, 2, 8, 64, 64, seed=3)

    def step(x, ids):
        h = expert_gemm.products(x, experts, ids).relu()  # [T, c, N = K]
        return expert_gemm.products_sum(h, experts, ids)

    got, calls = compiled_calls(step, x, ids)
    torch.testing.assert_close(got, step(x, ids))
    assert {"kdamesh_cpu.expert_gemm", "kdamesh_cpu.expert_gemm_sum"} <= calls, calls


def test_exact_bf16_experts_give_the_fp32_experts_bits():
    if not kernel_here():
        return
    from kernels.cpu.small_gemm import exact_bf16

    x, experts, ids = _experts(5, 2, 8, 256, 128, seed=11)
    experts = experts.bfloat16().float()  # a bf16 checkpoint's experts, upcast
    compact = exact_bf16(experts)
    assert compact is not None and compact.dtype == torch.bfloat16 and expert_gemm.runs(x, compact)
    assert torch.equal(expert_gemm.products(x, compact, ids), expert_gemm.products(x, experts, ids))
    h = torch.randn(5, 2, 256, generator=torch.Generator().manual_seed(2))
    assert torch.equal(expert_gemm.products_sum(h, compact, ids), expert_gemm.products_sum(h, experts, ids))
    assert exact_bf16(experts + 2.0 ** -20) is None  # negative control: values off the bf16 grid get no copy
