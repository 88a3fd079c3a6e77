"""MoE: router against a direct per-token formula and transformers' KimiLinearTopkRouter; grouped experts against
the naive loop (and transformers' KimiLinearExperts); gated activation formulas."""

import importlib
import math

import pytest
import torch
import torch.nn.functional as F

from kernels.moe.activation import GatedActivation
from kernels.moe.grouped import moe_experts_grouped
from kernels.moe.naive import moe_experts_naive
from kernels.moe.router import route

SCALING = 2.446


def _route_formula(logits, bias, top_k, num_group, topk_group, renormalize, scaling):
    """One token at a time, spelled out with Python sorting."""
    weights, ids = [], []
    for row in logits:
        scores = torch.sigmoid(row).tolist()
        choice = [s + b for s, b in zip(scores, bias.tolist())]
        allowed = list(range(len(choice)))
        if num_group > 1 and num_group > topk_group:
            size = len(choice) // num_group
            group_score = [sum(sorted(choice[g * size : (g + 1) * size], reverse=True)[:2]) for g in range(num_group)]
            kept = sorted(range(num_group), key=lambda g: -group_score[g])[:topk_group]
            allowed = [e for e in allowed if e // size in kept]
        chosen = sorted(allowed, key=lambda e: -choice[e])[:top_k]
        w = [scores[e] for e in chosen]
        if renormalize and top_k > 1:
            total = sum(w) + 1e-20
            w = [x / total for x in w]
        weights.append([x * scaling for x in w])
        ids.append(chosen)
    return torch.tensor(weights), torch.tensor(ids)


def _by_id(weights, ids):
    """Sorts each token's (id, weight) pairs by id so different orders compare equal."""
    order = ids.argsort(dim=-1)
    return weights.gather(1, order), ids.gather(1, order)


@pytest.mark.parametrize("num_group,topk_group", [(1, 1), (4, 2), (8, 3), (4, 4)])
@pytest.mark.parametrize("renormalize", [True, False])
def test_router_matches_formula(num_group, topk_group, renormalize):
    T, E, k = 37, 32, 4
    logits, bias = torch.randn(T, E), torch.randn(E) * 0.3
    w, ids = route(logits, bias, k, num_group, topk_group, renormalize, SCALING)
    assert w.dtype == torch.float32 and ids.dtype == torch.int64 and ids.shape == (T, k)
    w_ref, ids_ref = _route_formula(logits, bias, k, num_group, topk_group, renormalize, SCALING)
    w, ids = _by_id(w, ids)
    w_ref, ids_ref = _by_id(w_ref, ids_ref)
    assert torch.equal(ids, ids_ref)
    torch.testing.assert_close(w, w_ref, atol=1e-6, rtol=1e-6)


def test_router_weights_are_unbiased_scores():
    logits = torch.randn(5, 8)
    bias = torch.zeros(8)
    bias[3] = 10.0  # forces expert 3 into every choice without changing its weight
    w, ids = route(logits, bias, 2, 1, 1, False, 1.0)
    assert (ids == 3).any(-1).all()
    torch.testing.assert_close(w, torch.sigmoid(logits).gather(1, ids))


def test_router_top1_is_not_renormalized():
    logits = torch.randn(6, 8)
    w, ids = route(logits, torch.zeros(8), 1, 1, 1, True, 2.0)
    torch.testing.assert_close(w, 2.0 * torch.sigmoid(logits).gather(1, ids))


@pytest.mark.parametrize("num_group,topk_group", [(1, 1), (4, 2)])
@pytest.mark.parametrize("norm", [True, False])
def test_router_matches_transformers_kimi_linear(num_group, topk_group, norm):
    kimi = importlib.import_module("transformers.models.kimi_linear.modeling_kimi_linear")
    from transformers.models.kimi_linear.configuration_kimi_linear import KimiLinearConfig

    config = KimiLinearConfig(hidden_size=24, num_local_experts=16, num_experts_per_tok=4, n_group=num_group,
                              topk_group=topk_group, norm_topk_prob=norm, routed_scaling_factor=SCALING)
    router = kimi.KimiLinearTopkRouter(config)
    with torch.no_grad():
        router.weight.copy_(torch.randn(16, 24))
        router.e_score_correction_bias.copy_(torch.randn(16) * 0.2)
        hidden = torch.randn(2, 9, 24)
        logits, w_ref, ids_ref = router(hidden)
    w, ids = route(logits, router.e_score_correction_bias, 4, num_group, topk_group, norm, SCALING)
    w, ids = _by_id(w, ids)
    w_ref, ids_ref = _by_id(w_ref, ids_ref)
    assert torch.equal(ids, ids_ref)
    torch.testing.assert_close(w, w_ref, atol=1e-6, rtol=1e-6)


def _experts(T, D, I, E, k, dtype=torch.float32):
    x = torch.randn(T, D).to(dtype)
    w1, w3 = (torch.randn(E, I, D) / D**0.5).to(dtype), (torch.randn(E, I, D) / D**0.5).to(dtype)
    w2 = (torch.randn(E, D, I) / I**0.5).to(dtype)
    weights, ids = route(torch.randn(T, E), torch.zeros(E), k, 1, 1, True, SCALING)
    return x, w1, w3, w2, weights, ids


SWIGLU = GatedActivation("silu")
SITU = GatedActivation("situ", beta=4.0, linear_beta=25.0)


@pytest.mark.parametrize("act", [SWIGLU, SITU], ids=["silu", "situ"])
@pytest.mark.parametrize("T,E", [(53, 8), (3, 16)])  # the second leaves most experts without tokens
def test_grouped_equals_naive(act, T, E):
    args = _experts(T, 32, 24, E, 3)
    torch.testing.assert_close(moe_experts_grouped(*args, act), moe_experts_naive(*args, act), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("grouped_mm", [True, False], ids=["grouped_mm", "loop"])
@pytest.mark.parametrize("fused", [True, False], ids=["fused_gate_up", "separate"])
def test_grouped_paths_equal_naive(monkeypatch, grouped_mm, fused):
    from kernels.moe import grouped

    if not grouped_mm:
        monkeypatch.setattr(grouped, "_grouped_mm", None)
    x, w1, w3, w2, weights, ids = _experts(80, 32, 24, 16, 3)  # past DENSE_MAX_TOKENS: the sorted grouped form
    if fused:
        gate_up = torch.cat([w1, w3], dim=1)  # [E, 2I, D], the layout StackedExperts binds
        w1, w3 = gate_up[:, :24], gate_up[:, 24:]
        assert grouped.gate_up_storage(w1, w3) is not None
    else:
        assert grouped.gate_up_storage(w1, w3) is None
    out = moe_experts_grouped(x, w1, w3, w2, weights, ids, SITU)
    torch.testing.assert_close(out, moe_experts_naive(x, w1, w3, w2, weights, ids, SITU), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("T,E,k,path", [(1, 8, 2, "gathered"), (1, 16, 4, "gathered"), (2, 8, 2, "sorted"),
                                         (4, 16, 4, "sorted"), (32, 16, 4, "sorted"), (4, 16, 4, "every_expert")])
@pytest.mark.parametrize("fused", [True, False], ids=["fused_gate_up", "separate"])
def test_small_batch_paths_equal_naive(monkeypatch, T, E, k, path, fused):
    """Each small-batch path (chosen by shape alone; every_expert is what a compiled step takes) equals the oracle,
    including assignments outside [0, E) (another rank's experts), which add nothing."""
    from kernels.moe import grouped

    if path == "every_expert":
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
        monkeypatch.setattr(grouped, "gate_up_storage", lambda w1, w3: None)  # as when compiling

    called = []
    for name in ("moe_experts_gathered", "moe_experts_every_expert", "sort_assignments"):
        real = getattr(grouped, name)
        monkeypatch.setattr(grouped, name, lambda *a, _real=real, _name=name: called.append(_name) or _real(*a))
    x, w1, w3, w2, weights, ids = _experts(T, 32, 24, E, k)
    if fused:
        gate_up = torch.cat([w1, w3], dim=1)
        w1, w3 = gate_up[:, :24], gate_up[:, 24:]
    ids = ids.clone()
    ids[0, -1] = E + 3  # an expert on another rank (expert parallelism)
    out = moe_experts_grouped(x, w1, w3, w2, weights, ids, SITU)
    assert called == (["sort_assignments"] if path == "sorted" else [f"moe_experts_{path}"])
    torch.testing.assert_close(out, moe_experts_naive(x, w1, w3, w2, weights, ids, SITU), atol=1e-5, rtol=1e-5)
    ids[0, 0] = (ids[0, 0] + 1) % E  # negative control: another expert changes the token's output
    assert not torch.allclose(moe_experts_grouped(x, w1, w3, w2, weights, ids, SITU)[0], out[0], atol=1e-4)


def test_grouped_float64_uses_the_loop():
    args = _experts(80, 16, 8, 4, 2, dtype=torch.float64)
    torch.testing.assert_close(moe_experts_grouped(*args, SWIGLU), moe_experts_naive(*args, SWIGLU))


def test_grouped_equals_naive_bf16():
    args = _experts(70, 32, 16, 8, 2, dtype=torch.bfloat16)
    out = moe_experts_grouped(*args, SWIGLU)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, moe_experts_naive(*args, SWIGLU), atol=1e-2, rtol=1e-2)


def test_naive_matches_per_token_formula():
    x, w1, w3, w2, weights, ids = _experts(6, 16, 8, 4, 2)
    out = moe_experts_naive(x, w1, w3, w2, weights, ids, SWIGLU)
    for t in range(6):
        expected = sum(weights[t, j] * (w2[e] @ (F.silu(w1[e] @ x[t]) * (w3[e] @ x[t])))
                       for j, e in enumerate(ids[t].tolist()))
        torch.testing.assert_close(out[t], expected, atol=1e-5, rtol=1e-5)


def test_naive_matches_transformers_kimi_linear_experts():
    kimi = importlib.import_module("transformers.models.kimi_linear.modeling_kimi_linear")
    from transformers.models.kimi_linear.configuration_kimi_linear import KimiLinearConfig

    config = KimiLinearConfig(hidden_size=16, moe_intermediate_size=8, num_local_experts=4)
    experts = kimi.KimiLinearExperts(config)
    x, w1, w3, w2, weights, ids = _experts(10, 16, 8, 4, 2)
    with torch.no_grad():
        experts.gate_up_proj.copy_(torch.cat([w1, w3], dim=1))
        experts.down_proj.copy_(w2)
        expected = experts(x, ids, weights)
    torch.testing.assert_close(moe_experts_naive(x, w1, w3, w2, weights, ids, SWIGLU), expected, atol=1e-5,
                               rtol=1e-5)


def test_silu_activation_in_input_dtype():
    g, u = torch.randn(64).to(torch.bfloat16), torch.randn(64).to(torch.bfloat16)
    out = SWIGLU(g, u)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, F.silu(g) * u, atol=0, rtol=0)


@pytest.mark.parametrize("linear_beta", [None, 25.0])
def test_situ_activation_formula(linear_beta):
    act = GatedActivation("situ", beta=4.0, linear_beta=linear_beta)
    g, u = (torch.randn(200) * 10).to(torch.bfloat16), (torch.randn(200) * 40).to(torch.bfloat16)
    out = act(g, u)
    assert out.dtype == torch.bfloat16
    expected = []
    for gv, uv in zip(g.float().tolist(), u.float().tolist()):
        a = 4.0 * math.tanh(gv / 4.0) / (1.0 + math.exp(-gv))
        b = uv if linear_beta is None else linear_beta * math.tanh(uv / linear_beta)
        expected.append(a * b)
    torch.testing.assert_close(out.float(), torch.tensor(expected).to(torch.bfloat16).float(), atol=0.0, rtol=1e-2)


def test_situ_saturates():
    act = GatedActivation("situ", beta=4.0, linear_beta=25.0)
    out = act(torch.tensor([100.0]), torch.tensor([1000.0]))
    torch.testing.assert_close(out, torch.tensor([100.0]))  # 4 * 1 * 1 * 25


def test_unknown_activation_rejected():
    with pytest.raises(ValueError):
        GatedActivation("gelu")


def _input_major(w1, w3, w2):
    """The routed experts as `lay_out_for_gemv` + binding store them on CPU: gate/up one input-major [E, D, 2I]
    tensor, down input-major (same shapes and values)."""
    gate_up = torch.cat([w1, w3], dim=1).transpose(1, 2).contiguous().transpose(1, 2)  # [E, 2I, D] input-major
    I = w1.shape[1]
    return gate_up[:, :I], gate_up[:, I:], w2.transpose(1, 2).contiguous().transpose(1, 2)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)], ids=["fp32", "bf16"])
