"""Parity tests for the torch KDA kernels: chunked == recurrent == naive, pooled forms, gates, HF reference."""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F

import kernels.kda.chunked as chunked_module
from kernels.kda.chunked import chunk_kda, intra_chunk_scores, kda_prefill_pooled, unit_lower_inverse
from kernels.kda.gate import kda_gate_lower_bound, kda_gate_softplus
from kernels.kda.naive import kda_naive
from kernels.kda.recurrent import fused_recurrent_kda, kda_decode_pooled
from kernels.registry import _IMPLS

TOL = {torch.float32: 1e-5, torch.float64: 1e-10}


def l2norm(x: torch.Tensor) -> torch.Tensor:
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def make_gate(T, H, K, form, dtype):
    """g [T, H, K] from a random gate projection through gate.py, in `dtype`."""
    f = torch.randn(T, H * K) * 2.0
    dt_bias = torch.randn(H * K)
    if form == "lower_bound":  # Kimi K3: g in (-5, 0), A_log padded to 128 entries
        A_log = torch.cat([torch.rand(H) * 2.0, torch.full((128 - H,), 50.0)])
        g = kda_gate_lower_bound(f, A_log, dt_bias, H, -5.0)
    elif form == "strong":  # near the lower bound everywhere
        A_log = torch.full((1, 1, H, 1), 3.0)
        g = kda_gate_lower_bound(f.abs() + 2.0, A_log, dt_bias.abs(), H, -5.0)
    elif form == "softplus":  # Kimi Linear
        g = kda_gate_softplus(f, torch.log(torch.rand(1, 1, H, 1) * 15 + 1), dt_bias, H)
    elif form == "softplus_large":  # exp(A_log) = e^5: decays of tens to hundreds per token
        g = kda_gate_softplus(f * 2.0, torch.full((1, 1, H, 1), 5.0), dt_bias, H)
    elif form == "weak":  # long memory: decays close to 0
        g = kda_gate_softplus(f - 12.0, torch.zeros(H), dt_bias, H)
    else:
        raise ValueError(form)
    return g.to(dtype)


def make_inputs(T, H, K, V, dtype, gate="lower_bound"):
    q = l2norm(torch.randn(T, H, K, dtype=torch.float64)).to(dtype)
    k = l2norm(torch.randn(T, H, K, dtype=torch.float64)).to(dtype)
    v = torch.randn(T, H, V, dtype=dtype)
    g = make_gate(T, H, K, gate, dtype)
    beta = torch.sigmoid(torch.randn(T, H, dtype=dtype))
    return q, k, v, g, beta


def cu_of(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64)


def assert_close(actual, expected, dtype):
    assert actual.dtype == expected.dtype
    err = (actual.double() - expected.double()).abs().max().item() if actual.numel() else 0.0
    assert err <= TOL[dtype], f"max abs error {err:.3g} > {TOL[dtype]:.1g}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("T", [1, 17, 64, 65, 130, 200])
