"""Each Kimi K3 form against a naive, readable reference written here from docs/architecture.md ("The two model families").

Forms: (a) attention residuals — `attn_res_mix` and a whole `KimiTextModel` stack's block bookkeeping; (b) SiTU;
(c) the lower-bounded KDA gate with `A_log` padded to [128]; (d) gated MLA with q-LoRA, run through the paged cache
in the absorbed form, against a non-absorbed causal MLA; (e) latent MoE with SiTU experts and shared experts.
The naive references compute in float64 from the modules' own weights, on fresh random inputs.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from engine.model.batch import CacheTensors, ForwardBatch
from engine.model.config import ModelConfig
from engine.model.init import init_random_weights
from engine.model.layers import MLAMixer, SparseMoE, attn_res_mix, gated_activation
from engine.model.model import KimiTextModel
from engine.model.presets import preset_config
from kernels.kda.gate import kda_gate_lower_bound
from kernels.moe.activation import GatedActivation


def _k3_config(**text_overrides) -> ModelConfig:
    raw = copy.deepcopy(preset_config("tiny-k3"))
    raw["text_config"].update(text_overrides)
    return ModelConfig.from_dict(raw)


def _rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours.double() - ref.double()).abs().max() / ref.double().abs().max())


def _rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Weightless RMS normalisation over the last dim, float64."""
    x = x.double()
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)


# ---------------------------------------------------------------------------------------------------------------
# (a) attention residuals
# ---------------------------------------------------------------------------------------------------------------

def naive_mix(candidates: list[torch.Tensor], norm_weight: torch.Tensor, proj_weight: torch.Tensor,
              eps: float) -> torch.Tensor:
    """Σ_j softmax_j(rmsnorm_noweight(V_j) · (norm_weight ⊙ proj_weight[0])) · V_j, token by token, float64."""
    w = norm_weight.double() * proj_weight.double()[0]  # [D]
    T = candidates[0].shape[0]
    out = torch.zeros(T, candidates[0].shape[1], dtype=torch.float64)
    for t in range(T):
        scores = torch.stack([(_rms(v[t], eps) * w).sum() for v in candidates])  # [J]
        probs = torch.exp(scores - scores.max())
        probs = probs / probs.sum()
        for j, v in enumerate(candidates):
            out[t] += probs[j] * v[t].double()
    return out


