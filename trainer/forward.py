"""A differentiable full-sequence forward over the engine's own `KimiForCausalLM` parameters.

Contract:
- `train_forward(model, ids [B, T]) -> TrainOutput` (hidden [B, T, D] after the final norm, logits [B, T, V] fp32,
  per-MoE-layer expert loads). It reads the parameters of the engine's modules (so the checkpoint writer saves them
  under the official names) and computes the same function as the engine's cached forward, with autograd: KDA in a
  chunked WY form over whole sequences (no cache tensors), MLA in the non-absorbed form with causal SDPA (K3's MLA
  has no RoPE), routed experts gathered per expert. The engine's forward runs under `inference_mode` and writes
  caches in place, which autograd cannot follow; tests/unit/trainer/test_forward.py proves both give the same logits.
- K3 forms only as far as the demo uses them: attention residuals (either residual style is handled), SiTU or SiLU,
  K3's lower-bounded KDA gate (softplus gate too), gated Q-LoRA MLA, latent MoE with shared experts. No tensor
  parallelism (a single-rank model).
- Numerics: fp32 model; KDA chunk exponents are taken relative to the chunk's middle position, so with K3's gate
  (g > lower_bound >= -5 per token) and chunks of 16 no factor exceeds exp(40).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.model.layers import DecoderLayer, KDAMixer, MLAMixer, attn_res_mix
from engine.model.model import KimiForCausalLM
from engine.model.moe import SparseMoE
from engine.spec.drafter import FINAL_TAP
from kernels.kda.gate import kda_gate_lower_bound, kda_gate_softplus
from kernels.moe.router import route
from kernels.norm.rms_norm import gated_rms_norm, l2_normalize

KDA_CHUNK = 16


@dataclass
class TrainOutput:
    hidden: torch.Tensor  # [B, T, D]
    logits: torch.Tensor  # [B, T, V] fp32
    expert_loads: list[torch.Tensor]  # per MoE layer: [E] tokens routed to each expert
    taps: dict[int, torch.Tensor]  # requested tap id -> [B, T, D] (engine.spec.capture's rule)


def _mlp(mlp, x: torch.Tensor) -> torch.Tensor:
    return mlp.down_proj(mlp.act(mlp.gate_proj(x), mlp.up_proj(x)))  # the activation is autograd-safe when recording


def causal_conv_silu(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Depthwise causal conv + SiLU. x [B, T, C], weight [C, 1, W] -> [B, T, C]."""
    width = weight.shape[-1]
    y = F.conv1d(F.pad(x.transpose(1, 2), (width - 1, 0)), weight, groups=x.shape[-1])  # [B, C, T]
    return F.silu(y).transpose(1, 2)


