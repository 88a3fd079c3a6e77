"""The building blocks of both model families, with parameters named as in Moonshot's checkpoints.

Contract:
- Every module works on packed tokens `[T, hidden]` and reads/writes cache tensors only through the `ForwardBatch`
  indices (see engine/model/batch.py). Parameter names below a layer equal the official checkpoint names, except that
  routed experts are stacked (`experts.w1` is `[E, I, D]`, filled from `experts.{e}.w1.weight`).
- Built for one tensor-parallel rank (`RankContext`, default: the whole model): KDA and MLA by head (q/k/v/f/g/beta
  projections, convs and the state by channel/head; MLA's q/q_b, kv_b and output gate column-parallel, its latent
  `kv_a_proj_with_mqa` and norms replicated), `o_proj` row-parallel and all-reduced, so a mixer returns the full
  output on every rank; dense MLPs column -> row. Which checkpoint dim each parameter is split along is declared in
  `tp_dims` (engine/model/common.py); heads that do not divide by the TP size raise `ParallelError`.
- One `DecoderLayer` serves both families; its `LayerSpec` and the model config select the mixer (KDA or MLA), the
  FFN (dense or MoE, plain or latent), the residual style (plain adds or K3 attention residuals) and the activation.
- Numerics (docs/architecture.md's shared forms): RMSNorm in fp32, the weight applied after the cast back; KDA state,
  gates and the gated output norm in fp32; router logits in fp32.
- Projections of the same input run as one matmul once `engine.model.fused.bind_fused_weights` has bound them (the
  loader does): KDA's q/k/v, f_a, b and output-gate projections; MLA's query, kv_a and output-gate projections;
  gate/up of MLPs up to `FUSED_GATE_UP_MAX` wide (shared experts); the stacked experts' w1/w3 (`[E, 2I, D]`, one
  grouped matmul). Unbound (a model built directly), each projection runs on its own, with the same results up to
  rounding.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.model.batch import CacheTensors, ForwardBatch
from engine.model.common import FUSED_GATE_UP_MAX, GatedMLP, Linear, RMSNorm, _linear, gated_activation
from engine.model.config import LayerSpec, ModelConfig
from engine.model.fused import FusedLinear, ParamGroup
from engine.model.moe import MoEGate, SparseMoE, StackedExperts
from engine.parallel.comm import SINGLE, RankContext
from kernels import get_kernel, graph_ops
from kernels.casting import cast, fp32
from kernels.attention.torch_paged import write_kv_cache
from kernels.attention.fp8_latent import is_fp8_cache
from kernels.attention.mla_prefill import non_absorbed_min_queries
from kernels.kda.gate import kda_gate_lower_bound, kda_gate_softplus
from kernels.norm.rms_norm import gated_rms_norm, l2_normalize

__all__ = ["FUSED_GATE_UP_MAX", "DecoderLayer", "GatedMLP", "KDAMixer", "Linear", "MLAMixer", "MoEGate", "RMSNorm",
           "ResidualStream", "SparseMoE", "StackedExperts", "_linear", "attn_res_mix", "gated_activation"]


class KDAMixer(nn.Module):
    """Kimi Delta Attention: short convs, the gated delta rule per head, and a gated RMSNorm on the output."""

    def __init__(self, config: ModelConfig, layer_index: int, ctx: RankContext = SINGLE):
        super().__init__()
        kda = config.kda
        self.kda, self.ctx = kda, ctx
        self.layer_index = layer_index
        self.eps = config.rms_norm_eps
        h = ctx.split(kda.num_heads, "KDA heads (linear_attn_config.num_heads)")  # this rank's heads
        self.num_heads = h
        d, proj = config.hidden_size, h * kda.head_dim
        self.q_proj, self.k_proj, self.v_proj = (_linear(d, proj, shard_dim=0) for _ in range(3))
        for name in ("q_conv1d", "k_conv1d", "v_conv1d"):
            self.add_module(name, _ConvWeight(proj, kda.conv_kernel_size))
        self.A_log = nn.Parameter(torch.empty(h, dtype=torch.float32))  # narrowed from the checkpoint's shape
        self.dt_bias = nn.Parameter(torch.empty(proj, dtype=torch.float32))
        self.tp_dims = {"A_log": 0, "dt_bias": 0}
        self.f_a_proj, self.f_b_proj = _linear(d, kda.head_dim), _linear(kda.head_dim, proj, shard_dim=0)
        self.b_proj = _linear(d, h, shard_dim=0)
        if kda.full_rank_output_gate:
            self.g_proj = _linear(d, proj, shard_dim=0)
        else:
            self.g_a_proj, self.g_b_proj = _linear(d, kda.head_dim), _linear(kda.head_dim, proj, shard_dim=0)
        self.o_norm = RMSNorm(kda.head_dim, config.rms_norm_eps)
        self.o_proj = _linear(proj, d, shard_dim=1)
        out_gate = [self.g_proj] if kda.full_rank_output_gate else [self.g_a_proj]
        self.in_proj = FusedLinear([[self.q_proj, self.k_proj, self.v_proj], [self.f_a_proj], [self.b_proj], out_gate])
        self.conv_weights = ParamGroup([(getattr(self, f"{n}_conv1d"), "weight") for n in "qkv"], dim=0)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, cache: CacheTensors) -> torch.Tensor:
        kda, t = self.kda, x.shape[0]
        h, dh = self.num_heads, kda.head_dim
        qkv, f_low, b, gate = self.in_proj(x)  # [T, 3*H*D], [T, D], [T, H], [T, H*D] or low-rank [T, D]
        conv_w = self._conv_weight()  # [3HD, W]
        conv_pool = cache.conv[self.layer_index]
        verify = batch.state_out_slots is not None  # speculative verification: keep the state after each token
        host = batch.host
        if batch.traced:
            qkv = graph_ops.conv_decode_step(qkv, conv_w, batch.state_indices, cache, self.layer_index,
                                             batch.inline_cache_ops, batch.state_out_slots)
        elif verify:
            qkv = get_kernel("conv_verify", x.device)(qkv, conv_w, conv_pool, batch.state_indices, batch.cu_seqlens,
                                                      batch.state_out_slots, _verify_host(host))
        elif batch.is_pure_decode:
            qkv = get_kernel("conv_decode", x.device)(qkv, conv_w, conv_pool, batch.state_indices,
                                                      host.state_slots if host else None)
        else:
            qkv = get_kernel("conv_prefill", x.device)(qkv, conv_w, conv_pool, batch.state_indices,
                                                       batch.cu_seqlens)
        q, k, v = (part.reshape(t, h, dh) for part in qkv.split(h * dh, dim=-1))  # each [T, H, D]
        q, k = l2_normalize(q), l2_normalize(k)
        g = self._forget_gate(self.f_b_proj(f_low))  # [T, H, D] fp32, log decay
        beta = torch.sigmoid(fp32(b))  # [T, H]
        state_pool = cache.recurrent[self.layer_index]
        scale = dh ** -0.5
        if batch.traced:
            o = graph_ops.kda_decode_step(q, k, v, g, beta, scale, batch.state_indices, cache, self.layer_index,
                                          batch.inline_cache_ops, batch.state_out_slots)
        elif verify:
            o = get_kernel("kda_verify", x.device)(q, k, v, g, beta, scale, state_pool, batch.state_indices,
                                                   batch.cu_seqlens, batch.state_out_slots, _verify_host(host))
        elif batch.is_pure_decode:
            o = get_kernel("kda_decode", x.device)(q, k, v, g, beta, scale, state_pool, batch.state_indices,
                                                   host.state_slots if host else None)
        else:
            o = get_kernel("kda_prefill", x.device)(q, k, v, g, beta, scale, batch.cu_seqlens, state_pool,
                                                    batch.state_indices)
        if not kda.full_rank_output_gate:
            gate = self.g_b_proj(gate)  # [T, H*D]
        o = gated_rms_norm(o, self.o_norm.weight, gate.reshape(t, h, dh), self.eps)  # [T, H, D]
        return self.ctx.all_reduce(self.o_proj(cast(o.reshape(t, h * dh), x.dtype)))  # row-parallel: summed

    def _conv_weight(self) -> torch.Tensor:
        fused = self.conv_weights.tensor()  # [3HD, 1, W] when bound
        if fused is None:
            fused = torch.cat([self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight])
        return fused.squeeze(1)

    def _forget_gate(self, f: torch.Tensor) -> torch.Tensor:
        """f [T, H*D] (f_b_proj's output) -> g [T, H, D] fp32."""
        if self.kda.gate_lower_bound is None:
            return kda_gate_softplus(f, self.A_log, self.dt_bias, self.num_heads)
        return kda_gate_lower_bound(f, self.A_log, self.dt_bias, self.num_heads, self.kda.gate_lower_bound)


def _verify_host(host) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """The verification ops' host copies `(cu_seqlens, out_slots)`, when the runner gave them."""
    return (host.cu_seqlens, host.out_slots) if host is not None and host.out_slots is not None else None


class _ConvWeight(nn.Module):
    """Holds one depthwise conv weight `[C, 1, W]` under the official `*_conv1d.weight` name."""

    def __init__(self, channels: int, width: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, width, dtype=torch.float32))
        self.tp_dims = {"weight": 0}  # by channel, i.e. by head