@pytest.mark.parametrize("T,E,k", [(1, 8, 2), (4, 16, 4), (2, 32, 4)])
@pytest.mark.parametrize("kernel", [True, False], ids=["expert_gemm", "embedding_bags"])
def test_bagged_path_equals_naive(monkeypatch, dtype, tol, T, E, k, kernel):
    """Input-major experts with T·k <= E take the in-place path — fp32 through kernels/cpu/expert_gemm.py where
    it runs, else weighted embedding bags — which equals the oracle, including an assignment on another rank's
    expert (adds nothing); negative control: another expert changes the output."""
    from kernels.cpu import expert_gemm
    from kernels.moe import grouped

    called = []
    for name in ("moe_experts_bagged", "moe_experts_gathered", "sort_assignments"):
        real = getattr(grouped, name)
        monkeypatch.setattr(grouped, name, lambda *a, _real=real, _name=name: called.append(_name) or _real(*a))
    real_products = expert_gemm.products
    monkeypatch.setattr(expert_gemm, "products", lambda *a: called.append("expert_gemm") or real_products(*a))
    if not kernel:
        monkeypatch.setattr(expert_gemm, "runs", lambda x, experts: False)
    x, w1, w3, w2, weights, ids = _experts(T, 32, 24, E, k, dtype=dtype)
    w1, w3, w2 = _input_major(w1, w3, w2)
    assert grouped.bag_layout(w1, w3, w2) is not None and grouped.gate_up_storage(w1, w3) is None
    ids = ids.clone()
    ids[0, -1] = E + 3  # an expert on another rank (expert parallelism)
    out = moe_experts_grouped(x, w1, w3, w2, weights, ids, SITU)
    kernel_ran = kernel and dtype == torch.float32 and expert_gemm.runs(x, torch.zeros(1, 1, 1))
    assert called == ["moe_experts_bagged"] + ["expert_gemm"] * kernel_ran and out.dtype == dtype
    torch.testing.assert_close(out, moe_experts_naive(x, w1, w3, w2, weights, ids, SITU), atol=tol, rtol=tol)
    ids[0, 0] = (ids[0, 0] + 1) % E  # negative control
    assert not torch.allclose(moe_experts_grouped(x, w1, w3, w2, weights, ids, SITU)[0], out[0], atol=10 * tol)