@pytest.mark.parametrize("num_blocks", [0, 1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attn_res_mix_matches_loop(num_blocks, dtype):
    T, D, eps = 5, 48, 1e-5
    blocks = [4 * torch.randn(T, D).to(dtype) for _ in range(num_blocks)]
    prefix_sum = torch.randn(T, D).to(dtype)
    norm_w = 1 + 0.1 * torch.randn(D)
    proj_w = torch.randn(1, D)  # large enough that the softmax is far from uniform
    got = attn_res_mix(blocks, prefix_sum, norm_w, proj_w, eps)
    want = naive_mix(blocks + [prefix_sum], norm_w, proj_w, eps)
    assert got.dtype == dtype
    if dtype == torch.float32:
        assert _rel_err(got, want) <= 1e-6
    else:  # computed in fp32 over the raw bf16 values, rounded once at the end
        assert torch.equal(got, want.to(torch.float32).to(dtype)) or _rel_err(got, want) <= 2 ** -8


class _StandInMixer(nn.Module):
    """Deterministic stand-in for a layer's mixer: tanh(x @ W), ignoring batch and cache."""

    def __init__(self, d: int, gen: torch.Generator):
        super().__init__()
        self.w = nn.Parameter(torch.randn(d, d, generator=gen) / math.sqrt(d), requires_grad=False)

    def forward(self, x, batch=None, cache=None):
        return torch.tanh(x @ self.w)


class _StandInFFN(nn.Module):
    def __init__(self, d: int, gen: torch.Generator):
        super().__init__()
        self.w = nn.Parameter(torch.randn(d, d, generator=gen) / math.sqrt(d), requires_grad=False)

    def forward(self, x):
        return 0.5 * torch.sin(x @ self.w) + 0.1 * x


def _naive_stack(model: KimiTextModel, emb: torch.Tensor, block_size: int) -> tuple[torch.Tensor, int]:
    """The attention-residual loop of docs/architecture.md, written out; returns (model.norm output, number of snapshots)."""
    eps = model.config.rms_norm_eps
    snapshots: list[torch.Tensor] = []
    prefix_sum = emb.double()
    for i, layer in enumerate(model.layers):
        h = prefix_sum if not snapshots else naive_mix(
            snapshots + [prefix_sum], layer.self_attention_res_norm.weight, layer.self_attention_res_proj.weight, eps)
        restart = i % block_size == 0
        if restart:
            snapshots.append(prefix_sum)
        x = (_rms(h, eps) * layer.input_layernorm.weight.double()).float()
        a = layer.self_attn(x).double()
        prefix_sum = a if restart else prefix_sum + a
        h = naive_mix(snapshots + [prefix_sum], layer.mlp_res_norm.weight, layer.mlp_res_proj.weight, eps)
        x = (_rms(h, eps) * layer.post_attention_layernorm.weight.double()).float()
        prefix_sum = prefix_sum + layer.ffn(x).double()
    h = naive_mix(snapshots + [prefix_sum], model.output_attn_res_norm.weight, model.output_attn_res_proj.weight, eps)
    return _rms(h, eps) * model.norm.weight.double(), len(snapshots)


@pytest.mark.parametrize("num_layers,block_size", [(7, 3), (6, 2), (4, 12)])
def test_decoder_stack_residual_bookkeeping(num_layers, block_size):
    """Snapshots every `block_size` layers (the embedding first), restarts, mixes and the output mix."""
    raw = copy.deepcopy(preset_config("tiny-k3"))
    text = raw["text_config"]
    mla_layers = [num_layers]
    text.update({"num_hidden_layers": num_layers, "attn_res_block_size": block_size})
    text["linear_attn_config"].update({"full_attn_layers": mla_layers,
                                      "kda_layers": [i for i in range(1, num_layers + 1) if i not in mla_layers]})
    config = ModelConfig.from_dict(raw)
    model = KimiTextModel(config)
    init_random_weights(model, seed=11)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for layer in model.layers:
            layer.self_attention_res_proj.weight.normal_(0, 0.5, generator=gen)  # non-uniform mixes
            layer.mlp_res_proj.weight.normal_(0, 0.5, generator=gen)
            layer.self_attn = _StandInMixer(config.hidden_size, gen)
            if layer.spec.ffn == "moe":
                layer.block_sparse_moe = _StandInFFN(config.hidden_size, gen)
            else:
                layer.mlp = _StandInFFN(config.hidden_size, gen)
        model.output_attn_res_proj.weight.normal_(0, 0.5, generator=gen)
    T = 6
    ids = torch.randint(0, config.vocab_size, (T,), generator=gen)
    batch = ForwardBatch(input_ids=ids, cu_seqlens=torch.tensor([0, T]), seq_lens=torch.tensor([T]),
                         block_tables=torch.zeros(1, 1, dtype=torch.int32), slot_mapping=torch.arange(T),
                         state_indices=torch.tensor([0]))
    with torch.no_grad():
        got = model(batch, cache=None)
        want, num_snapshots = _naive_stack(model, model.embed_tokens(ids), block_size)
    assert num_snapshots == -(-num_layers // block_size)
    assert _rel_err(got, want) <= 1e-5


# ---------------------------------------------------------------------------------------------------------------
# (b) SiTU
# ---------------------------------------------------------------------------------------------------------------

def naive_situ(g: torch.Tensor, u: torch.Tensor, beta1: float, beta2: float) -> torch.Tensor:
    g, u = g.double(), u.double()
    return beta1 * torch.tanh(g / beta1) * torch.sigmoid(g) * beta2 * torch.tanh(u / beta2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_situ_matches_formula(dtype):
    act = GatedActivation(kind="situ", beta=4, linear_beta=25)
    g = torch.cat([10 * torch.randn(2000), torch.tensor([-80.0, -20.0, 0.0, 20.0, 80.0])]).to(dtype)
    u = torch.cat([40 * torch.randn(2000), torch.tensor([-200.0, -25.0, 0.0, 25.0, 200.0])]).to(dtype)
    got = act(g, u)
    want = naive_situ(g, u, 4.0, 25.0)
    assert got.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)
    else:
        torch.testing.assert_close(got, want.to(dtype), rtol=2 ** -7, atol=1e-6)
    # bounded: |g-part| < β₁, |u-part| < β₂
    assert float(got.float().abs().max()) <= 4.0 * 25.0


def test_k3_config_selects_situ_with_released_betas():
    act = gated_activation(_k3_config())
    assert (act.kind, act.beta, act.linear_beta) == ("situ", 4.0, 25.0)


# ---------------------------------------------------------------------------------------------------------------
# (c) lower-bounded KDA gate
# ---------------------------------------------------------------------------------------------------------------

def naive_lower_bound_gate(f: torch.Tensor, a_log_per_head: torch.Tensor, dt_bias: torch.Tensor, num_heads: int,
                           lower_bound: float) -> torch.Tensor:
    T, HK = f.shape
    K = HK // num_heads
    out = torch.empty(T, num_heads, K, dtype=torch.float64)
    for h in range(num_heads):
        a = math.exp(float(a_log_per_head[h]))
        for c in range(K):
            x = f[:, h * K + c].double() + float(dt_bias[h * K + c])
            out[:, h, c] = lower_bound * torch.sigmoid(a * x)
    return out


@pytest.mark.parametrize("f_dtype", [torch.float32, torch.bfloat16])
def test_kda_lower_bound_gate_with_padded_a_log(f_dtype):
    H, K, T, lower = 3, 16, 7, -5.0
    a_log = torch.empty(H).uniform_(math.log(1), math.log(16))
    padded = torch.full((128,), 50.0)  # garbage past H must be ignored
    padded[:H] = a_log
    dt_bias = torch.randn(H * K)
    f = (3 * torch.randn(T, H * K)).to(f_dtype)
    got = kda_gate_lower_bound(f, padded, dt_bias, H, lower)
    want = naive_lower_bound_gate(f, a_log, dt_bias, H, lower)
    assert got.dtype == torch.float32 and got.shape == (T, H, K)
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)
    assert bool(((got >= lower) & (got <= 0)).all())  # (lower, 0), closed only where fp32 sigmoid saturates
    unpadded = kda_gate_lower_bound(f, a_log, dt_bias, H, lower)
    assert torch.equal(got, unpadded)


# ---------------------------------------------------------------------------------------------------------------
# (d) gated MLA with q-LoRA
# ---------------------------------------------------------------------------------------------------------------

def naive_mla(mixer: MLAMixer, x: torch.Tensor) -> torch.Tensor:
    """Non-absorbed causal MLA with NoPE over all tokens of one sequence, float64. x [T, D] -> [T, D]."""
    mla = mixer.mla
    H, nope, rope = mla.num_heads, mla.qk_nope_head_dim, mla.qk_rope_head_dim
    lora, vd = mla.kv_lora_rank, mla.v_head_dim
    W = {name: p.detach().double() for name, p in mixer.named_parameters()}
    x = x.double()
    T = x.shape[0]
    q_lat = x @ W["q_a_proj.weight"].t()
    q = (_rms(q_lat, 1e-6) * W["q_a_layernorm.weight"]) @ W["q_b_proj.weight"].t()
    q = q.view(T, H, nope + rope)
    ckv = x @ W["kv_a_proj_with_mqa.weight"].t()  # [T, lora + rope]
    c = _rms(ckv[:, :lora], 1e-6) * W["kv_a_layernorm.weight"]  # only the latent is normalised
    k_rope = ckv[:, lora:]  # [T, rope], shared by all heads, never rotated
    kv = (c @ W["kv_b_proj.weight"].t()).view(T, H, nope + vd)
    k_nope, v = kv[..., :nope], kv[..., nope:]
    scale = (nope + rope) ** -0.5
    out = torch.zeros(T, H, vd, dtype=torch.float64)
    for h in range(H):
        k = torch.cat([k_nope[:, h], k_rope], dim=-1)  # [T, nope + rope]
        scores = (q[:, h] @ k.t()) * scale  # [T, T]
        scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
        out[:, h] = torch.softmax(scores, dim=-1) @ v[:, h]
    attn = out.reshape(T, H * vd) * torch.sigmoid(x @ W["g_proj.weight"].t())
    return attn @ W["o_proj.weight"].t()


def test_gated_mla_matches_naive_through_paged_cache():
    config = _k3_config()
    layer_index = config.mla_layer_ids[0]
    mixer = MLAMixer(config, layer_index)
    init_random_weights(mixer, seed=7)
    assert mixer.mla.q_lora_rank and mixer.mla.output_gate
    block_size, table = 4, torch.tensor([[5, 2, 7, 0, 3, 6, 1, 4]], dtype=torch.int32)  # scattered blocks
    cache = CacheTensors.allocate(config, num_blocks=8, block_size=block_size, num_slots=1, dtype=torch.float32)
    cache.kv[layer_index].fill_(float("nan"))  # unwritten slots must never be read
    steps = [11, 5, 1, 1]  # prefill, continued prefill, two decodes
    x = torch.randn(sum(steps), config.hidden_size)
    want = naive_mla(mixer, x)
    done = 0
    with torch.no_grad():
        for n in steps:
            positions = torch.arange(done, done + n)
            slots = table[0, positions // block_size].long() * block_size + positions % block_size
            batch = ForwardBatch(input_ids=torch.zeros(n, dtype=torch.long), cu_seqlens=torch.tensor([0, n]),
                                 seq_lens=torch.tensor([done + n]), block_tables=table, slot_mapping=slots,
                                 state_indices=torch.tensor([0]))
            got = mixer(x[done:done + n], batch, cache)
            assert _rel_err(got, want[done:done + n]) <= 1e-5, f"tokens {done}..{done + n - 1}"
            done += n


# ---------------------------------------------------------------------------------------------------------------
# (e) latent MoE
# ---------------------------------------------------------------------------------------------------------------

def naive_route(x: torch.Tensor, moe_module: SparseMoE) -> list[list[tuple[int, float]]]:
    """Per token: [(expert, weight)] from fp32 sigmoid scores, biased choice, grouped top-k, renormalised."""
    cfg = moe_module.moe
    logits = x.float() @ moe_module.gate.weight.detach().float().t()  # fp32 logits, as released
    scores = torch.sigmoid(logits).double()
    bias = moe_module.gate.e_score_correction_bias.detach().double()
    per_group = cfg.num_experts // cfg.num_expert_group
    routes = []
    for t in range(x.shape[0]):
        choice = scores[t] + bias
        allowed = set(range(cfg.num_experts))
        if cfg.num_expert_group > 1 and cfg.num_expert_group > cfg.topk_group:
            group_score = [sorted(choice[g * per_group:(g + 1) * per_group].tolist())[-2:] for g in
                           range(cfg.num_expert_group)]
            best = sorted(range(cfg.num_expert_group), key=lambda g: -sum(group_score[g]))[: cfg.topk_group]
            allowed = {e for e in allowed if e // per_group in best}
        chosen = sorted(allowed, key=lambda e: -float(choice[e]))[: cfg.top_k]
        weights = [float(scores[t, e]) for e in chosen]
        if cfg.renormalize and cfg.top_k > 1:
            total = sum(weights) + 1e-20
            weights = [w / total for w in weights]
        routes.append([(e, w * cfg.routed_scaling_factor) for e, w in zip(chosen, weights)])
    return routes


def naive_latent_moe(moe_module: SparseMoE, x: torch.Tensor, eps: float, beta1: float, beta2: float) -> torch.Tensor:
    W = {name: p.detach().double() for name, p in moe_module.named_parameters()}
    xd = x.double()
    z = xd @ W["routed_expert_down_proj.weight"].t()  # [T, latent]
    y = torch.zeros_like(z)
    for t, route in enumerate(naive_route(x, moe_module)):
        for e, weight in route:
            gate = W["experts.w1"][e] @ z[t]
            up = W["experts.w3"][e] @ z[t]
            y[t] += weight * (W["experts.w2"][e] @ naive_situ(gate, up, beta1, beta2))
    y = _rms(y, eps) * W["routed_expert_norm.weight"]
    y = y @ W["routed_expert_up_proj.weight"].t()
    shared = naive_situ(xd @ W["shared_experts.gate_proj.weight"].t(), xd @ W["shared_experts.up_proj.weight"].t(),
                        beta1, beta2) @ W["shared_experts.down_proj.weight"].t()
    return y + shared


def test_latent_moe_matches_naive_loop():
    config = _k3_config(num_shared_experts=2)
    moe_module = SparseMoE(config)
    init_random_weights(moe_module, seed=9)
    with torch.no_grad():  # a bias large enough to change choices, so biased choice vs unbiased weight is tested
        moe_module.gate.e_score_correction_bias.normal_(0, 0.3, generator=torch.Generator().manual_seed(1))
    moe = config.moe
    assert moe.latent_size and moe.latent_size != config.hidden_size and moe.latent_use_norm
    assert moe.num_expert_group > moe.topk_group > 0  # the grouped choice is exercised
    assert moe_module.shared_experts.gate_proj.weight.shape[0] == moe.intermediate_size * moe.num_shared_experts
    x = torch.randn(24, config.hidden_size)
    with torch.no_grad():
        got = moe_module(x)
    act = config.activation
    want = naive_latent_moe(moe_module, x, config.rms_norm_eps, act.situ_beta, act.situ_linear_beta)
    assert _rel_err(got, want) <= 1e-5