def chunk_kda_train(q, k, v, g, beta, scale: float, chunk: int = KDA_CHUNK) -> torch.Tensor:
    """Gated delta rule over whole sequences from a zero state, chunkwise (WY form). q, k, g [B, T, H, K];
    v [B, T, H, V]; beta [B, T, H] -> o [B, T, H, V] fp32 (the math of `kernels.kda.naive`)."""
    b, t, h, dk = q.shape
    dv = v.shape[-1]
    pad = (-t) % chunk
    q, k, v, g = (F.pad(x.float(), (0, 0, 0, 0, 0, pad)) for x in (q, k, v, g))
    beta = F.pad(beta.float(), (0, 0, 0, pad))
    n = (t + pad) // chunk

    def blocks(x):  # [B, T, H, X] -> [B, H, N, C, X]
        return x.reshape(b, n, chunk, h, -1).permute(0, 3, 1, 2, 4)

    q, k, v, g = blocks(q), blocks(k), blocks(v), blocks(g)
    beta = beta.reshape(b, n, chunk, h).permute(0, 3, 1, 2).unsqueeze(-1)  # [B, H, N, C, 1]
    cum = g.cumsum(-2)  # [B, H, N, C, K], G_i (inclusive)
    mid = cum[..., chunk // 2 : chunk // 2 + 1, :]  # [B, H, N, 1, K]
    k_in, k_out = k * torch.exp(cum - mid), k * torch.exp(mid - cum)
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()  # j <= i
    a_kk = (k_in @ k_out.transpose(-1, -2)).masked_fill(~lower.tril(-1), 0.0)  # [B, H, N, C, C], j < i
    a_qk = ((q * torch.exp(cum - mid)) @ k_out.transpose(-1, -2)).masked_fill(~lower, 0.0)
    eye = torch.eye(chunk, dtype=q.dtype, device=q.device)
    inverse = torch.linalg.solve_triangular(eye + a_kk * beta.transpose(-1, -2), eye.expand_as(a_kk),
                                            upper=False, unitriangular=True)  # (I + A diag(beta))^-1
    w, u0 = inverse @ (k * torch.exp(cum)), inverse @ v  # [B, H, N, C, K], [B, H, N, C, V]
    q_dec = q * torch.exp(cum)
    last = cum[..., -1:, :]  # [B, H, N, 1, K]
    k_end = k * torch.exp(last - cum) * beta  # [B, H, N, C, K]
    a_qk = a_qk * beta.transpose(-1, -2)
    state = q.new_zeros(b, h, dk, dv)
    outs = []
    for c in range(n):
        u = u0[:, :, c] - w[:, :, c] @ state  # [B, H, C, V]
        outs.append(q_dec[:, :, c] @ state + a_qk[:, :, c] @ u)
        state = torch.exp(last[:, :, c]).transpose(-1, -2) * state + k_end[:, :, c].transpose(-1, -2) @ u
    o = torch.stack(outs, dim=2) * scale  # [B, H, N, C, V]
    return o.permute(0, 2, 3, 1, 4).reshape(b, n * chunk, h, dv)[:, :t]


def kda_forward(mixer: KDAMixer, x: torch.Tensor) -> torch.Tensor:
    """x [B, T, D] -> [B, T, D]."""
    kda, (b, t, _) = mixer.kda, x.shape
    h, dh = mixer.num_heads, kda.head_dim
    q, k, v = (causal_conv_silu(proj(x), getattr(mixer, f"{n}_conv1d").weight)
               for proj, n in ((mixer.q_proj, "q"), (mixer.k_proj, "k"), (mixer.v_proj, "v")))
    q, k = (l2_normalize(z.reshape(b, t, h, dh)) for z in (q, k))
    f = mixer.f_b_proj(mixer.f_a_proj(x))  # [B, T, H*D]
    if kda.gate_lower_bound is None:
        g = kda_gate_softplus(f, mixer.A_log, mixer.dt_bias, h)
    else:
        g = kda_gate_lower_bound(f, mixer.A_log, mixer.dt_bias, h, kda.gate_lower_bound)  # [B, T, H, D]
    beta = torch.sigmoid(mixer.b_proj(x).float())  # [B, T, H]
    o = chunk_kda_train(q, k, v.reshape(b, t, h, dh), g, beta, dh ** -0.5)  # [B, T, H, D] fp32
    gate = mixer.g_proj(x) if kda.full_rank_output_gate else mixer.g_b_proj(mixer.g_a_proj(x))
    o = gated_rms_norm(o.reshape(b * t, h, dh), mixer.o_norm.weight, gate.reshape(b * t, h, dh), mixer.eps)
    return mixer.o_proj(o.reshape(b, t, h * dh).to(x.dtype))


def mla_forward(mixer: MLAMixer, x: torch.Tensor) -> torch.Tensor:
    """x [B, T, D] -> [B, T, D]; the non-absorbed form of the engine's absorbed MLA (no RoPE in K3)."""
    mla, (b, t, _) = mixer.mla, x.shape
    h, nope, rope, lora = mixer.num_heads, mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.kv_lora_rank
    q = mixer.q_b_proj(mixer.q_a_layernorm(mixer.q_a_proj(x))) if mla.q_lora_rank else mixer.q_proj(x)
    q = q.reshape(b, t, h, nope + rope)
    ckv = mixer.kv_a_proj_with_mqa(x)  # [B, T, lora+rope]
    kv = mixer.kv_b_proj(mixer.kv_a_layernorm(ckv[..., :lora])).reshape(b, t, h, nope + mla.v_head_dim)
    k_rope = ckv[..., lora:].unsqueeze(2).expand(b, t, h, rope)
    key = torch.cat([kv[..., :nope], k_rope], dim=-1)  # [B, T, H, nope+rope]
    o = F.scaled_dot_product_attention(q.transpose(1, 2), key.transpose(1, 2), kv[..., nope:].transpose(1, 2),
                                       is_causal=True, scale=mla.softmax_scale)  # [B, H, T, v]
    o = o.transpose(1, 2).reshape(b, t, h * mla.v_head_dim)
    if mla.output_gate:
        o = o * torch.sigmoid(mixer.g_proj(x))
    return mixer.o_proj(o)


def moe_forward(moe: SparseMoE, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, D] -> (y [N, D], loads [E])."""
    cfg = moe.moe
    logits = F.linear(x.float(), moe.gate.weight.float())  # [N, E]
    weights, ids = route(logits, moe.gate.e_score_correction_bias.detach().float(), cfg.top_k, cfg.num_expert_group,
                         cfg.topk_group, cfg.renormalize, cfg.routed_scaling_factor)  # [N, k] each
    z = moe.routed_expert_down_proj(x) if cfg.latent_size else x  # [N, Dm]
    y = torch.zeros_like(z)
    experts = moe.experts
    for e in range(cfg.num_experts):
        rows, slot = (ids == e).nonzero(as_tuple=True)
        if rows.numel() == 0:
            continue
        ze = z[rows]  # [n, Dm]
        he = F.linear(moe.act(F.linear(ze, experts.w1[e]), F.linear(ze, experts.w3[e])), experts.w2[e])
        y = y.index_add(0, rows, he * weights[rows, slot].unsqueeze(-1).to(he.dtype))
    if cfg.latent_size:
        if moe.routed_expert_norm is not None:
            y = moe.routed_expert_norm(y)
        y = moe.routed_expert_up_proj(y)  # [N, D]
    if moe.shared_experts is not None:
        y = y + _mlp(moe.shared_experts, x)
    return y, torch.bincount(ids.reshape(-1), minlength=cfg.num_experts)


class _Stream:
    def __init__(self, hidden: torch.Tensor):
        self.hidden, self.blocks = hidden, []  # [N, D]; attn_res block snapshots


def _layer(model: KimiForCausalLM, layer: DecoderLayer, stream: _Stream, shape: tuple[int, int],
           loads: list[torch.Tensor]) -> None:
    """One decoder layer on flattened tokens [N = B*T, D], as `DecoderLayer.forward`."""
    def mixer(x):
        fn = kda_forward if layer.spec.mixer == "kda" else mla_forward
        return fn(layer.self_attn, x.reshape(*shape, -1)).reshape(x.shape)

    def ffn(x):
        if layer.spec.ffn == "dense":
            return _mlp(layer.mlp, x)
        y, load = moe_forward(layer.block_sparse_moe, x)
        loads.append(load)
        return y

    if layer.spec.residual == "plain":
        x = stream.hidden + mixer(layer.input_layernorm(stream.hidden))
        stream.hidden = x + ffn(layer.post_attention_layernorm(x))
        return
    starts_block = layer.spec.index % layer.block_size == 0
    prefix = h = stream.hidden
    if stream.blocks:
        h = attn_res_mix(stream.blocks, prefix, layer.self_attention_res_norm.weight,
                         layer.self_attention_res_proj.weight, layer.eps)
    if starts_block:
        stream.blocks.append(prefix)
    a = mixer(layer.input_layernorm(h))
    prefix = a if starts_block else prefix + a
    h = attn_res_mix(stream.blocks, prefix, layer.mlp_res_norm.weight, layer.mlp_res_proj.weight, layer.eps)
    stream.hidden = prefix + ffn(layer.post_attention_layernorm(h))


def train_forward(model: KimiForCausalLM, ids: torch.Tensor, taps: tuple[int, ...] = ()) -> TrainOutput:
    """ids [B, T] -> hidden [B, T, D], logits [B, T, V] fp32, expert loads, and the streams of `taps` (layer ids,
    or `FINAL_TAP`: the final hidden before `model.norm`), as `engine.spec.capture.forward_with_taps` defines them."""
    text, (b, t) = model.model, ids.shape
    stream = _Stream(F.embedding(ids.reshape(-1), text.embed_tokens.weight))  # [N, D]
    loads: list[torch.Tensor] = []
    captured: dict[int, torch.Tensor] = {}
    for layer in text.layers:
        _layer(model, layer, stream, (b, t), loads)
        if layer.spec.index in taps:
            captured[layer.spec.index] = stream.hidden.reshape(b, t, -1)
    hidden = stream.hidden
    if model.config.attn_res_block_size:
        hidden = attn_res_mix(stream.blocks, hidden, text.output_attn_res_norm.weight,
                              text.output_attn_res_proj.weight, model.config.rms_norm_eps)
    if FINAL_TAP in taps:
        captured[FINAL_TAP] = hidden.reshape(b, t, -1)
    hidden = text.norm(hidden)  # [N, D]
    logits = model.lm_head(hidden).float()  # [N, V]
    return TrainOutput(hidden.reshape(b, t, -1), logits.reshape(b, t, -1), loads, captured)
