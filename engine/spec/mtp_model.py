"""Kimi K3's multi-token-prediction (MTP) layer (vLLM model type `kimi_k3_mtp`): module, loading, seeded weights.

Contract:
- `MTPLayer(config, spec, embed_tokens)` is one MTP layer with the released parameter names below
  `{weight_prefix}model.layers.{num_hidden_layers + i}.`: `enorm`, `hnorm`, `eh_proj` (`[D, 2D]`),
  `shared_head.norm`, `shared_head.head` (its own LM head `[V, D]`) and a full decoder block — `self_attn` (the
  target's MLA: q-LoRA, output gate, NoPE), `input_layernorm`, `post_attention_layernorm` and `block_sparse_moe`
  (or `mlp`) — with plain residual adds (the block starts without the target's attention-residual state). The
  token embedding is the target's (`embed_tokens`, not a parameter of the layer). Stacked experts as in
  engine/model/moe.py.
- The math (vLLM `KimiK3MultiTokenPredictorLayer`): the row of position t reads the target's final hidden `h_t`
  (before `model.norm`: `FINAL_TAP`) and the embedding `e` of the token at t + 1, zeroed at position 0:
  `x = eh_proj([enorm(e) ; hnorm(h_t)])`; `y = x + attn(input_layernorm(x))`; `out = y + ffn(post_attention_layernorm(y))`;
  logits `shared_head.head(shared_head.norm(out))` predict the token at t + 2. `out` (pre-norm) is the hidden the
  next chained draft step reads in place of `h`. Attention is causal over the layer's own latent cache
  (`self_attn.latent(...)` of each earlier row), engine/spec/latent_attention.py. `block(x, positions, ctx_keys)`
  runs the rows of one sequence (training); `step(x, positions, keys, visible)` runs one row for each of B
  sequences at once (drafting), each over its own earlier keys `[B, S, C]` under a mask and its own row, and
  returns the rows' own cache rows beside the output (the next chained step appends them to its keys).
- `forward_train(hidden [T, D], token_ids [T]) -> logits [T - 1, V]` (fp32) is the full-sequence form for
  distillation: row t uses `hidden[t]` and `token_ids[t + 1]` and predicts `token_ids[t + 2]` (the last row's target
  lies past the sequence). Differentiable (pure torch on CPU; the routed-expert kernel of the device in use must
  support autograd, the torch one does).
- `load_mtp_layers(target, target_dir)` reads the layers' tensors from the target's own `*.safetensors` (the
  target loader sets them aside), with the target loader's checks (one error naming every missing, unexpected
  and mis-shaped tensor; the MTP layer's unused attention-residual weights `*_res_norm` / `*_res_proj` are
  skipped, as vLLM does). `mtp_tensors(config, seed)` draws seeded weights for generated checkpoints from a
  generator keyed by each tensor's name alone (`engine.model.init.sample_tensor`), so the target's weights of a
  seed are the same with and without MTP layers.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from engine.model.common import GatedMLP, RMSNorm, _linear, gated_activation
from engine.model.config import LayerSpec, ModelConfig
from engine.model.fused import attach_compact_weights, bind_fused_weights, lay_out_for_gemv
from engine.model.init import materialize, sample_tensor
from engine.model.loader import (FP32_PARAM_SUFFIXES, LoadConfig, checkpoint_files, checkpoint_layout, copy_tensors,
                                 official_tensors, read_header, validate)
from engine.model.moe import SparseMoE
from engine.model.sources import SafetensorsSource
from engine.parallel.comm import SINGLE
from engine.spec.latent_attention import DraftMLA, causal_visible

logger = logging.getLogger(__name__)

UNUSED_SUFFIXES = ("self_attention_res_norm.weight", "self_attention_res_proj.weight", "mlp_res_norm.weight",
                   "mlp_res_proj.weight")
MLA_LATENT_EPS = 1e-6  # the target's q_a / kv_a layernorm eps (engine/model/layers.py MLAMixer)


class MTPError(ValueError):
    """The target has no (usable) MTP layers; the message says why."""


class SharedHead(nn.Module):
    def __init__(self, hidden: int, vocab: int, eps: float):
        super().__init__()
        self.norm = RMSNorm(hidden, eps)
        self.head = _linear(hidden, vocab)


class MTPLayer(nn.Module):
    def __init__(self, config: ModelConfig, spec: LayerSpec, embed_tokens: nn.Module,
                 experts_format: str = "dense"):
        super().__init__()
        prefix = f"{config.weight_prefix}model.layers.{spec.index}."
        self.config = replace(config, weight_prefix=prefix, mtp_layers=())  # checkpoint_layout reads the prefix
        self.ctx, self.spec = SINGLE, spec
        self.embed = (embed_tokens,)  # the target's; a tuple so it is not a submodule (not saved, not loaded)
        d, eps = config.hidden_size, config.rms_norm_eps
        self.enorm, self.hnorm = RMSNorm(d, eps), RMSNorm(d, eps)
        self.eh_proj = _linear(2 * d, d)
        self.shared_head = SharedHead(d, config.vocab_size, eps)
        self.self_attn = DraftMLA(config.mla, d, MLA_LATENT_EPS)
        self.input_layernorm, self.post_attention_layernorm = RMSNorm(d, eps), RMSNorm(d, eps)
        if spec.ffn == "moe":
            self.block_sparse_moe = SparseMoE(config, SINGLE, experts_format)
        else:
            self.mlp = GatedMLP(d, config.intermediate_size, gated_activation(config))

    def fuse_inputs(self, hidden: torch.Tensor, next_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """hidden [T, D] (h_t), next_ids [T] (token t+1), positions [T] (t) -> x [T, D]."""
        embeds = self.embed[0](next_ids)  # [T, D]
        embeds = embeds * (positions != 0).unsqueeze(-1).to(embeds.dtype)  # position 0: no embedding (as vLLM)
        both = torch.cat([self.enorm(embeds), self.hnorm(hidden.to(embeds.dtype))], dim=-1)  # [T, 2D]
        return self.eh_proj(both)

    def cache_rows(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The latent cache rows of inputs x [T, D] -> [T, C] (they depend on each row alone)."""
        return self.self_attn.latent(self.input_layernorm(x), positions)

    def block(self, x: torch.Tensor, positions: torch.Tensor, ctx_keys: torch.Tensor) -> torch.Tensor:
        """x [T, D] after `ctx_keys` [S, C] (earlier positions), causal among the rows -> pre-norm out [T, D]."""
        visible = causal_visible(ctx_keys.shape[0], x.shape[0], x.device)[None]  # [1, T, S + T]
        attn = self.self_attn(self.input_layernorm(x)[None], positions[None], ctx_keys[None], visible)[0]
        return self._ffn(x + attn)

    def step(self, x: torch.Tensor, positions: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """One row per sequence: x [B, D] at positions [B], each over its own earlier keys [B, S, C] (visible [B, S])
        and its own row -> (pre-norm out [B, D], the row's own cache row [B, C] for the steps after it)."""
        normed = self.input_layernorm(x)
        own = self.self_attn.latent(normed, positions)  # [B, C]
        keys = torch.cat([keys, own[:, None].to(keys.dtype)], dim=1)  # [B, S + 1, C]
        visible = torch.cat([visible, visible.new_ones(visible.shape[0], 1)], dim=1)  # [B, S + 1]
        attn = self.self_attn.attend(normed[:, None], positions[:, None], keys, visible[:, None])[:, 0]
        return self._ffn(x + attn), own

    def _ffn(self, y: torch.Tensor) -> torch.Tensor:
        ffn_in = self.post_attention_layernorm(y)
        return y + (self.block_sparse_moe(ffn_in) if self.spec.ffn == "moe" else self.mlp(ffn_in))

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        return self.shared_head.head(self.shared_head.norm(out)).float()  # [T, V]

    def forward_train(self, hidden: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        """hidden [T, D] (the target's FINAL_TAP rows of one sequence), token_ids [T] -> logits [T-1, V]."""
        positions = torch.arange(hidden.shape[0] - 1, device=hidden.device)
        x = self.fuse_inputs(hidden[:-1], token_ids[1:], positions)
        empty = x.new_zeros(0, self.config.mla.cache_dim)
        return self.logits(self.block(x, positions, empty))


def build_mtp_layers(config: ModelConfig, embed_tokens: nn.Module, dtype: torch.dtype, device: torch.device | str,
                     experts_format: str = "dense", gemv_layout: bool = False) -> list[MTPLayer]:
    """Uninitialised layers in `dtype` (fp32 where the target keeps fp32); `gemv_layout`: laid out and bound as
    the loader lays out a CPU target before filling it (input-major products, fused gate/up: engine/model/fused.py)."""
    layers = []
    for spec in config.mtp_layers:
        with torch.device("meta"):
            layer = MTPLayer(config, spec, embed_tokens, experts_format)
        materialize(layer, device, lambda name, declared: declared if not declared.is_floating_point else
                    torch.float32 if name.endswith(FP32_PARAM_SUFFIXES) else dtype)  # no fp32 layer first
        if gemv_layout:
            lay_out_for_gemv(layer)
            bind_fused_weights(layer)  # loading fills the bound tensors through their views
        layers.append(layer.eval().requires_grad_(False))
    return layers


def load_mtp_layers(target, target_dir: str | Path, gemv_layout: bool | None = None) -> list[MTPLayer]:
    """The MTP layers of `target` (a loaded `KimiForCausalLM`) from its checkpoint folder; `gemv_layout` (default:
    on a CPU target) lays them out for serving (`build_mtp_layers`; training wants unbound ones, whose gradients
    reach each weight)."""
    config = target.config
    if not config.mtp_layers:
        raise MTPError(f"{target_dir}: config.json declares no MTP layers (num_nextn_predict_layers is 0); "
                       "method 'mtp' needs a checkpoint with them")
    header = read_header(checkpoint_files(Path(target_dir)))
    layers = build_mtp_layers(config, target.model.embed_tokens, target.dtype, target.device, target.experts_format,
                              gemv_layout=torch.device(target.device).type == "cpu" if gemv_layout is None
                              else gemv_layout)
    for layer, prefix in zip(layers, config.mtp_weight_prefixes):
        mine = {n: v for n, v in header.items() if n.startswith(prefix) and not n.endswith(UNUSED_SUFFIXES)}
        plan = validate(mine, checkpoint_layout(layer), layer.config)
        copy_tensors(layer, plan, SafetensorsSource(mine), LoadConfig(progress=False))
        if gemv_layout is not False and torch.device(target.device).type == "cpu":
            attach_compact_weights(layer)  # exact bf16 copies for the small-batch kernel, as the loader's
    logger.info("loaded %d MTP layer(s) from %s", len(layers), target_dir)
    return layers


def mtp_tensors(config: ModelConfig, seed: int, dtype: torch.dtype, experts_mxfp4: bool = False,
                round_experts=None) -> dict[str, torch.Tensor]:
    """Seeded MTP weights under their official names (none when the config declares no MTP layers).

    `round_experts(layer)`: applied before writing (make_checkpoint rounds experts to MXFP4 values)."""
    tensors: dict[str, torch.Tensor] = {}
    for layer in build_mtp_layers(config, nn.Identity(), torch.float32, "cpu"):
        with torch.no_grad():
            for name, param in layer.named_parameters():
                param.copy_(sample_tensor(f"mtp:{layer.config.weight_prefix}{name}", tuple(param.shape), seed))
        if round_experts is not None:
            round_experts(layer)
        tensors.update(official_tensors(layer, dtype, experts_mxfp4))
    return tensors