@pytest.mark.parametrize("T,path", [(16, "moe_experts_bagged"), (32, "moe_experts_bagged"), (33, "sort_assignments")])
def test_the_kernel_takes_up_to_eight_assignments_per_expert(monkeypatch, T, path):
    """fp32 input-major experts go through the small-batch kernel (grouped by expert) while T·k <= 8·E — a
    verification's or a decode batch's tokens, 4 and 8 an expert here — and past it the sorted form; equal to the
    oracle either way. Without the kernel, T·k > E takes the sorted form (the negative control)."""
    from kernels.cpu import small_gemm
    from kernels.moe import grouped

    called = []
    for name in ("moe_experts_bagged", "sort_assignments"):
        real = getattr(grouped, name)
        monkeypatch.setattr(grouped, name, lambda *a, _real=real, _name=name: called.append(_name) or _real(*a))
    x, w1, w3, w2, weights, ids = _experts(T, 32, 24, 8, 2)
    w1, w3, w2 = _input_major(w1, w3, w2)
    out = moe_experts_grouped(x, w1, w3, w2, weights, ids, SITU)
    assert called == [path if small_gemm.available() else "sort_assignments"]
    torch.testing.assert_close(out, moe_experts_naive(x, w1, w3, w2, weights, ids, SITU), atol=1e-5, rtol=1e-5)
    monkeypatch.setattr(small_gemm, "available", lambda: False)
    called.clear()
    moe_experts_grouped(x, w1, w3, w2, weights, ids, SITU)
    assert called == ["sort_assignments"]