@pytest.mark.parametrize("with_state", [False, True])
def test_chunked_and_recurrent_match_naive(dtype, T, with_state):
    H, K, V = 2, 32, 16
    q, k, v, g, beta = make_inputs(T, H, K, V, dtype)
    s0 = torch.randn(1, H, K, V, dtype=dtype) if with_state else None
    scale = K**-0.5
    o_ref, s_ref = kda_naive(q, k, v, g, beta, scale, s0)
    for fn in (chunk_kda, fused_recurrent_kda):
        o, s = fn(q, k, v, g, beta, scale, s0)
        assert o.shape == (T, H, V) and s.shape == (1, H, K, V)
        assert_close(o, o_ref, dtype)
        assert_close(s, s_ref, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("gate", ["lower_bound", "strong", "softplus", "softplus_large", "weak"])
def test_varlen_batch_all_gate_forms(dtype, gate):
    lengths = [65, 1, 130, 17, 64, 3]
    H, K, V = 3, 64, 32
    q, k, v, g, beta = make_inputs(sum(lengths), H, K, V, dtype, gate)
    cu = cu_of(lengths)
    s0 = torch.randn(len(lengths), H, K, V, dtype=dtype)
    o_ref, s_ref = kda_naive(q, k, v, g, beta, 0.125, s0, cu)
    for fn in (chunk_kda, fused_recurrent_kda):
        o, s = fn(q, k, v, g, beta, 0.125, s0, cu)
        assert_close(o, o_ref, dtype)
        assert_close(s, s_ref, dtype)


@pytest.mark.parametrize("group_elements", [1, 3 * 2 * 16 * 48 * 8])  # one chunk, or three, per batch
def test_small_chunk_batches_split_steps(monkeypatch, group_elements):
    """Many sequences per step, processed a few chunks at a time, give the same result."""
    monkeypatch.setattr(chunked_module, "_GROUP_ELEMENTS", group_elements)
    lengths = [20, 70, 5, 64, 1, 33, 129]
    q, k, v, g, beta = make_inputs(sum(lengths), 2, 16, 32, torch.float64, "softplus")
    cu = cu_of(lengths)
    s0 = torch.randn(len(lengths), 2, 16, 32, dtype=torch.float64)
    o_ref, s_ref = kda_naive(q, k, v, g, beta, 0.25, s0, cu)
    o, s = chunk_kda(q, k, v, g, beta, 0.25, s0, cu, chunk_size=16)
    assert_close(o, o_ref, torch.float64)
    assert_close(s, s_ref, torch.float64)


@pytest.mark.parametrize("chunk_size", [8, 16, 32, 48])
def test_chunk_sizes(chunk_size):
    lengths = [40, 7, 100]
    q, k, v, g, beta = make_inputs(sum(lengths), 4, 16, 24, torch.float64, "softplus")
    cu = cu_of(lengths)
    o_ref, s_ref = kda_naive(q, k, v, g, beta, 0.25, None, cu)
    o, s = chunk_kda(q, k, v, g, beta, 0.25, None, cu, chunk_size=chunk_size)
    assert_close(o, o_ref, torch.float64)
    assert_close(s, s_ref, torch.float64)


def test_empty_sequence_keeps_its_state():
    cu = torch.tensor([0, 5, 5, 12])
    q, k, v, g, beta = make_inputs(12, 2, 16, 16, torch.float64)
    s0 = torch.randn(3, 2, 16, 16, dtype=torch.float64)
    o_ref, s_ref = kda_naive(q, k, v, g, beta, 0.25, s0, cu)
    for fn in (chunk_kda, fused_recurrent_kda):
        o, s = fn(q, k, v, g, beta, 0.25, s0, cu)
        assert_close(o, o_ref, torch.float64)
        assert_close(s, s_ref, torch.float64)
        assert torch.equal(s[1], s0[1])


def test_bf16_inputs_return_bf16_and_fp32_state():
    q, k, v, g, beta = make_inputs(70, 2, 32, 32, torch.bfloat16)
    o_ref, s_ref = kda_naive(q, k, v, g, beta, 32**-0.5)
    for fn in (chunk_kda, fused_recurrent_kda):
        o, s = fn(q, k, v, g, beta, 32**-0.5)
        assert o.dtype == torch.bfloat16 and s.dtype == torch.float32
        assert (o.float() - o_ref.float()).abs().max() <= 2e-2
        assert (s - s_ref).abs().max() <= 1e-5


@pytest.mark.parametrize("gate", ["lower_bound", "softplus_large"])
def test_intra_chunk_scores_match_brute_force(gate):
    B, H, C, K = 3, 2, 64, 16
    q, k, _, g, _ = make_inputs(B * C, H, K, 1, torch.float64, gate)
    q, k, g = (x.view(B, C, H, K).transpose(1, 2) for x in (q, k, g))  # [B, H, C, K]
    gc = g.cumsum(-2)
    diff = gc.unsqueeze(-2) - gc.unsqueeze(-3)  # [B, H, i, j, K]
    lower = torch.ones(C, C, dtype=torch.bool).tril()
    decay = torch.where(lower[..., None], diff, float("-inf")).exp()
    a_kk_ref = torch.einsum("bhik,bhjk,bhijk->bhij", k, k, decay).tril(-1)
    a_qk_ref = torch.einsum("bhik,bhjk,bhijk->bhij", q, k, decay)
    a_kk, a_qk = intra_chunk_scores(q, k, g)
    assert_close(a_kk, a_kk_ref, torch.float64)
    assert_close(a_qk, a_qk_ref, torch.float64)


def _strong_then_weak_gate(T, H, K):
    """Bursts of strong decay (up to -60 per token) followed by runs of very weak decay (~-1e-3), per channel: the
    case where exponents formed as differences of cumulative sums lose precision in fp32."""
    strong = torch.rand(T, H, K) < 0.15
    return torch.where(strong, -60.0 * torch.rand(T, H, K), -1e-3 * torch.rand(T, H, K)).double()


@pytest.mark.parametrize("C", [64, 32, 48])
def test_intra_chunk_scores_fp32_strong_then_weak(C):
    B, H, K = 4, 2, 64
    q = l2norm(torch.randn(B * C, H, K, dtype=torch.float64))
    k = l2norm(torch.randn(B * C, H, K, dtype=torch.float64))
    g = _strong_then_weak_gate(B * C, H, K)
    q, k, g = (x.view(B, C, H, K).transpose(1, 2) for x in (q, k, g))  # [B, H, C, K] fp64
    gc = g.cumsum(-2)
    diff = gc.unsqueeze(-2) - gc.unsqueeze(-3)
    lower = torch.ones(C, C, dtype=torch.bool).tril()
    decay = torch.where(lower[..., None], diff, float("-inf")).exp()
    a_kk_ref = torch.einsum("bhik,bhjk,bhijk->bhij", k, k, decay).tril(-1)
    a_qk_ref = torch.einsum("bhik,bhjk,bhijk->bhij", q, k, decay)
    a_kk, a_qk = intra_chunk_scores(q.float(), k.float(), g.float())
    assert (a_kk.double() - a_kk_ref).abs().max() <= 1e-6
    assert (a_qk.double() - a_qk_ref).abs().max() <= 1e-6


@pytest.mark.parametrize("chunk_size", [32, 64])
def test_fp32_strong_then_weak_gates_against_fp64_oracle(chunk_size):
    """fp32 chunked output within 1e-5 of the fp64 naive oracle when strong decays are followed by weak ones."""
    T, H, K, V = 200, 2, 64, 32
    q, k, v, _, beta = make_inputs(T, H, K, V, torch.float64)
    g = _strong_then_weak_gate(T, H, K)
    s0 = torch.randn(1, H, K, V, dtype=torch.float64)
    o_ref, s_ref = kda_naive(q, k, v, g, beta, K**-0.5, s0)
    o, s = chunk_kda(*(x.float() for x in (q, k, v, g, beta)), K**-0.5, s0.float(), chunk_size=chunk_size)
    assert (o.double() - o_ref).abs().max() <= TOL[torch.float32]
    assert (s.double() - s_ref).abs().max() <= TOL[torch.float32]


@pytest.mark.parametrize("C,sub", [(64, 16), (48, 16), (16, 16), (8, 16)])
def test_unit_lower_inverse(C, sub):
    lower = torch.randn(5, C, C, dtype=torch.float64) * 0.3
    inverse = unit_lower_inverse(lower, sub)
    expected = torch.linalg.inv(torch.eye(C, dtype=torch.float64) + lower.tril(-1))
    assert_close(inverse, expected, torch.float64)


def test_prefill_pooled_writes_only_its_slots():
    lengths = [70, 1, 33]
    H, K, V = 2, 32, 16
    q, k, v, g, beta = make_inputs(sum(lengths), H, K, V, torch.float32)
    cu = cu_of(lengths)
    pool = torch.full((6, H, K, V), float("nan"))
    slots = torch.tensor([4, 1, 2])
    s0 = torch.randn(3, H, K, V)
    s0[2] = 0.0  # a fresh sequence: the caller zeroes its slot
    pool[slots] = s0
    o = kda_prefill_pooled(q, k, v, g, beta, 0.2, cu, pool, slots)
    o_ref, s_ref = kda_naive(q, k, v, g, beta, 0.2, s0, cu)
    assert_close(o, o_ref, torch.float32)
    assert_close(pool[slots], s_ref, torch.float32)
    unused = torch.tensor([0, 3, 5])
    assert torch.isnan(pool[unused]).all()


@pytest.mark.parametrize("T,pool_slots,slots,unused", [
    (9, 5, [3, 0, 4], [1, 2]),
    (4, 6, [2, 3, 4], [0, 1, 5]),  # slots a..a+N-1: the in-place path (no gather/scatter copy)
], ids=["scattered-slots", "consecutive-slots-in-place"])
def test_decode_steps_match_naive(T, pool_slots, slots, unused):
    """Decode steps over pooled states match the naive recurrence; slots not named stay untouched."""
    N, H, K, V = 3, 2, 32, 16
    q, k, v, g, beta = make_inputs(N * T, H, K, V, torch.float32, "softplus")
    q, k, v, g, beta = (x.view(N, T, *x.shape[1:]) for x in (q, k, v, g, beta))  # [N, T, ...]
    pool = torch.full((pool_slots, H, K, V), float("nan"))
    slots = torch.tensor(slots)
    s0 = torch.randn(N, H, K, V)
    pool[slots] = s0
    outs = [kda_decode_pooled(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], 0.2, pool, slots) for t in range(T)]
    o = torch.stack(outs, dim=1).flatten(0, 1)  # [N*T, H, V], sequences back to back
    cu = torch.arange(N + 1) * T
    o_ref, s_ref = kda_naive(*(x.flatten(0, 1) for x in (q, k, v, g, beta)), 0.2, s0, cu)
    assert_close(o, o_ref, torch.float32)
    assert_close(pool[slots], s_ref, torch.float32)
    assert torch.isnan(pool[torch.tensor(unused)]).all()


