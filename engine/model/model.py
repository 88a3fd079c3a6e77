"""`KimiForCausalLM`: the whole text model of both families, driven by `ForwardBatch` steps.

Contract:
- `forward(batch, cache)` runs one step for a packed batch (prefill chunks, decodes, or a mix), writes the new
  tokens' MLA latents and the KDA states in place (see engine/model/batch.py) and returns fp32 logits `[L, vocab]`
  for the rows `batch.logits_indices` (default: the last new token of each sequence).
- `forward(batch, cache, taps)` with non-empty `taps` (speculative decoding's drafters, engine/spec/drafter.py)
  returns `(logits, hidden)`: `hidden` `[T, len(taps) * D]` in the model dtype holds, for EVERY row of the batch,
  the tapped streams concatenated in `taps` order. A layer id `i` taps the stream layer `i` hands on: the plain
  residual stream after the layer, or with K3 attention residuals the layer-output partial sum of the current
  block (`prefix_sum + ffn_out`, NOT the attention-residual mix of the blocks) — what vLLM's Kimi K3 captures as
  aux hidden state `i + 1` (`aux_hidden_state_layers`, its default `prefix_only` mode) for DSpark's
  `target_layer_ids`. `FINAL_TAP` (-1) taps the final hidden state before `model.norm` (after the output mix of
  attention residuals): what vLLM hands its MTP layers. Without taps nothing is captured (the same code path).
- On CPU the forward step runs with denormals flushed to zero (see `forward`); the thread's mode is restored after.
- Parameter names equal the official checkpoint names minus the family's `weight_prefix`, except stacked experts
  (see engine/model/moe.py); `engine.model.loader` maps between the two.
- Built for one tensor-parallel rank (`ctx`, default the whole model): the embedding and the LM head are
  vocabulary-parallel (the LM head's logits are all-gathered, so every rank returns the full `[L, vocab]`), norms
  and the attention-residual mixes replicated, the layers as engine/model/layers.py says. Every rank must run
  `forward` with the same `ForwardBatch` (it calls collectives). `experts_format` "mxfp4" keeps routed experts
  packed. `num_local_kda_heads` is the KDA head count of this rank's state slots (`CacheTensors.allocate`).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.model.batch import CacheTensors, ForwardBatch
from engine.model.config import ModelConfig
from engine.model.common import VocabEmbedding
from engine.model.layers import DecoderLayer, RMSNorm, ResidualStream, _linear, attn_res_mix
from engine.parallel.comm import SINGLE, RankContext
from engine.spec.drafter import FINAL_TAP
from kernels.casting import fp32


class KimiTextModel(nn.Module):
    def __init__(self, config: ModelConfig, ctx: RankContext = SINGLE, experts_format: str = "dense"):
        super().__init__()
        self.config = config
        d = config.hidden_size
        self.embed_tokens = VocabEmbedding(config.vocab_size, d, ctx)
        self.layers = nn.ModuleList([DecoderLayer(config, spec, ctx, experts_format) for spec in config.layers])
        self.norm = RMSNorm(d, config.rms_norm_eps)
        if config.attn_res_block_size:
            self.output_attn_res_norm = RMSNorm(d, config.rms_norm_eps)
            self.output_attn_res_proj = _linear(d, 1)

    def forward(self, batch: ForwardBatch, cache: CacheTensors, taps: tuple[int, ...] = ()
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Normed final hidden `[T, D]`; with `taps` also the tapped streams `[T, len(taps) * D]`."""
        embeds = self.embed_tokens(batch.input_ids)  # [T, D]
        if batch.mm_embeds is not None:  # image features replace the embeddings of their pad tokens
            embeds = embeds.index_copy(0, batch.mm_positions, batch.mm_embeds.to(embeds.dtype))
        stream = ResidualStream(embeds)
        captured: dict[int, torch.Tensor] = {}
        for layer in self.layers:
            layer(stream, batch, cache)
            if taps and layer.spec.index in taps:
                captured[layer.spec.index] = stream.hidden  # [T, D], the stream this layer hands on
        hidden = stream.hidden
        if self.config.attn_res_block_size:
            hidden = attn_res_mix(stream.blocks, hidden, self.output_attn_res_norm.weight,
                                  self.output_attn_res_proj.weight, self.config.rms_norm_eps)
        if not taps:
            return self.norm(hidden)  # [T, D]
        captured[FINAL_TAP] = hidden
        return self.norm(hidden), torch.cat([captured[t] for t in taps], dim=-1)  # [T, D], [T, len(taps)*D]


class KimiForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, ctx: RankContext = SINGLE, experts_format: str = "dense"):
        super().__init__()
        self.config, self.ctx, self.experts_format = config, ctx, experts_format
        self.model = KimiTextModel(config, ctx, experts_format)
        self.lm_head = _linear(config.hidden_size, config.vocab_size // ctx.size, shard_dim=0)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def num_local_kda_heads(self) -> int:
        return self.config.kda.num_heads // self.ctx.size if self.config.kda else 0

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, cache: CacheTensors, taps: tuple[int, ...] = ()
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """fp32 logits `[L, V]`; with `taps`, `(logits, hidden [T, len(taps) * D])` (see the module contract)."""
        # KDA states decay towards zero; on CPU, subnormal values make every following matmul ~10-100x slower.
        # Flushing them changes results by < 1e-38. The flag is the calling thread's CPU mode, so it is restored
        # afterwards: other code on this thread (hypothesis, numpy users) may rely on subnormals.
        torch.set_flush_denormal(True)
        try:
            out = self.model(batch, cache, taps) if taps else self.model(batch, cache)
            hidden, tapped = out if taps else (out, None)  # [T, D], [T, len(taps)*D]
            rows = batch.logits_indices if batch.logits_indices is not None else batch.last_token_indices()
            logits = self.ctx.all_gather(fp32(self.lm_head(hidden[rows])), dim=-1)  # [L, V]
            return logits if tapped is None else (logits, tapped)
        finally:
            torch.set_flush_denormal(False)