@pytest.mark.parametrize("T,compiling", [(40, False), (6, True)], ids=["sorted", "every_expert"])
def test_input_major_experts_on_the_other_paths(monkeypatch, T, compiling):
    """More assignments than experts (sorted grouped form) and a compiled step (every expert) read input-major
    experts without reshaping them: equal to the oracle."""
    from kernels.moe import grouped

    if compiling:
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    x, w1, w3, w2, weights, ids = _experts(T, 32, 24, 8, 2)
    w1, w3, w2 = _input_major(w1, w3, w2)
    assert (grouped.bound_gate_up(w1, w3) is None) == compiling
    out = moe_experts_grouped(x, w1, w3, w2, weights, ids, SITU)
    torch.testing.assert_close(out, moe_experts_naive(x, w1, w3, w2, weights, ids, SITU), atol=1e-5, rtol=1e-5)


def test_bags_from_the_fused_gate_up_equal_the_checked_ones():
    """`bag_layout_of_fused` (what a compiled step gets from the bound tensor, strides only) gives the same tables
    as `bag_layout` (storage checked) and the same output through `moe_experts_bags`; a row-major gate/up tensor
    or down tensor gets None (its rows are not bags: the negative control of the stride check)."""
    from kernels.moe import grouped

    x, w1, w3, w2, weights, ids = _experts(2, 32, 24, 16, 4)
    w1, w3, w2 = _input_major(w1, w3, w2)
    fused = w1.as_strided((16, 48, 32), w1.stride())  # [E, 2I, D]: the tensor w1 and w3 are halves of
    checked, from_fused = grouped.bag_layout(w1, w3, w2), grouped.bag_layout_of_fused(fused, w2)
    assert torch.equal(checked.gate_up, from_fused.gate_up) and torch.equal(checked.down, from_fused.down)
    out = grouped.moe_experts_bags(x, from_fused, 16, weights, ids, SITU)
    torch.testing.assert_close(out, moe_experts_naive(x, w1, w3, w2, weights, ids, SITU), atol=1e-5, rtol=1e-5)
    assert grouped.bag_layout_of_fused(fused.contiguous(), w2) is None
    assert grouped.bag_layout_of_fused(fused, w2.contiguous()) is None