def test_prefill_then_decode_equals_one_pass():
    """The state handed from a pooled prefill to pooled decode continues the sequence exactly."""
    T, H, K, V = 100, 2, 32, 32
    q, k, v, g, beta = make_inputs(T + 1, H, K, V, torch.float32)
    pool = torch.zeros(2, H, K, V)
    slot = torch.tensor([1])
    kda_prefill_pooled(q[:T], k[:T], v[:T], g[:T], beta[:T], 0.2, cu_of([T]), pool, slot)
    o_last = kda_decode_pooled(q[T:], k[T:], v[T:], g[T:], beta[T:], 0.2, pool, slot)
    o_ref, s_ref = kda_naive(q, k, v, g, beta, 0.2)
    assert_close(o_last, o_ref[T:], torch.float32)
    assert_close(pool[1:], s_ref, torch.float32)


def test_gate_softplus_formula():
    T, H, K = 5, 3, 8
    f = torch.randn(T, H * K) * 15  # crosses the softplus threshold of 20
    dt_bias = torch.randn(H * K)
    A_log = torch.randn(1, 1, H, 1)
    x = (f + dt_bias).view(T, H, K)
    sp = torch.where(x > 20.0, x, torch.log(1.0 + torch.exp(x)))
    expected = -torch.exp(A_log.view(1, H, 1)) * sp
    g = kda_gate_softplus(f, A_log, dt_bias, H)
    assert g.shape == (T, H, K) and g.dtype == torch.float32
    torch.testing.assert_close(g, expected, rtol=1e-6, atol=1e-6)
    assert torch.equal(kda_gate_softplus(f, A_log.view(H), dt_bias, H), g)


