"""Fused weights (engine/model/fused.py): the loader binds projections of one input to one tensor without changing
names, shapes or values; a bound model, a broken binding and an unbound model give the same logits."""

from __future__ import annotations

import pytest
import torch

from engine.model.checkpoint import make_checkpoint
from engine.model.fused import FusedLinear, ParamGroup
from engine.model.init import init_random_weights
from engine.model.loader import LoadConfig, checkpoint_layout, load_model
from engine.model.model import KimiForCausalLM
from kernels.moe.grouped import bag_layout
from tests.model_driver import SequenceDriver


def _groups(model):
    return [v for m in model.modules() for v in vars(m).values() if isinstance(v, (FusedLinear, ParamGroup))]


def _logits(model, prompts):
    driver = SequenceDriver(model, max_seqs=len(prompts), max_len=64)
    out = driver.step(dict(enumerate(prompts)), all_logits=True)  # prefill, packed
    steps = [driver.step({n: [p[-1]] for n, p in enumerate(prompts)})]  # one decode step
    return torch.cat([out, *steps])


@pytest.mark.parametrize("preset", ["tiny-linear", "tiny-k3"])
def test_loader_binds_every_group_and_keeps_the_layout(tmp_path, preset):
    model_dir = make_checkpoint(preset, tmp_path / preset, seed=1)
    model = load_model(model_dir, LoadConfig(dtype="float32"))
    groups = _groups(model)
    assert groups and all((g.group if isinstance(g, FusedLinear) else g).tensor() is not None for g in groups)
    experts = next(m for m in model.modules() if hasattr(m, "w1") and hasattr(m, "w3"))
    fused = experts.gate_up.tensor()  # [E, 2I, D]
    assert torch.equal(fused[:, : experts.w1.shape[1]], experts.w1) and torch.equal(
        fused[:, experts.w1.shape[1] :], experts.w3)
    unbound = KimiForCausalLM(model.config)  # same names and shapes as the bound model
    assert {n: tuple(p.shape) for n, p in unbound.named_parameters()} == {
        n: tuple(p.shape) for n, p in model.named_parameters()}
    assert set(checkpoint_layout(model)) == set(checkpoint_layout(unbound))


@pytest.mark.parametrize("preset", ["tiny-linear", "tiny-k3"])
def test_bound_broken_and_unbound_models_agree(tmp_path, preset):
    model_dir = make_checkpoint(preset, tmp_path / preset, seed=1)
    model = load_model(model_dir, LoadConfig(dtype="float32"))
    unbound = KimiForCausalLM(model.config).eval().requires_grad_(False)
    with torch.no_grad():
        for (name, p), (_, q) in zip(unbound.named_parameters(), model.named_parameters()):
            p.copy_(q.to(p.dtype))
    assert not any((g.group if isinstance(g, FusedLinear) else g).tensor() is not None for g in _groups(unbound))
    prompts = [[5, 17, 99, 3, 250, 7, 8], [42, 1000, 6]]
    bound = _logits(model, prompts)
    torch.testing.assert_close(_logits(unbound, prompts), bound, atol=1e-5, rtol=1e-5)
    attn = model.model.layers[0].self_attn
    attn.q_proj.weight.data = attn.q_proj.weight.data.clone()  # no longer a view: per-projection fallback
    assert attn.in_proj.group.tensor() is None
    torch.testing.assert_close(_logits(model, prompts), bound, atol=1e-5, rtol=1e-5)


def test_in_place_writes_reach_the_fused_tensor(tmp_path):
    model = load_model(make_checkpoint("tiny-linear", tmp_path / "m", seed=1), LoadConfig(dtype="float32"))
    init_random_weights(model, seed=7)  # in-place copies into every parameter
    mlp = model.model.layers[0].mlp
    fused = mlp.gate_up.group.tensor()
    assert fused is not None
    assert torch.equal(fused, torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]))


def test_fused_weight_is_padded_and_the_padding_never_reaches_an_output():
    torch.manual_seed(0)
    parts = [[torch.nn.Linear(8, 5, bias=False), torch.nn.Linear(8, 3, bias=False)], [torch.nn.Linear(8, 1, bias=False)]]
    fused = FusedLinear(parts)
    fused.group.bind()
    weight = fused.group.tensor()
    assert weight is not None and weight.shape == (16, 8)  # 9 rows padded to FUSED_ROWS_MULTIPLE
    assert torch.count_nonzero(weight[9:]) == 0
    x = torch.randn(4, 8)
    first, second = fused(x)
    assert first.shape == (4, 8) and second.shape == (4, 1)
    torch.testing.assert_close(first, torch.cat([parts[0][0](x), parts[0][1](x)], dim=-1))
    torch.testing.assert_close(second, parts[1][0](x))


