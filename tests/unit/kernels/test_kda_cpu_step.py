"""kernels/kda/cpu_step.py: the CPU kernel's KDA decode step equals the torch form (`kda_step`'s math written out
here), steps only the slots it is given, in place on the pool, a sequence's result does not depend on the others in
the call, a bad slot is refused, it is taken exactly where `runs` says, a compiled step calls it on the pool
itself (no gather, no scatter, no copy of the pool), and its verification form equals the oracle, reading every
in-state before writing any out-slot."""

from __future__ import annotations

import pytest
import torch

from kernels.kda import cpu_step
from kernels.kda.recurrent import kda_decode_pooled
from tests.unit.kernels.test_small_gemm import compiled_calls, kernel_here


def _step_inputs(N: int, H: int, K: int, V: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(N, H, K, generator=gen)
    k = torch.nn.functional.normalize(torch.randn(N, H, K, generator=gen), dim=-1)
    v = torch.randn(N, H, V, generator=gen)
    g = -torch.rand(N, H, K, generator=gen)  # log-decay <= 0
    beta = torch.rand(N, H, generator=gen)
    return q, k, v, g, beta


def _reference(states, q, k, v, g, beta, scale):
    """The delta rule in fp64, spelled out: S' = exp(g) S; u = beta (v - k^T S'); S' += k u^T; o = scale q^T S'."""
    S = states.double() * torch.exp(g.double()).unsqueeze(-1)  # [N, H, K, V]
    u = beta.double().unsqueeze(-1) * (v.double() - torch.einsum("nhk,nhkv->nhv", k.double(), S))
    S = S + k.double().unsqueeze(-1) * u.unsqueeze(-2)
    return torch.einsum("nhk,nhkv->nhv", scale * q.double(), S).float(), S.float()


@pytest.mark.parametrize("N,H,K,V", [(1, 12, 128, 128), (3, 2, 64, 32), (2, 3, 40, 80)])
def test_the_step_equals_the_delta_rule_in_place_and_only_on_its_slots(N, H, K, V):
    if not kernel_here():
        return
    pool = torch.randn(6, H, K, V, generator=torch.Generator().manual_seed(1)) * 0.1  # [S, H, K, V]
    before = pool.clone()
    slots = torch.tensor([4, 1, 2][:N])
    q, k, v, g, beta = _step_inputs(N, H, K, V, seed=N * 10 + V)
    assert cpu_step.runs(pool, q)
    storage = pool.untyped_storage().data_ptr()
    o = cpu_step.decode_(pool, slots, q, k, v, g, beta, K ** -0.5)  # [N, H, V]
    want_o, want_states = _reference(before[slots], q, k, v, g, beta, K ** -0.5)
    torch.testing.assert_close(o, want_o, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(pool[slots], want_states, atol=2e-5, rtol=1e-4)
    untouched = [s for s in range(6) if s not in slots.tolist()]
    assert torch.equal(pool[untouched], before[untouched])
    assert pool.untyped_storage().data_ptr() == storage  # in place
    other_states, _ = _reference(before[slots].flip(-1), q, k, v, g, beta, K ** -0.5)  # negative control
    assert not torch.allclose(other_states, o, atol=1e-3)


def test_a_sequence_does_not_depend_on_the_others_in_its_call():
    if not kernel_here():
        return
    pool = torch.randn(4, 2, 64, 32, generator=torch.Generator().manual_seed(2)) * 0.1
    alone = pool.clone()
    q, k, v, g, beta = _step_inputs(3, 2, 64, 32, seed=3)
    slots = torch.tensor([0, 2, 3])
    together = cpu_step.decode_(pool, slots, q, k, v, g, beta, 0.125)
    for n in range(3):
        one = cpu_step.decode_(alone, slots[n:n + 1], q[n:n + 1], k[n:n + 1], v[n:n + 1], g[n:n + 1],
                               beta[n:n + 1], 0.125)
        assert torch.equal(one[0], together[n])  # bitwise
    assert torch.equal(alone, pool)


def test_a_slot_out_of_range_is_refused():
    if not kernel_here():
        return
    pool = torch.zeros(2, 1, 16, 16)
    q, k, v, g, beta = _step_inputs(1, 1, 16, 16, seed=4)
    with pytest.raises(RuntimeError, match="slot 2 outside"):
        cpu_step.decode_(pool, torch.tensor([2]), q, k, v, g, beta, 0.25)
    with pytest.raises(RuntimeError, match="q, k, g fp32"):
        cpu_step.decode_(pool, torch.tensor([0]), q[:, :, :8], k, v, g, beta, 0.25)


def test_runs_only_where_the_kernel_applies(monkeypatch):
    from kernels.cpu import small_gemm

    monkeypatch.setattr(small_gemm, "available", lambda: True)
    pool, q = torch.zeros(2, 1, 16, 32), torch.zeros(1, 1, 16)
    assert cpu_step.runs(pool, q)
    assert not cpu_step.runs(pool.double(), q.double())
    assert not cpu_step.runs(torch.zeros(2, 1, 16, 24), q)  # value width not a multiple of 16
    assert not cpu_step.runs(pool.transpose(2, 3), q)  # not contiguous
    assert not cpu_step.runs(pool, q.bfloat16())
    monkeypatch.setattr(small_gemm, "available", lambda: False)
    assert not cpu_step.runs(pool, q)


def test_the_pooled_decode_takes_the_kernel_and_equals_the_torch_form(monkeypatch):
    if not kernel_here():
        return
    pool = torch.randn(5, 2, 64, 32, generator=torch.Generator().manual_seed(5)) * 0.1
    slots = torch.tensor([3, 0])
    q, k, v, g, beta = _step_inputs(2, 2, 64, 32, seed=6)
    torch_pool = pool.clone()
    got = kda_decode_pooled(q, k, v, g, beta, 0.125, pool, slots)
    monkeypatch.setattr(cpu_step, "runs", lambda *a: False)
    want = kda_decode_pooled(q, k, v, g, beta, 0.125, torch_pool, slots)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(pool, torch_pool, atol=2e-5, rtol=1e-4)


def test_a_compiled_step_calls_the_kernel_on_the_pool():
    if not kernel_here():
        return
    pool = torch.randn(4, 2, 64, 32, generator=torch.Generator().manual_seed(7)) * 0.1
    eager_pool = pool.clone()
    slots = torch.tensor([1, 3])
    q, k, v, g, beta = _step_inputs(2, 2, 64, 32, seed=8)

    def step(q, k, v, g, beta, slots):
        return kda_decode_pooled(q, k, v, g, beta, 0.125, pool, slots) * 2

    got, calls = compiled_calls(step, q, k, v, g, beta, slots)
    assert "kdamesh_cpu.kda_decode_" in calls
    assert not calls & {"aten.index_select", "aten.index_copy", "aten.index_put"}  # no gather, no scatter
    want = kda_decode_pooled(q, k, v, g, beta, 0.125, eager_pool, slots) * 2
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    torch.testing.assert_close(pool, eager_pool, atol=0, rtol=0)


def test_verification_equals_the_oracle_reading_every_state_before_writing_any():
    if not kernel_here():
        return
    from kernels.kda.naive import kda_verify_naive

    N, Q, H, K, V = 2, 3, 2, 32, 32
    q, k, v, g, beta = _step_inputs(N * Q, H, K, V, seed=9)
    pool = torch.randn(10, H, K, V, generator=torch.Generator().manual_seed(10)) * 0.1
    in_slots = torch.tensor([0, 5])
    out_slots = torch.tensor([6, 7, 5, 8, 9, 0])  # sequence 0's last state goes to sequence 1's in-slot, and back
    oracle_pool = pool.clone()
    assert cpu_step.runs(pool, q)
    o = cpu_step.verify_(pool, in_slots, out_slots, q, k, v, g, beta, K ** -0.5)  # [N*Q, H, V]
    cu = torch.arange(0, N * Q + 1, Q)
    want = kda_verify_naive(q, k, v, g, beta, K ** -0.5, oracle_pool, in_slots, cu, out_slots)
    torch.testing.assert_close(o, want, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(pool, oracle_pool, atol=2e-5, rtol=1e-4)
    # negative control: sequence 1 stepped after sequence 0 wrote its in-slot (write before read) differs
    late_pool, one = oracle_pool.clone(), slice(Q, 2 * Q)
    late_pool.copy_(pool)
    late = kda_verify_naive(q[one], k[one], v[one], g[one], beta[one], K ** -0.5, late_pool, in_slots[1:],
                            torch.tensor([0, Q]), out_slots[one])
    assert not torch.allclose(late, o[one], atol=1e-3)
