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
from engine.parallel.pipeline import blocks_before, from_rank, recv_stream, send_stream, to_rank0
from engine.spec.drafter import FINAL_TAP
from kernels.casting import fp32


class KimiTextModel(nn.Module):
    def __init__(self, config: ModelConfig, ctx: RankContext = SINGLE, experts_format: str = "dense"):
        super().__init__()
        self.config, self.stage = config, ctx.stage
        d = config.hidden_size
        owned = self.owned_layers(config, ctx)
        self.embed_tokens = VocabEmbedding(config.vocab_size, d, ctx) if self.stage.owns_embedding or \
            not self.stage.pipelined else None
        # Other stages' layers are parameter-free placeholders: parameter names keep their layer index.
        self.layers = nn.ModuleList([DecoderLayer(config, spec, ctx, experts_format) if spec.index in owned
                                     else nn.Identity() for spec in config.layers])
        self.owned = [self.layers[i] for i in owned]
        has_head = self.stage.last or not self.stage.pipelined
        self.norm = RMSNorm(d, config.rms_norm_eps) if has_head else None
        if config.attn_res_block_size and has_head:
            self.output_attn_res_norm = RMSNorm(d, config.rms_norm_eps)
            self.output_attn_res_proj = _linear(d, 1)

    @staticmethod
    def owned_layers(config: ModelConfig, ctx: RankContext) -> range:
        """The decoder layers this rank's stage computes (all of them without pipeline parallelism)."""
        return range(ctx.stage.start, ctx.stage.stop) if ctx.stage.pipelined else range(config.num_hidden_layers)

    def norm_or_first_weight(self) -> torch.Tensor:
        """A parameter in the model dtype on the model device that every stage has."""
        return self.owned[0].input_layernorm.weight

    def _stream_in(self, batch: ForwardBatch) -> ResidualStream:
        """Stage 0: the embeddings; a later stage: the stream the previous stage handed on."""
        if not self.stage.pipelined or self.stage.first:
            embeds = self.embed_tokens(batch.input_ids)  # [T, D]
            if batch.mm_embeds is not None:  # image features replace the embeddings of their pad tokens
                embeds = embeds.index_copy(0, batch.mm_positions, batch.mm_embeds.to(embeds.dtype))
            return ResidualStream(embeds)
        weight = self.norm_or_first_weight()
        hidden, blocks = recv_stream(self.stage, batch.input_ids.shape[0], self.config.hidden_size,
                                     blocks_before(self.stage.start, self.config.attn_res_block_size), weight.dtype,
                                     weight.device)
        stream = ResidualStream(hidden)
        stream.blocks = blocks
        return stream

    def forward(self, batch: ForwardBatch, cache: CacheTensors, taps: tuple[int, ...] = ()
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Normed final hidden `[T, D]`; with `taps` also the tapped streams `[T, len(taps) * D]`. Pipelined:
        see `stage_forward`."""
        hidden, captured = self.stage_forward(batch, cache, taps)
        if not taps:
            return hidden
        return hidden, torch.cat([captured[t] for t in taps], dim=-1)  # [T, D], [T, len(taps)*D]

    def stage_forward(self, batch: ForwardBatch, cache: CacheTensors, taps: tuple[int, ...] = (),
                      sends: list | None = None) -> tuple[torch.Tensor | None, dict[int, torch.Tensor]]:
        """This stage's layers: (the normed final hidden `[T, D]` on the last stage, else None after handing the
        stream on — without blocking when `sends` collects the send handles; the taps of this stage's layers,
        `[T, D]` each)."""
        stream = self._stream_in(batch)
        captured: dict[int, torch.Tensor] = {}
        for layer in self.owned:
            layer(stream, batch, cache)
            if taps and layer.spec.index in taps:
                captured[layer.spec.index] = stream.hidden  # [T, D], the stream this layer hands on
        if self.norm is None:
            work = send_stream(self.stage, stream.hidden, stream.blocks, wait=sends is None)
            if sends is not None:
                sends.append(work)
            return None, captured
        hidden = stream.hidden
        if self.config.attn_res_block_size:
            hidden = attn_res_mix(stream.blocks, hidden, self.output_attn_res_norm.weight,
                                  self.output_attn_res_proj.weight, self.config.rms_norm_eps)
        if taps:
            captured[FINAL_TAP] = hidden
        return self.norm(hidden), captured


class KimiForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, ctx: RankContext = SINGLE, experts_format: str = "dense"):
        super().__init__()
        self.config, self.ctx, self.experts_format = config, ctx, experts_format
        self.model = KimiTextModel(config, ctx, experts_format)
        self.lm_head = None
        if ctx.stage.last or not ctx.stage.pipelined:
            self.lm_head = _linear(config.hidden_size, config.vocab_size // ctx.size, shard_dim=0)
            if config.tie_word_embeddings:
                self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def num_local_kda_heads(self) -> int:
        return self.config.kda.num_heads // self.ctx.size if self.config.kda else 0

    @property
    def device(self) -> torch.device:
        return self.model.norm_or_first_weight().device

    @property
    def dtype(self) -> torch.dtype:
        """The model (serving) dtype: the dtype of the norms (every stage has some)."""
        return self.model.norm_or_first_weight().dtype

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, cache: CacheTensors, taps: tuple[int, ...] = ()
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """fp32 logits `[L, V]`; with `taps`, `(logits, hidden [T, len(taps) * D])` (see the module contract)."""
        # KDA states decay towards zero; on CPU, subnormal values make every following matmul ~10-100x slower.
        # Flushing them changes results by < 1e-38. The flag is the calling thread's CPU mode, so it is restored
        # afterwards: other code on this thread (hypothesis, numpy users) may rely on subnormals.
        torch.set_flush_denormal(True)
        try:
            if self.ctx.stage.pipelined:
                return self._pipelined(batch, cache, taps)
            out = self.model(batch, cache, taps) if taps else self.model(batch, cache)
            hidden, tapped = out if taps else (out, None)  # [T, D], [T, len(taps)*D]
            rows = batch.logits_indices if batch.logits_indices is not None else batch.last_token_indices()
            logits = self.ctx.all_gather(fp32(self.lm_head(hidden[rows])), dim=-1)  # [L, V]
            return logits if tapped is None else (logits, tapped)
        finally:
            torch.set_flush_denormal(False)

    def _pipelined(self, batch: ForwardBatch, cache: CacheTensors, taps: tuple[int, ...]
                   ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor | None]:
        """This stage's part of the step. Global rank 0 returns the full logits `[L, V]` (sent by the last stage's
        TP rank 0) and the taps gathered from their stages; other ranks return `[0, V]` and no taps."""
        logits, tapped = self.forward_micro_batches([batch], cache, taps)[0]
        return logits if not taps else (logits, tapped)

    @torch.inference_mode()
    def forward_micro_batches(self, batches: list[ForwardBatch], cache: CacheTensors, taps: tuple[int, ...] = ()
                              ) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """Pipeline parallelism: the batches (micro-batches of independent sequences) in order through this stage,
        each handed on with a non-blocking send, so stage s works on micro-batch m while stage s + 1 works on
        m - 1. Per batch `(logits [L, V], taps [T, len(taps) * D] or None)` on global rank 0; `([0, V], None)`
        elsewhere. Every rank calls it with the same batches."""
        torch.set_flush_denormal(True)  # as in `forward`
        try:
            sends, outs = [], []
            for batch in batches:
                outs.append(self._stage_part(batch, cache, taps, sends))
            results = [self._collect(batch, out, taps) for batch, out in zip(batches, outs)]
            for work in sends:
                work.wait()
            return results
        finally:
            torch.set_flush_denormal(False)

    def _stage_part(self, batch: ForwardBatch, cache: CacheTensors, taps: tuple[int, ...], sends: list
                    ) -> tuple[torch.Tensor | None, dict[int, torch.Tensor]]:
        """This stage's layers on one batch; what goes to rank 0 (taps, then the last stage's logits) is sent
        without blocking (`sends` keeps the handles). Returns (logits or None, this stage's taps)."""
        stage = self.ctx.stage
        hidden, captured = self.model.stage_forward(batch, cache, taps, sends)
        logits = None
        if hidden is not None:
            rows = batch.logits_indices if batch.logits_indices is not None else batch.last_token_indices()
            logits = self.ctx.all_gather(fp32(self.lm_head(hidden[rows])), dim=-1)  # [L, V]
        if stage.tp_rank == 0 and stage.global_rank != 0:
            mine = [t for t in taps if t in captured]
            if mine:
                sends.append(to_rank0(torch.cat([captured[t] for t in mine], dim=-1)))  # [T, len(mine) * D]
            if logits is not None:
                sends.append(to_rank0(logits))
        return logits, captured

    def _collect(self, batch: ForwardBatch, out: tuple[torch.Tensor | None, dict[int, torch.Tensor]],
                 taps: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Rank 0: one batch's taps from their stages (in stage order) and its logits from the last stage."""
        stage, vocab = self.ctx.stage, self.config.vocab_size
        logits, captured = out
        if stage.global_rank != 0:
            return torch.empty(0, vocab, device=self.device), None
        tokens, d = batch.input_ids.shape[0], self.config.hidden_size
        captured = dict(captured)
        for s in range(1, stage.num_stages):
            theirs = [t for t in taps if self._stage_of_tap(t) == s]
            if theirs:
                got = from_rank((tokens, len(theirs) * d), self.dtype, self.device, s * stage.tp_size)
                captured.update(zip(theirs, got.split(d, dim=-1)))
        if logits is None:
            rows = batch.logits_indices if batch.logits_indices is not None else batch.last_token_indices()
            logits = from_rank((rows.numel(), vocab), torch.float32, self.device, stage.last_rank0)
        return logits, (torch.cat([captured[t] for t in taps], dim=-1) if taps else None)

    def _stage_of_tap(self, tap: int) -> int:
        num_layers = self.config.num_hidden_layers
        return self.ctx.stage.num_stages - 1 if tap == FINAL_TAP else self.ctx.stage.stage_of_layer(tap, num_layers)
