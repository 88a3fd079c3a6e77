"""Plain-torch oracles of the drafters' math (a different code path: MLA un-absorbed, RoPE as complex rotation)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def rms(x, weight, eps):
    x32 = x.float()
    return weight * (x32 / torch.sqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def yarn_inv_freq(dim, theta, factor, orig_max, beta_fast, beta_slow):
    """DeepSeek YaRN inverse frequencies, spelled out per dimension."""
    def corr(rot):
        return dim * math.log(orig_max / (rot * 2 * math.pi)) / (2 * math.log(theta))
    low, high = max(math.floor(corr(beta_fast)), 0), min(math.ceil(corr(beta_slow)), dim - 1)
    out = []
    for i in range(dim // 2):
        base = 1.0 / theta ** (2 * i / dim)
        ramp = min(max((i - low) / ((high - low) or 1e-3), 0.0), 1.0)
        out.append(base / factor * ramp + base * (1 - ramp))
    return torch.tensor(out, dtype=torch.float32)


def rope_complex(x, positions, inv_freq, scale):
    """GPT-J pairs (x[2i], x[2i+1]) as complex numbers times scale * e^{i pos f_i}. x [T, ..., R]."""
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2).contiguous())
    angle = positions.float()[:, None] * inv_freq[None, :]  # [T, R/2]
    rot = torch.polar(torch.full_like(angle, scale), angle).reshape(x.shape[0], *([1] * (x.dim() - 2)), -1)
    return torch.view_as_real(pairs * rot).flatten(-2).to(x.dtype)


def naive_mla(attn, x, positions, visible_own, ctx_x=None, ctx_positions=None, rope=None):
    """Un-absorbed MLA of rows x [T, D] over keys from ctx_x (context rows, already normed inputs) ++ x."""
    mla, eps = attn.mla, attn.kv_a_layernorm.eps
    h, nope, r, lora, vd = mla.num_heads, mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.kv_lora_rank, mla.v_head_dim
    q = (attn.q_b_proj.weight @ rms(x @ attn.q_a_proj.weight.T, attn.q_a_layernorm.weight, eps).T).T
    q = q.reshape(-1, h, nope + r)
    rows = x if ctx_x is None else torch.cat([ctx_x, x])
    pos = positions if ctx_x is None else torch.cat([ctx_positions, positions])
    ckv = rows @ attn.kv_a_proj_with_mqa.weight.T
    c, k_pe = rms(ckv[:, :lora], attn.kv_a_layernorm.weight, eps), ckv[:, lora:]
    q_pe = q[..., nope:]
    scale = (nope + r) ** -0.5
    if rope is not None:
        inv_freq, cs_scale, softmax_factor = rope
        k_pe, q_pe = rope_complex(k_pe, pos, inv_freq, cs_scale), rope_complex(q_pe, positions, inv_freq, cs_scale)
        scale *= softmax_factor
    kv = (c @ attn.kv_b_proj.weight.T).reshape(-1, h, nope + vd)
    k = torch.cat([kv[..., :nope], k_pe[:, None, :].expand(-1, h, r)], dim=-1)  # [S, H, nope+r]
    qf = torch.cat([q[..., :nope], q_pe], dim=-1)
    scores = torch.einsum("thd,shd->hts", qf.double(), k.double()) * scale
    scores = scores.masked_fill(~visible_own[None], float("-inf"))
    o = torch.einsum("hts,shv->thv", scores.softmax(-1), kv[..., nope:].double()).to(x.dtype).reshape(-1, h * vd)
    if mla.output_gate:
        o = o * torch.sigmoid(x @ attn.g_proj.weight.T)
    return o @ attn.o_proj.weight.T


def naive_mtp_logits(layer, hidden, token_ids, causal=True):
    """MTP rows t = 0..T-2 (hidden[t], token t+1) -> logits [T-1, V], causal (or not: a negative control)."""
    eps = layer.config.rms_norm_eps
    pos = torch.arange(hidden.shape[0] - 1)
    e = F.embedding(token_ids[1:], layer.embed[0].weight) * (pos != 0)[:, None]
    x = torch.cat([rms(e, layer.enorm.weight, eps), rms(hidden[:-1], layer.hnorm.weight, eps)], -1)
    x = x @ layer.eh_proj.weight.T
    t = x.shape[0]
    y = x + naive_mla(layer.self_attn, rms(x, layer.input_layernorm.weight, eps), pos,
                      torch.ones(t, t, dtype=torch.bool).tril() if causal else torch.ones(t, t, dtype=torch.bool))
    ffn_in = rms(y, layer.post_attention_layernorm.weight, eps)
    out = y + (layer.block_sparse_moe(ffn_in) if layer.spec.ffn == "moe" else layer.mlp(ffn_in))
    return (rms(out, layer.shared_head.norm.weight, eps) @ layer.shared_head.head.weight.T).float()


def _rope_facts(config):
    raw = config.raw.get("rope_parameters") or {}
    dim, theta = config.mla.qk_rope_head_dim, float(raw.get("rope_theta", 50000.0))
    if raw.get("rope_type", "default") == "default":
        return torch.tensor([theta ** (-2 * i / dim) for i in range(dim // 2)]), 1.0, 1.0
    factor = raw["factor"]

    def m(v):
        return 0.1 * v * math.log(factor) + 1.0
    inv = yarn_inv_freq(dim, theta, factor, raw["original_max_position_embeddings"], raw["beta_fast"],
                        raw["beta_slow"])
    return inv, m(raw["mscale"]) / m(raw["mscale_all_dim"]), m(raw["mscale_all_dim"]) ** 2


def naive_dspark_logits(model, hidden, token_ids, anchors, causal_block=False):
    """Each anchor's block, one at a time: logits [B, N, V] with the teacher-forced Markov bias."""
    cfg, embed, head = model.config, model.target[0].weight, model.target[1].weight
    eps, n = cfg.rms_norm_eps, cfg.block_size
    ctx = rms(hidden @ model.context_proj.weight.T, model.context_norm.weight, eps)
    rope = _rope_facts(cfg)
    out = []
    for p in anchors.tolist():
        ids = torch.tensor([token_ids[p]] + [cfg.mask_token_id] * (n - 1))
        x, pos = F.embedding(ids, embed), torch.arange(p, p + n)
        own = torch.ones(n, n, dtype=torch.bool)
        visible = torch.cat([torch.ones(n, p, dtype=torch.bool), own.tril() if causal_block else own], 1)
        for layer in model.layers:
            xn = rms(x, layer.input_layernorm.weight, eps)
            a = layer.self_attn
            # context rows enter as they are (no input_layernorm): their keys only
            y = x + naive_mla(a, xn, pos, visible, ctx_x=ctx[:p], ctx_positions=torch.arange(p), rope=rope)
            mlp, z = layer.mlp, rms(y, layer.post_attention_layernorm.weight, eps)
            x = y + (F.silu(z @ mlp.gate_proj.weight.T) * (z @ mlp.up_proj.weight.T)) @ mlp.down_proj.weight.T
        base = (rms(x, model.final_norm.weight, eps) @ head.T).float()
        prev = token_ids[p:p + n]
        bias = (model.markov_head.markov_w1.weight[prev] @ model.markov_head.markov_w2.weight.T).float()
        out.append(base + bias)
    return torch.stack(out)