def test_gate_lower_bound_formula_with_padded_A_log():
    T, H, K = 4, 3, 8
    f = torch.randn(T, H * K) * 3
    dt_bias = torch.randn(H * K)
    A_log = torch.cat([torch.randn(H), torch.full((125,), 100.0)])  # padded to 128
    expected = -5.0 * torch.sigmoid(torch.exp(A_log[:H]).view(1, H, 1) * (f + dt_bias).view(T, H, K))
    g = kda_gate_lower_bound(f, A_log, dt_bias, H, -5.0)
    assert g.shape == (T, H, K) and g.dtype == torch.float32
    torch.testing.assert_close(g, expected, rtol=1e-6, atol=1e-6)
    assert (g <= 0).all() and (g >= -5).all()


def test_gates_compute_in_fp32_for_bf16_projections():
    f = torch.randn(3, 16).bfloat16()
    g = kda_gate_softplus(f, torch.zeros(2), torch.zeros(16), 2)
    assert g.dtype == torch.float32
    torch.testing.assert_close(g, -F.softplus(f.float()).view(3, 2, 8))


@pytest.mark.parametrize("T", [50, 130])
def test_matches_transformers_reference(T):
    mod = importlib.import_module("transformers.models.kimi_linear.modeling_kimi_linear")
    chunk_ref = getattr(mod.chunk_kimi_delta_attention, "__wrapped__", mod.chunk_kimi_delta_attention)
    recur_ref = getattr(mod.recurrent_kimi_delta_attention, "__wrapped__", mod.recurrent_kimi_delta_attention)
    H, K, V = 2, 32, 32
    q, k, v, g, beta = make_inputs(T, H, K, V, torch.float32, "softplus")
    s0 = torch.randn(1, H, K, V)
    o, s = chunk_kda(q, k, v, g, beta, K**-0.5, s0)
    batched = [x.unsqueeze(0) for x in (q, k, v, g, beta)]  # [1, T, H, *]
    for ref in (chunk_ref, recur_ref):
        o_ref, s_ref = ref(*batched, initial_state=s0, output_final_state=True, use_qk_l2norm_in_kernel=False)
        assert (o - o_ref[0]).abs().max() <= 1e-5
        assert (s - s_ref).abs().max() <= 1e-5


@pytest.mark.parametrize("op", ["kda_prefill", "kda_decode"])
def test_registry_torch_targets_resolve(op):
    module_name, func_name = _IMPLS[op]["torch"].split(":")
    assert callable(getattr(importlib.import_module(module_name), func_name))