def test_triton_align_groups_each_experts_assignments_into_its_blocks():
    """`align` (the fused Triton MoE's routing, tensor ops only — its counts are a scatter-add, since `bincount`
    syncs on CUDA): every on-rank assignment sits in a block of its expert, each expert's run is padded with the
    sentinel T·k, off-rank ids (-1, >= E) are dropped; negative control: a shuffled block map breaks the check."""
    from kernels.moe.triton_fused import align

    torch.manual_seed(0)
    num_experts, block_m = 6, 4
    topk_ids = torch.randint(-1, num_experts + 2, (13, 3))  # [T, k], some off this rank
    flat = topk_ids.reshape(-1)
    sorted_ids, block_expert = align(topk_ids, num_experts, block_m)

    def grouped_right(block_expert):
        seen = []
        for b, expert in enumerate(block_expert.tolist()):
            ids = [i for i in sorted_ids[b * block_m:(b + 1) * block_m].tolist() if i != flat.numel()]
            if expert < 0 or any(flat[i].item() != expert for i in ids):
                if ids:
                    return False
            seen += ids
        on_rank = [i for i, e in enumerate(flat.tolist()) if 0 <= e < num_experts]
        return sorted(seen) == on_rank

    assert grouped_right(block_expert)
    nonempty = block_expert[block_expert >= 0]
    assert nonempty.unique().numel() > 1
    assert not grouped_right(block_expert.roll(1))