class MLAMixer(nn.Module):
    """Multi-head latent attention with NoPE over the paged latent cache: absorbed for decodes and short chunks,
    non-absorbed for sequences with at least `min_prefill_queries` queries in an eager step (prompts)."""

    def __init__(self, config: ModelConfig, layer_index: int, ctx: RankContext = SINGLE):
        super().__init__()
        mla = config.mla
        self.mla, self.ctx = mla, ctx
        self.layer_index = layer_index
        h = ctx.split(mla.num_heads, "MLA heads (num_attention_heads)")  # this rank's heads
        self.num_heads = h
        d = config.hidden_size
        q_dim = h * (mla.qk_nope_head_dim + mla.qk_rope_head_dim)
        if mla.q_lora_rank:
            self.q_a_proj = _linear(d, mla.q_lora_rank)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, 1e-6)
            self.q_b_proj = _linear(mla.q_lora_rank, q_dim, shard_dim=0)
        else:
            self.q_proj = _linear(d, q_dim, shard_dim=0)
        self.kv_a_proj_with_mqa = _linear(d, mla.kv_lora_rank + mla.qk_rope_head_dim)  # the latent: replicated
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, 1e-6)
        self.kv_b_proj = _linear(mla.kv_lora_rank, h * (mla.qk_nope_head_dim + mla.v_head_dim), shard_dim=0)
        self.o_proj = _linear(h * mla.v_head_dim, d, shard_dim=1)
        if mla.output_gate:
            self.g_proj = _linear(d, h * mla.v_head_dim, shard_dim=0)
        parts = [[self.q_a_proj if mla.q_lora_rank else self.q_proj], [self.kv_a_proj_with_mqa]]
        self.in_proj = FusedLinear(parts + ([[self.g_proj]] if mla.output_gate else []))
        # sequences with this many queries in a step run non-absorbed (kernels/attention/mla_prefill.py)
        self.min_prefill_queries = non_absorbed_min_queries(mla.kv_lora_rank, mla.qk_nope_head_dim,
                                                            mla.qk_rope_head_dim, mla.v_head_dim)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, cache: CacheTensors) -> torch.Tensor:
        mla, t = self.mla, x.shape[0]
        h, nope, rope, lora = self.num_heads, mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.kv_lora_rank
        q, ckv, *out_gate = self.in_proj(x)  # [T, q_lora or H*(nope+rope)], [T, lora+rope], ([T, H*v])
        if mla.q_lora_rank:
            q = self.q_b_proj(self.q_a_layernorm(q))
        q = q.reshape(t, h, nope + rope)  # [T, H, nope+rope]
        latent = torch.cat([self.kv_a_layernorm(ckv[:, :lora]), ckv[:, lora:]], dim=-1)  # [T, lora+rope]
        kv_cache = cache.kv[self.layer_index]
        w_kv = self.kv_b_proj.weight.reshape(h, nope + mla.v_head_dim, lora)  # [H, nope+v, lora]
        w_uk, w_uv = w_kv[:, :nope], w_kv[:, nope:]  # [H, nope, lora], [H, v, lora]
        cache_dtype = x.dtype if is_fp8_cache(kv_cache) else kv_cache.dtype  # FP8 rows: quantised on write
        latent = cast(latent, cache_dtype)
        if self.ctx.config.dcp_size > 1:  # the latents split by token across the DCP group
            return self._output(self._dcp_attention(q, latent, kv_cache, w_uk, w_uv, batch), out_gate)
        host = self._long_prefill(batch)
        if host is not None:  # prompts: the non-absorbed form (kernels/attention/mla_prefill.py)
            write_kv_cache(kv_cache, batch.slot_mapping, latent)
            o = get_kernel("mla_prefill", x.device)(q, kv_cache, w_uk, w_uv, batch.block_tables, host,
                                                    mla.softmax_scale, self.min_prefill_queries)  # [T, H, v]
            return self._output(o.reshape(t, h * mla.v_head_dim), out_gate)
        q_latent = torch.einsum("thn,hnl->thl", q[..., :nope], w_uk)  # [T, H, lora]
        q_abs = cast(torch.cat([q_latent, q[..., nope:]], dim=-1), cache_dtype)  # [T, H, lora+rope]
        if batch.traced:  # the latent write and the attention as one op (kernels/graph_ops.py)
            o_latent = graph_ops.mla_decode_step(q_abs, latent, batch.slot_mapping, batch.block_tables,
                                                 batch.seq_lens, mla.softmax_scale, lora, cache, self.layer_index,
                                                 batch.inline_cache_ops)
        else:
            write_kv_cache(kv_cache, batch.slot_mapping, latent)
            host = (batch.host.cu_seqlens, batch.host.seq_lens) if batch.host else None
            o_latent = get_kernel("mla_attention", x.device)(q_abs, kv_cache, batch.block_tables, batch.cu_seqlens,
                                                             batch.seq_lens, mla.softmax_scale, lora, host)
        o = torch.einsum("thl,hvl->thv", cast(o_latent, x.dtype), w_uv).reshape(t, h * mla.v_head_dim)
        return self._output(o, out_gate)

    def _dcp_attention(self, q: torch.Tensor, latent: torch.Tensor, kv_cache: torch.Tensor, w_uk: torch.Tensor,
                       w_uv: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Absorbed attention with the cache split by token (engine/parallel/context.py): q [T, H, nope+rope] ->
        [T, H*v]. The scratch row of a token another rank owns is in the last block (the runner's scratch block)."""
        from engine.parallel.context import dcp_attention

        if batch.traced:
            raise NotImplementedError("--decode-context-parallel-size > 1 runs eager steps only (--enforce-eager)")
        mla, t, h = self.mla, q.shape[0], self.num_heads
        nope, lora = mla.qk_nope_head_dim, mla.kv_lora_rank
        q_latent = torch.einsum("thn,hnl->thl", q[..., :nope], w_uk)  # [T, H, lora]
        q_abs = cast(torch.cat([q_latent, q[..., nope:]], dim=-1), latent.dtype)  # [T, H, lora+rope]
        scratch = (kv_cache.shape[0] - 1) * kv_cache.shape[1]
        o_latent = dcp_attention(self.ctx, q_abs, latent, kv_cache, batch, mla.softmax_scale, lora, scratch)
        o = torch.einsum("thl,hvl->thv", cast(o_latent, q.dtype), w_uv)  # [T, H, v]
        return o.reshape(t, h * mla.v_head_dim)

    def _output(self, o: torch.Tensor, out_gate: list[torch.Tensor]) -> torch.Tensor:
        """Heads' outputs [T, H*v] -> the layer's output [T, D] (gated, projected, summed over ranks)."""
        if self.mla.output_gate:
            o = o * torch.sigmoid(out_gate[0])
        return self.ctx.all_reduce(self.o_proj(o))  # row-parallel: summed

    def _long_prefill(self, batch: ForwardBatch) -> tuple | None:
        """(cu_seqlens, seq_lens) as host ints when some sequence of this eager step has enough queries for the
        non-absorbed form, else None. Without the runner's host copies (a driver's batch) they are read back."""
        if batch.traced or batch.input_ids.shape[0] < self.min_prefill_queries:
            return None
        host = batch.host
        cu, lens = (host.cu_seqlens, host.seq_lens) if host else (batch.cu_seqlens.tolist(), batch.seq_lens.tolist())
        long = any(cu[i + 1] - cu[i] >= self.min_prefill_queries for i in range(len(cu) - 1))
        return (cu, lens) if long else None


STACKED_MIX_MAX_ELEMS = 1 << 24  # candidates x tokens x width mixed as one stacked tensor (64 MiB fp32)


def attn_res_mix(blocks: list[torch.Tensor], prefix_sum: torch.Tensor, norm_weight: torch.Tensor,
                 proj_weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`Σ_j softmax_j(rmsnorm_noweight(V_j)·(norm_weight ⊙ proj_weight[0]))·V_j` over V = blocks + [prefix_sum].

    In fp32 over the raw V; a candidate's score is `(V_j · w) · rsqrt(mean(V_j²) + eps)`, the weightless RMSNorm's
    factor taken out of the dot product. Small steps (decode, short chunks: up to `STACKED_MIX_MAX_ELEMS` values)
    stack the candidates and mix them in a handful of ops; larger ones go one candidate at a time (no stacked
    copy of a long prefill's blocks)."""
    score_weight = fp32(norm_weight) * fp32(proj_weight.reshape(-1))  # [D]
    count = len(blocks) + 1
    if count * prefix_sum.numel() <= STACKED_MIX_MAX_ELEMS:
        stacked = fp32(torch.stack(blocks + [prefix_sum]))  # [B+1, T, D]
        scores = (stacked @ score_weight).mul_(torch.rsqrt(stacked.square().mean(-1).add_(eps)))  # [B+1, T]
        probs = scores.softmax(dim=0)
        return cast((stacked * probs.unsqueeze(-1)).sum(0), prefix_sum.dtype)  # [T, D]
    candidates = [v.float() for v in blocks + [prefix_sum]]  # each [T, D]
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
    def __init__(self, config: ModelConfig, spec: LayerSpec, ctx: RankContext = SINGLE, experts_format: str = "dense"):
        super().__init__()
        self.spec, self.ctx = spec, ctx
        d, eps = config.hidden_size, config.rms_norm_eps
        mixer = KDAMixer if spec.mixer == "kda" else MLAMixer
        self.self_attn = mixer(config, spec.index, ctx)
        if spec.ffn == "moe":
            self.block_sparse_moe = SparseMoE(config, ctx, experts_format)
        else:
            self.mlp = GatedMLP(d, config.intermediate_size, gated_activation(config), ctx, "intermediate_size")
        self.input_layernorm = RMSNorm(d, eps)
        self.post_attention_layernorm = RMSNorm(d, eps)
        if spec.residual == "attn_res":
            self.block_size = config.attn_res_block_size
            self.eps = eps
            self.self_attention_res_norm, self.self_attention_res_proj = RMSNorm(d, eps), _linear(d, 1)
            self.mlp_res_norm, self.mlp_res_proj = RMSNorm(d, eps), _linear(d, 1)

    def ffn(self, x: torch.Tensor) -> torch.Tensor:
        return self.block_sparse_moe(x) if self.spec.ffn == "moe" else self.ctx.all_reduce(self.mlp(x))

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
