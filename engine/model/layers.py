"""The building blocks of both model families, with parameters named as in Moonshot's checkpoints.

Contract:
- Every module works on packed tokens `[T, hidden]` and reads/writes cache tensors only through the `ForwardBatch`
  indices (see engine/model/batch.py). Parameter names below a layer equal the official checkpoint names, except that
  routed experts are stacked (`experts.w1` is `[E, I, D]`, filled from `experts.{e}.w1.weight`).
- One `DecoderLayer` serves both families; its `LayerSpec` and the model config select the mixer (KDA or MLA), the
  FFN (dense or MoE, plain or latent), the residual style (plain adds or K3 attention residuals) and the activation.
- Numerics follow DESIGN.md "Shared forms": RMSNorm in fp32 with the weight applied after the cast back; KDA state,
  gates and the gated output norm in fp32; router logits in fp32.
- Projections of the same input run as one matmul once `engine.model.fused.bind_fused_weights` has bound them (the
  loader does): KDA's q/k/v, f_a, b and output-gate projections; MLA's query, kv_a and output-gate projections;
  gate/up of MLPs up to `FUSED_GATE_UP_MAX` wide (shared experts); the stacked experts' w1/w3 (`[E, 2I, D]`, one
  grouped matmul). Unbound (a model built directly), each projection runs on its own, with the same results up to
  rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.batch import CacheTensors, ForwardBatch
from engine.model.config import LayerSpec, ModelConfig
from engine.model.fused import FusedLinear, ParamGroup
from kernels import get_kernel
from kernels.attention.torch_paged import write_kv_cache
from kernels.kda.gate import kda_gate_lower_bound, kda_gate_softplus
from kernels.linear import linear
from kernels.moe.activation import GatedActivation
from kernels.moe.router import route
from kernels.norm.rms_norm import gated_rms_norm, l2_normalize, rms_norm


# Widest intermediate whose gate/up run as one matmul: on CPU, fused was 2.5x (I=128) and ~1.1x (I=1024) faster at
# 32 tokens, and slower at I=2048.
FUSED_GATE_UP_MAX = 1024


class Linear(nn.Linear):
    """A bias-free `nn.Linear` (same parameter name and layout) whose product runs through `kernels.linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight)


def _linear(in_features: int, out_features: int) -> nn.Linear:
    return Linear(in_features, out_features, bias=False)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def gated_activation(config: ModelConfig) -> GatedActivation:
    act = config.activation
    return GatedActivation(kind=act.kind, beta=act.situ_beta, linear_beta=act.situ_linear_beta)


class GatedMLP(nn.Module):
    """`down_proj(act(gate_proj(x), up_proj(x)))`: the dense FFN and the shared experts."""

    def __init__(self, hidden: int, intermediate: int, act: GatedActivation):
        super().__init__()
        self.gate_proj = _linear(hidden, intermediate)
        self.up_proj = _linear(hidden, intermediate)
        self.down_proj = _linear(intermediate, hidden)
        self.act = act
        # Fusing gate/up pays for narrow MLPs (shared experts); wide ones already run as large matmuls, and on CPU a
        # fused output over 32 MiB is page-faulted afresh on every call (see engine/runner.py).
        self.gate_up = FusedLinear([[self.gate_proj], [self.up_proj]]) if intermediate <= FUSED_GATE_UP_MAX else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x) if self.gate_up is not None else (self.gate_proj(x), self.up_proj(x))  # [T, I]
        return self.down_proj(self.act(gate, up))


class StackedExperts(nn.Module):
    """Routed experts as stacked tensors (w1 gate, w3 up, w2 down), filled per expert by the loader."""

    def __init__(self, num_experts: int, width: int, intermediate: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(num_experts, intermediate, width))  # [E, I, D]
        self.w3 = nn.Parameter(torch.empty(num_experts, intermediate, width))  # [E, I, D]
        self.w2 = nn.Parameter(torch.empty(num_experts, width, intermediate))  # [E, D, I]
        self.gate_up = ParamGroup([(self, "w1"), (self, "w3")], dim=1)  # bound: w1, w3 are halves of [E, 2I, D]


class MoEGate(nn.Module):
    def __init__(self, num_experts: int, hidden: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden, dtype=torch.float32))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts, dtype=torch.float32))


class SparseMoE(nn.Module):
    """Sigmoid-routed MoE with shared experts; K3's latent form runs the routed experts at a narrower width."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        moe = config.moe
        self.moe = moe
        width = moe.latent_size or config.hidden_size
        self.gate = MoEGate(moe.num_experts, config.hidden_size)
        self.experts = StackedExperts(moe.num_experts, width, moe.intermediate_size)
        self.act = gated_activation(config)
        self.shared_experts = (GatedMLP(config.hidden_size, moe.intermediate_size * moe.num_shared_experts, self.act)
                               if moe.num_shared_experts else None)
        if moe.latent_size:
            self.routed_expert_down_proj = _linear(config.hidden_size, width)
            self.routed_expert_up_proj = _linear(width, config.hidden_size)
            self.routed_expert_norm = RMSNorm(width, config.rms_norm_eps) if moe.latent_use_norm else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [T, D]
        moe = self.moe
        logits = F.linear(x.float(), self.gate.weight.float())  # [T, E]
        weights, ids = route(logits, self.gate.e_score_correction_bias.float(), moe.top_k, moe.num_expert_group,
                             moe.topk_group, moe.renormalize, moe.routed_scaling_factor)
        z = self.routed_expert_down_proj(x) if moe.latent_size else x  # [T, Dm]
        experts = get_kernel("moe_experts", x.device)
        y = experts(z, self.experts.w1, self.experts.w3, self.experts.w2, weights, ids, self.act)  # [T, Dm]
        if moe.latent_size:
            if self.routed_expert_norm is not None:
                y = self.routed_expert_norm(y)
            y = self.routed_expert_up_proj(y)
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)
        return y


class KDAMixer(nn.Module):
    """Kimi Delta Attention: short convs, the gated delta rule per head, and a gated RMSNorm on the output."""

    def __init__(self, config: ModelConfig, layer_index: int):
        super().__init__()
        kda = config.kda
        self.kda = kda
        self.layer_index = layer_index
        self.eps = config.rms_norm_eps
        d, h, proj = config.hidden_size, kda.num_heads, kda.num_heads * kda.head_dim
        self.q_proj, self.k_proj, self.v_proj = _linear(d, proj), _linear(d, proj), _linear(d, proj)
        for name in ("q_conv1d", "k_conv1d", "v_conv1d"):
            self.add_module(name, _ConvWeight(proj, kda.conv_kernel_size))
        self.A_log = nn.Parameter(torch.empty(h, dtype=torch.float32))  # narrowed from the checkpoint's shape
        self.dt_bias = nn.Parameter(torch.empty(proj, dtype=torch.float32))
        self.f_a_proj, self.f_b_proj = _linear(d, kda.head_dim), _linear(kda.head_dim, proj)
        self.b_proj = _linear(d, h)
        if kda.full_rank_output_gate:
            self.g_proj = _linear(d, proj)
        else:
            self.g_a_proj, self.g_b_proj = _linear(d, kda.head_dim), _linear(kda.head_dim, proj)
        self.o_norm = RMSNorm(kda.head_dim, config.rms_norm_eps)
        self.o_proj = _linear(proj, d)
        out_gate = [self.g_proj] if kda.full_rank_output_gate else [self.g_a_proj]
        self.in_proj = FusedLinear([[self.q_proj, self.k_proj, self.v_proj], [self.f_a_proj], [self.b_proj], out_gate])
        self.conv_weights = ParamGroup([(getattr(self, f"{n}_conv1d"), "weight") for n in "qkv"], dim=0)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, cache: CacheTensors) -> torch.Tensor:
        kda, t = self.kda, x.shape[0]
        h, dh = kda.num_heads, kda.head_dim
        qkv, f_low, b, gate = self.in_proj(x)  # [T, 3*H*D], [T, D], [T, H], [T, H*D] or low-rank [T, D]
        conv_w = self._conv_weight()  # [3HD, W]
        conv_pool = cache.conv[self.layer_index]
        if batch.is_pure_decode:
            qkv = get_kernel("conv_decode", x.device)(qkv, conv_w, conv_pool, batch.state_indices)
        else:
            qkv = get_kernel("conv_prefill", x.device)(qkv, conv_w, conv_pool, batch.state_indices,
                                                       batch.cu_seqlens)
        q, k, v = (part.reshape(t, h, dh) for part in qkv.split(h * dh, dim=-1))  # each [T, H, D]
        q, k = l2_normalize(q), l2_normalize(k)
        g = self._forget_gate(self.f_b_proj(f_low))  # [T, H, D] fp32, log decay
        beta = torch.sigmoid(b.float())  # [T, H]
        state_pool = cache.recurrent[self.layer_index]
        scale = dh ** -0.5
        if batch.is_pure_decode:
            o = get_kernel("kda_decode", x.device)(q, k, v, g, beta, scale, state_pool, batch.state_indices)
        else:
            o = get_kernel("kda_prefill", x.device)(q, k, v, g, beta, scale, batch.cu_seqlens, state_pool,
                                                    batch.state_indices)
        if not kda.full_rank_output_gate:
            gate = self.g_b_proj(gate)  # [T, H*D]
        o = gated_rms_norm(o, self.o_norm.weight, gate.reshape(t, h, dh), self.eps)  # [T, H, D]
        return self.o_proj(o.reshape(t, h * dh).to(x.dtype))

    def _conv_weight(self) -> torch.Tensor:
        fused = self.conv_weights.tensor()  # [3HD, 1, W] when bound
        if fused is None:
            fused = torch.cat([self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight])
        return fused.squeeze(1)

    def _forget_gate(self, f: torch.Tensor) -> torch.Tensor:
        """f [T, H*D] (f_b_proj's output) -> g [T, H, D] fp32."""
        if self.kda.gate_lower_bound is None:
            return kda_gate_softplus(f, self.A_log, self.dt_bias, self.kda.num_heads)
        return kda_gate_lower_bound(f, self.A_log, self.dt_bias, self.kda.num_heads, self.kda.gate_lower_bound)


class _ConvWeight(nn.Module):
    """Holds one depthwise conv weight `[C, 1, W]` under the official `*_conv1d.weight` name."""

    def __init__(self, channels: int, width: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, width, dtype=torch.float32))


class MLAMixer(nn.Module):
    """Multi-head latent attention with NoPE, run in the absorbed form over the paged latent cache."""

    def __init__(self, config: ModelConfig, layer_index: int):
        super().__init__()
        mla = config.mla
        self.mla = mla
        self.layer_index = layer_index
        d, h = config.hidden_size, mla.num_heads
        q_dim = h * (mla.qk_nope_head_dim + mla.qk_rope_head_dim)
        if mla.q_lora_rank:
            self.q_a_proj = _linear(d, mla.q_lora_rank)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, 1e-6)
            self.q_b_proj = _linear(mla.q_lora_rank, q_dim)
        else:
            self.q_proj = _linear(d, q_dim)
        self.kv_a_proj_with_mqa = _linear(d, mla.kv_lora_rank + mla.qk_rope_head_dim)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, 1e-6)
        self.kv_b_proj = _linear(mla.kv_lora_rank, h * (mla.qk_nope_head_dim + mla.v_head_dim))
        self.o_proj = _linear(h * mla.v_head_dim, d)
        if mla.output_gate:
            self.g_proj = _linear(d, h * mla.v_head_dim)
        parts = [[self.q_a_proj if mla.q_lora_rank else self.q_proj], [self.kv_a_proj_with_mqa]]
        self.in_proj = FusedLinear(parts + ([[self.g_proj]] if mla.output_gate else []))

    def forward(self, x: torch.Tensor, batch: ForwardBatch, cache: CacheTensors) -> torch.Tensor:
        mla, t = self.mla, x.shape[0]
        h, nope, rope, lora = mla.num_heads, mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.kv_lora_rank
        q, ckv, *out_gate = self.in_proj(x)  # [T, q_lora or H*(nope+rope)], [T, lora+rope], ([T, H*v])
        if mla.q_lora_rank:
            q = self.q_b_proj(self.q_a_layernorm(q))
        q = q.reshape(t, h, nope + rope)  # [T, H, nope+rope]
        latent = torch.cat([self.kv_a_layernorm(ckv[:, :lora]), ckv[:, lora:]], dim=-1)  # [T, lora+rope]
        kv_cache = cache.kv[self.layer_index]
        write_kv_cache(kv_cache, batch.slot_mapping, latent.to(kv_cache.dtype))
        w_kv = self.kv_b_proj.weight.reshape(h, nope + mla.v_head_dim, lora)  # [H, nope+v, lora]
        w_uk, w_uv = w_kv[:, :nope], w_kv[:, nope:]  # [H, nope, lora], [H, v, lora]
        q_latent = torch.einsum("thn,hnl->thl", q[..., :nope], w_uk)  # [T, H, lora]
        q_abs = torch.cat([q_latent, q[..., nope:]], dim=-1)  # [T, H, lora+rope]
        attn = get_kernel("mla_attention", x.device)
        o_latent = attn(q_abs.to(kv_cache.dtype), kv_cache, batch.block_tables, batch.cu_seqlens, batch.seq_lens,
                        mla.softmax_scale, lora)  # [T, H, lora]
        o = torch.einsum("thl,hvl->thv", o_latent.to(x.dtype), w_uv).reshape(t, h * mla.v_head_dim)
        if mla.output_gate:
            o = o * torch.sigmoid(out_gate[0])
        return self.o_proj(o)


def attn_res_mix(blocks: list[torch.Tensor], prefix_sum: torch.Tensor, norm_weight: torch.Tensor,
                 proj_weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`Σ_j softmax_j(rmsnorm_noweight(V_j)·(norm_weight ⊙ proj_weight[0]))·V_j` over V = blocks + [prefix_sum].

    In fp32 over the raw V, one candidate at a time (no stacked copy): a candidate's score is
    `(V_j · w) · rsqrt(mean(V_j²) + eps)`, the weightless RMSNorm's factor taken out of the dot product."""
    candidates = [v.float() for v in blocks + [prefix_sum]]  # each [T, D]
    score_weight = norm_weight.float() * proj_weight.reshape(-1).float()  # [D]
    scores = torch.stack([(v @ score_weight) * torch.rsqrt(v.pow(2).mean(-1) + eps) for v in candidates], dim=-1)
    probs = scores.softmax(dim=-1)  # [T, B+1]
    out = candidates[0] * probs[:, :1]
    for j in range(1, len(candidates)):
        out.addcmul_(candidates[j], probs[:, j : j + 1])
    return out.to(prefix_sum.dtype)


class ResidualStream:
    """What flows between layers: a plain hidden state, or K3's prefix sum plus block snapshots."""

    def __init__(self, hidden: torch.Tensor):
        self.hidden = hidden  # plain: the residual stream; attn_res: the running prefix sum
        self.blocks: list[torch.Tensor] = []  # attn_res: snapshots, the embedding first


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, spec: LayerSpec):
        super().__init__()
        self.spec = spec
        d, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = KDAMixer(config, spec.index) if spec.mixer == "kda" else MLAMixer(config, spec.index)
        if spec.ffn == "moe":
            self.block_sparse_moe = SparseMoE(config)
        else:
            self.mlp = GatedMLP(d, config.intermediate_size, gated_activation(config))
        self.input_layernorm = RMSNorm(d, eps)
        self.post_attention_layernorm = RMSNorm(d, eps)
        if spec.residual == "attn_res":
            self.block_size = config.attn_res_block_size
            self.eps = eps
            self.self_attention_res_norm, self.self_attention_res_proj = RMSNorm(d, eps), _linear(d, 1)
            self.mlp_res_norm, self.mlp_res_proj = RMSNorm(d, eps), _linear(d, 1)

    def ffn(self, x: torch.Tensor) -> torch.Tensor:
        return self.block_sparse_moe(x) if self.spec.ffn == "moe" else self.mlp(x)

    def forward(self, stream: ResidualStream, batch: ForwardBatch, cache: CacheTensors) -> None:
        """Advances `stream` through this layer in place."""
        if self.spec.residual == "plain":
            x = stream.hidden
            x = x + self.self_attn(self.input_layernorm(x), batch, cache)
            stream.hidden = x + self.ffn(self.post_attention_layernorm(x))
            return
        self._forward_attn_res(stream, batch, cache)

    def _forward_attn_res(self, stream: ResidualStream, batch: ForwardBatch, cache: CacheTensors) -> None:
        starts_block = self.spec.index % self.block_size == 0
        prefix_sum = stream.hidden
        h = prefix_sum
        if stream.blocks:
            h = attn_res_mix(stream.blocks, prefix_sum, self.self_attention_res_norm.weight,
                             self.self_attention_res_proj.weight, self.eps)
        if starts_block:
            stream.blocks.append(prefix_sum)
        a = self.self_attn(self.input_layernorm(h), batch, cache)
        prefix_sum = a if starts_block else prefix_sum + a
        h = attn_res_mix(stream.blocks, prefix_sum, self.mlp_res_norm.weight, self.mlp_res_proj.weight, self.eps)
        stream.hidden = prefix_sum + self.ffn(self.post_attention_layernorm(h))
