"""The `k3_dspark` drafter model (vLLM `K3DSparkForCausalLM`): config, module, its own checkpoint folder.

Contract:
- Folder: `config.json` (`model_type` "k3_dspark", DeepSeek-V3 field names: `hidden_size`, `intermediate_size`,
  `num_hidden_layers`, `num_attention_heads`, `q_lora_rank` (required), `kv_lora_rank`, `qk_nope_head_dim`,
  `qk_rope_head_dim`, `v_head_dim`, `rms_norm_eps`, `vocab_size`, `hidden_act`, `rope_theta` + `rope_parameters`
  or `rope_scaling` (`rope_type` "default" or "yarn"), and DSpark's `target_hidden_size`, `target_layer_ids`
  (0-based target layers), `num_target_layers` (= their count), `markov_rank`, `mask_token_id` (or
  `dspark_noise_token_id`), `block_size`) plus `*.safetensors` under vLLM's names without a `model.` prefix:
  `context_proj.weight` `[D, n * Dt]`, `context_norm.weight`, `layers.{i}.self_attn.{q_a_proj, q_a_layernorm,
  q_b_proj, kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj}.weight`, `layers.{i}.mlp.{gate_proj, up_proj,
  down_proj}.weight`, `layers.{i}.{input,post_attention}_layernorm.weight`, `final_norm.weight`,
  `markov_head.markov_w1.weight` `[V, r]`, `markov_head.markov_w2.weight` `[V, r]`. Options vLLM refuses
  (`mla_use_nope`, `mla_use_output_gate`, `mla_use_qk_norm`, `sample_from_anchor: false`, a draft vocabulary other
  than the target's) are refused here too. `embed_tokens.*`, `lm_head.*`, `confidence_head.*` are ignored (vLLM
  drops them: the embedding and LM head are the target's, the confidence head is training-only).
- Math (vLLM dspark_mla.py + the DSpark speculator): `ctx = context_norm(context_proj(cat of the target's tapped
  streams))` per committed position; each layer caches `latent(ctx)` (its `kv_a_proj_with_mqa` + `kv_a_layernorm`,
  RoPE on `k_pe` at the position) WITHOUT running the layer on it. A block at anchor position p is the tokens
  `[token p, mask × (N - 1)]` at positions p .. p + N - 1 through the dense layers (pre-norm, plain residual
  adds, MLA with RoPE and no output gate, SiLU/SiTU MLP); the block's rows see every context key before p and
  every row of the block (non-causal). `final_norm` → the target's LM head gives base logits; draft i adds the
  Markov bias `markov_w2(markov_w1[previous token])` (the previous token: the anchor for i = 0, draft i - 1 after).
- `DSparkModel.forward_train(hidden [T, n*Dt], token_ids [T], anchors [B]) -> logits [B, N, V]` (fp32) is the
  training form: block b anchors at position `anchors[b]` (1 ≤ p, p + N ≤ T), sees the context of positions < p,
  and its logits i predict `token_ids[p + 1 + i]` with the Markov bias of the true previous token (teacher forcing).
  Differentiable, pure torch. `request_blocks(anchors, block_ids, ctx_keys [B, S, layers, C], ctx_lens)` is the
  inference form over B requests at once, each block seeing its own request's first `ctx_lens[b]` rows; both
  forms run the same layers (one batch row for training, B for inference).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from engine.model.common import GatedMLP, RMSNorm, _linear
from engine.model.config import ConfigError, MLAConfig
from engine.spec.latent_attention import DraftMLA, RopeConfig
from kernels.moe.activation import GatedActivation

IGNORED_PREFIXES = ("embed_tokens.", "lm_head.", "confidence_head.")


@dataclass(frozen=True)
class DSparkConfig:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    vocab_size: int
    rms_norm_eps: float
    mla: MLAConfig
    rope: RopeConfig
    activation: GatedActivation
    target_hidden_size: int
    target_layer_ids: tuple[int, ...]
    markov_rank: int
    mask_token_id: int
    block_size: int
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_dict(cls, raw: dict) -> "DSparkConfig":
        if raw.get("model_type") != "k3_dspark":
            raise ConfigError(f"model_type {raw.get('model_type')!r}: a DSpark drafter folder is 'k3_dspark'")
        for name in ("mla_use_nope", "mla_use_output_gate", "mla_use_qk_norm", "dspark_bonus_anchor"):
            if raw.get(name):
                raise ConfigError(f"k3_dspark: {name} is not supported (as in vLLM)")
        if raw.get("sample_from_anchor", True) is not True:
            raise ConfigError("k3_dspark: only sample_from_anchor=true (the anchor predicts the first draft)")
        targets = tuple(int(i) for i in _need(raw, "target_layer_ids"))
        if not targets or int(raw.get("num_target_layers", len(targets))) != len(targets):
            raise ConfigError("k3_dspark needs non-empty target_layer_ids and a matching num_target_layers")
        vocab = int(_need(raw, "vocab_size"))
        if int(raw.get("draft_vocab_size") or vocab) != vocab:
            raise ConfigError("k3_dspark: draft_vocab_size must equal vocab_size (embedding and LM head shared)")
        mask = raw.get("mask_token_id", raw.get("dspark_noise_token_id"))
        return cls(
            hidden_size=int(_need(raw, "hidden_size")), intermediate_size=int(_need(raw, "intermediate_size")),
            num_layers=int(_need(raw, "num_hidden_layers")), vocab_size=vocab,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)), mla=_mla(raw), rope=_rope(raw),
            activation=_activation(raw), target_hidden_size=int(_need(raw, "target_hidden_size")),
            target_layer_ids=targets, markov_rank=int(_need(raw, "markov_rank")),
            mask_token_id=int(_need({"mask_token_id": mask}, "mask_token_id")),
            block_size=int(raw.get("block_size") or raw.get("dspark_block_size") or 0), raw=raw,
        )


def _need(raw: dict, name: str):
    if raw.get(name) is None:
        raise ConfigError(f"k3_dspark config.json is missing `{name}`")
    return raw[name]


def _mla(raw: dict) -> MLAConfig:
    return MLAConfig(num_heads=int(_need(raw, "num_attention_heads")), q_lora_rank=int(_need(raw, "q_lora_rank")),
                     kv_lora_rank=int(_need(raw, "kv_lora_rank")), qk_nope_head_dim=int(_need(raw, "qk_nope_head_dim")),
                     qk_rope_head_dim=int(_need(raw, "qk_rope_head_dim")), v_head_dim=int(_need(raw, "v_head_dim")),
                     output_gate=False)


def _rope(raw: dict) -> RopeConfig:
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", raw.get("rope_theta", 50000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    dim = int(_need(raw, "qk_rope_head_dim"))
    if kind == "default":
        return RopeConfig(dim=dim, theta=theta)
    if kind not in ("yarn", "deepseek_yarn") or params.get("attention_factor") == 1.0:
        raise ConfigError(f"k3_dspark rope_type {kind!r} is not supported (default, yarn)")
    return RopeConfig(dim=dim, theta=theta, factor=float(_need(params, "factor")),
                      original_max_position=int(params.get("original_max_position_embeddings", 4096)),
                      beta_fast=float(params.get("beta_fast", 32)), beta_slow=float(params.get("beta_slow", 1)),
                      mscale=float(params.get("mscale", 1)), mscale_all_dim=float(params.get("mscale_all_dim", 0)))


def _activation(raw: dict) -> GatedActivation:
    kind = raw.get("hidden_act", "silu")
    if kind not in ("silu", "situ"):
        raise ConfigError(f"k3_dspark hidden_act {kind!r} is not supported (silu, situ)")
    return GatedActivation(kind=kind, beta=float(raw.get("activation_situ_beta") or 1.0),
                           linear_beta=raw.get("activation_situ_linear_beta"))


def load_dspark_config(folder: str | Path) -> DSparkConfig:
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise ConfigError(f"{path} does not exist (a DSpark drafter folder has config.json + *.safetensors)")
    return DSparkConfig.from_dict(json.loads(path.read_text()))


class DSparkLayer(nn.Module):
    def __init__(self, config: DSparkConfig):
        super().__init__()
        d, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = DraftMLA(config.mla, d, eps, config.rope)
        self.mlp = GatedMLP(d, config.intermediate_size, config.activation)
        self.input_layernorm, self.post_attention_layernorm = RMSNorm(d, eps), RMSNorm(d, eps)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, ctx_keys: torch.Tensor,
                visible: torch.Tensor) -> torch.Tensor:
        """x [B, T, D] at positions [B, T] after ctx_keys [B, S, C]; visible [B, T, S + T] -> [B, T, D]."""
        y = x + self.self_attn(self.input_layernorm(x), positions, ctx_keys, visible)
        return y + self.mlp(self.post_attention_layernorm(y))


class MarkovHead(nn.Module):
    def __init__(self, vocab: int, rank: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab, rank)  # previous token -> [r]
        self.markov_w2 = _linear(rank, vocab)  # [r] -> logit bias [V]

    def forward(self, prev_ids: torch.Tensor) -> torch.Tensor:
        return self.markov_w2(self.markov_w1(prev_ids)).float()  # [..., V]


class DSparkModel(nn.Module):
    def __init__(self, config: DSparkConfig, embed_tokens: nn.Module, lm_head: nn.Module):
        super().__init__()
        self.config = config
        self.target = (embed_tokens, lm_head)  # the target's; a tuple so they are not submodules (not saved)
        d = config.hidden_size
        self.context_proj = _linear(config.target_hidden_size * len(config.target_layer_ids), d)
        self.context_norm = RMSNorm(d, config.rms_norm_eps)
        self.layers = nn.ModuleList([DSparkLayer(config) for _ in range(config.num_layers)])
        self.final_norm = RMSNorm(d, config.rms_norm_eps)
        self.markov_head = MarkovHead(config.vocab_size, config.markov_rank)

    def context_keys(self, hidden: torch.Tensor, positions: torch.Tensor) -> list[torch.Tensor]:
        """Tapped target rows [T, n*Dt] at positions [T] -> each layer's latent cache rows [T, C]."""
        ctx = self.context_norm(self.context_proj(hidden.to(self.context_proj.weight.dtype)))  # [T, D]
        return [layer.self_attn.latent(ctx, positions) for layer in self.layers]

    def block_logits(self, anchors: torch.Tensor, block_ids: torch.Tensor, ctx_keys: list[torch.Tensor],
                     ctx_positions: torch.Tensor) -> torch.Tensor:
        """Blocks [B, N] at positions anchors[b] + 0..N-1 over one shared context (the training form: every block
        sees the keys [S, C] of ctx_positions [S] before its anchor) -> base logits [B, N, V] fp32."""
        b, n = block_ids.shape
        positions = (anchors[:, None] + torch.arange(n, device=anchors.device)).reshape(1, -1)  # [1, B*N]
        owner = torch.arange(b, device=anchors.device).repeat_interleave(n)  # [B*N]
        sees_ctx = ctx_positions[None, :] < anchors[owner][:, None]  # [B*N, S]
        visible = torch.cat([sees_ctx, owner[:, None] == owner[None, :]], dim=1)[None]  # [1, B*N, S + B*N]
        x = self.target[0](block_ids.reshape(1, -1))  # [1, B*N, D]
        return self._logits(x, positions, [keys[None] for keys in ctx_keys], visible).reshape(b, n, -1)

    def request_blocks(self, anchors: torch.Tensor, block_ids: torch.Tensor, ctx_keys: torch.Tensor,
                       ctx_lens: torch.Tensor) -> torch.Tensor:
        """The inference form, B requests at once: block b [N] at positions anchors[b] + 0..N-1 sees its own
        request's first ctx_lens[b] context rows of ctx_keys [B, S, num_layers, C] (the rest is padding) and its
        own block (non-causal) -> base logits [B, N, V] fp32."""
        b, n = block_ids.shape
        s = ctx_keys.shape[1]
        positions = anchors[:, None] + torch.arange(n, device=anchors.device)  # [B, N]
        sees_ctx = torch.arange(s, device=anchors.device)[None, :] < ctx_lens[:, None]  # [B, S]
        visible = torch.cat([sees_ctx[:, None, :].expand(b, n, s),
                             sees_ctx.new_ones(b, n, n)], dim=2)  # [B, N, S + N]
        keys = [ctx_keys[:, :, i] for i in range(len(self.layers))]
        return self._logits(self.target[0](block_ids), positions, keys, visible)

    def _logits(self, x: torch.Tensor, positions: torch.Tensor, ctx_keys: list[torch.Tensor],
                visible: torch.Tensor) -> torch.Tensor:
        """x [B, T, D] through the layers (each over its ctx_keys [B, S, C]) -> base logits [B, T, V] fp32."""
        for layer, keys in zip(self.layers, ctx_keys):
            x = layer(x, positions, keys, visible)
        return self.target[1](self.final_norm(x)).float()

    def forward_train(self, hidden: torch.Tensor, token_ids: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
        """hidden [T, n*Dt], token_ids [T], anchors [B] -> logits [B, N, V] for token_ids[anchors + 1 + i]."""
        n = self.config.block_size
        positions = torch.arange(hidden.shape[0], device=hidden.device)
        block_ids = torch.full((anchors.shape[0], n), self.config.mask_token_id, device=token_ids.device)
        block_ids[:, 0] = token_ids[anchors]
        base = self.block_logits(anchors, block_ids, self.context_keys(hidden, positions), positions)
        prev = token_ids[anchors[:, None] + torch.arange(n, device=anchors.device)]  # [B, N] true previous tokens
        return base + self.markov_head(prev)