def test_prefers_input_major_by_the_products_shape():
    """Wide products stream faster input-major, products with fewer outputs than inputs row-major, except narrow
    ones (a router)."""
    from engine.model.fused import INPUT_MAJOR_MAX_OUT, prefers_input_major

    assert prefers_input_major(8192, 768) and prefers_input_major(768, 768)
    assert not prefers_input_major(768, 2048) and not prefers_input_major(256, 768)
    assert prefers_input_major(INPUT_MAJOR_MAX_OUT, 768) and not prefers_input_major(INPUT_MAJOR_MAX_OUT + 1, 768)


@pytest.mark.parametrize("preset", ["tiny-linear", "tiny-k3"])
def test_cpu_load_stores_linears_input_major(tmp_path, preset, monkeypatch):
    """`load_model` on CPU lays linear weights out input-major where `prefers_input_major` says so for the product
    they take part in (a fused group's whole width) and row-major elsewhere (`lay_out_for_gemv`): same names, shapes
    and values, fused groups still bound (their members views of one tensor), MLA's reshaped kv_b_proj untouched,
    and the logits equal a row-major copy's within fp32 rounding (negative control: perturbing one weight moves
    them)."""
    from engine.model import fused
    from engine.model.fused import column_major, prefers_input_major, product_rows

    monkeypatch.setattr(fused, "small_gemm_reads", lambda weight, out_rows: False)  # MKL's layouts (kernel: the next test)
    model_dir = make_checkpoint(preset, tmp_path / preset, seed=2)
    model = load_model(model_dir, LoadConfig(dtype="float32"))
    weights = {n: p for n, p in model.named_parameters() if n.endswith("proj.weight") and p.dim() == 2}
    rows = product_rows(model)
    wanted = {n: "kv_b_proj" not in n and p.shape[0] > 1 and prefers_input_major(rows.get(id(p), p.shape[0]),
                                                                                 p.shape[1])
              for n, p in weights.items()}
    assert weights and {n: column_major(p) for n, p in weights.items()} == wanted
    assert any(wanted.values()) and not all(wanted.values())  # the rule picks both layouts on these presets
    assert all(p.is_contiguous() for n, p in weights.items() if not wanted[n])
    groups = _groups(model)
    assert all((g.group if isinstance(g, FusedLinear) else g).tensor() is not None for g in groups)
    experts = [m for m in model.modules() if type(m).__name__ == "StackedExperts"]
    assert experts and all(column_major(getattr(m, n)) for m in experts for n in ("w1", "w3", "w2"))
    assert all(bag_layout(m.w1, m.w3, m.w2) is not None for m in experts)  # the decode MoE reads rows in place
    row_major = KimiForCausalLM(model.config)
    row_major.load_state_dict({n: p.contiguous() for n, p in model.state_dict().items()})
    assert not any(column_major(p) for n, p in row_major.named_parameters() if n.endswith(("proj.weight", ".w2")))
    prompts = [[3, 9, 27, 81, 243], [7, 49, 343]]
    want = _logits(row_major.eval(), prompts)
    torch.testing.assert_close(_logits(model, prompts), want, atol=1e-4, rtol=1e-4)
    with torch.no_grad():
        next(iter(weights.values())).add_(0.5)
    assert not torch.allclose(_logits(model, prompts), want, atol=1e-3)


def test_linears_are_input_major_where_the_small_gemm_kernel_reads_them(tmp_path, monkeypatch):
    """Where kernels/cpu/small_gemm.py takes decode's fp32 products (`small_gemm_reads`), the loader stores every
    such linear weight input-major, the layout that kernel reads (MLA's reshaped kv_b_proj excepted, as always); the
    routed experts' stacks stay input-major (the bags read them); logits unchanged (negative control: with MKL's
    rule made to prefer row-major everywhere, the kernel's rule alone makes them input-major, and without it they
    stay row-major)."""
    from engine.model import fused
    from engine.model.fused import column_major

    model_dir = make_checkpoint("tiny-k3", tmp_path / "tiny-k3", seed=2)
    monkeypatch.setattr(fused, "prefers_input_major", lambda out_rows, in_features: False)
    monkeypatch.setattr(fused, "small_gemm_reads", lambda weight, out_rows: weight.dtype == torch.float32)
    model = load_model(model_dir, LoadConfig(dtype="float32"))
    weights = {n: p for n, p in model.named_parameters()
               if n.endswith("proj.weight") and p.dim() == 2 and "kv_b_proj" not in n and p.shape[0] > 1}
    assert weights and all(column_major(p) for p in weights.values())
    experts = [m for m in model.modules() if type(m).__name__ == "StackedExperts"]
    assert experts and all(column_major(m.w1) for m in experts)
    monkeypatch.setattr(fused, "small_gemm_reads", lambda weight, out_rows: False)
    mkl_layout = load_model(model_dir, LoadConfig(dtype="float32"))
    assert not any(column_major(p) for n, p in mkl_layout.named_parameters() if n in weights)
    prompts = [[3, 9, 27, 81, 243], [7, 49, 343]]
    torch.testing.assert_close(_logits(model, prompts), _logits(mkl_layout, prompts), atol=1e-4, rtol=1e-4)
