"""`KimiForCausalLM`: the whole text model of both families, driven by `ForwardBatch` steps.

Contract:
- `forward(batch, cache)` runs one step for a packed batch (prefill chunks, decodes, or a mix), writes the new
  tokens' MLA latents and the KDA states in place (see engine/model/batch.py) and returns fp32 logits `[L, vocab]`
  for the rows `batch.logits_indices` (default: the last new token of each sequence).
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

    def forward(self, batch: ForwardBatch, cache: CacheTensors) -> torch.Tensor:
        embeds = self.embed_tokens(batch.input_ids)  # [T, D]
        if batch.mm_embeds is not None:  # image features replace the embeddings of their pad tokens
            embeds = embeds.index_copy(0, batch.mm_positions, batch.mm_embeds.to(embeds.dtype))
        stream = ResidualStream(embeds)
        for layer in self.layers:
            layer(stream, batch, cache)
        hidden = stream.hidden
        if self.config.attn_res_block_size:
            hidden = attn_res_mix(stream.blocks, hidden, self.output_attn_res_norm.weight,
                                  self.output_attn_res_proj.weight, self.config.rms_norm_eps)
        return self.norm(hidden)  # [T, D]


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
    def forward(self, batch: ForwardBatch, cache: CacheTensors) -> torch.Tensor:
        # KDA states decay towards zero; on CPU, subnormal values make every following matmul ~10-100x slower.
        # Flushing them changes results by < 1e-38. The flag is the calling thread's CPU mode, so it is restored
        # afterwards: other code on this thread (hypothesis, numpy users) may rely on subnormals.
        torch.set_flush_denormal(True)
        try:
            hidden = self.model(batch, cache)  # [T, D]
            rows = batch.logits_indices if batch.logits_indices is not None else batch.last_token_indices()
            return self.ctx.all_gather(self.lm_head(hidden[rows]).float(), dim=-1)  # [L, V]  # [L, V]
        finally:
            torch.set_flush_denormal(False)
