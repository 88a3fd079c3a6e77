"""Model configuration: parses `config.json` of both families exactly as Moonshot released them.

Contract:
- `ModelConfig.from_dict(raw)` / `load_model_config(dir)` accept a `kimi_linear` config (weights at `model.*`) or a
  `kimi_k3` wrapper (`text_config` + `vision_config`, text weights under `language_model.`) and return one frozen
  `ModelConfig` whose `layers` is a tuple of `LayerSpec`, one per decoder layer.
- `linear_attn_config.kda_layers` / `full_attn_layers` are 1-based: layer index i is KDA when i + 1 is in `kda_layers`.
- A layer uses MoE when the model has experts, `i >= first_k_dense_replace` and `i % moe_layer_freq == 0`.
- `num_nextn_predict_layers` > 0 declares K3 multi-token-prediction layers: `mtp_layers` holds one `LayerSpec` per
  layer at index `num_hidden_layers + i` (always MLA, plain residual — the MTP block starts without the attention-
  residual state — and the FFN by the rule above, as vLLM's `kimi_k3_mtp` builds it). They are not decoder layers
  of the target (`layers` excludes them); engine/spec/mtp.py loads and runs them.
- A `kimi_k3` config's `vision_config` parses into `ModelConfig.vision` (`VisionConfig`; None when absent). Fields
  the file omits take the official `KimiK3VisionConfig` defaults; options the official code does not build raise.
- Nothing here touches tensors; a bad config raises `ConfigError` naming the field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

MODEL_FAMILIES = ("kimi_linear", "kimi_k3")


class ConfigError(ValueError):
    """A config.json the engine cannot serve; the message names the offending field."""


@dataclass(frozen=True)
class LayerSpec:
    """What one decoder layer is made of; the one `DecoderLayer` is built from this."""

    index: int
    mixer: str  # "kda" | "mla"
    ffn: str  # "dense" | "moe"
    residual: str  # "plain" | "attn_res"
    activation: str  # "silu" | "situ"


@dataclass(frozen=True)
class KDAConfig:
    num_heads: int
    head_dim: int
    conv_kernel_size: int
    gate_lower_bound: float | None  # None: softplus gate (Kimi Linear); set: lower-bounded sigmoid gate (K3)
    full_rank_output_gate: bool  # K3: g_proj; Kimi Linear: low-rank g_a_proj/g_b_proj


@dataclass(frozen=True)
class MLAConfig:
    num_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    output_gate: bool

    @property
    def cache_dim(self) -> int:
        """Values cached per token and layer: the latent `c` plus the shared `k_rope`."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        return (self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5


@dataclass(frozen=True)
class MoEConfig:
    num_experts: int
    top_k: int
    num_shared_experts: int
    intermediate_size: int
    num_expert_group: int
    topk_group: int
    renormalize: bool
    routed_scaling_factor: float
    latent_size: int | None  # routed_expert_hidden_size (K3 latent MoE); None: experts at full width
    latent_use_norm: bool


@dataclass(frozen=True)
class ActivationConfig:
    kind: str  # "silu" | "situ"
    situ_beta: float = 1.0
    situ_linear_beta: float | None = None


@dataclass(frozen=True)
class VisionConfig:
    """The K3 vision tower (MoonViT3d) and its `patchmergerv2` projector, from `vision_config`."""

    patch_size: int
    hidden_size: int  # vt_hidden_size
    num_layers: int  # vt_num_hidden_layers
    num_heads: int  # vt_num_attention_heads
    qkv_hidden_size: int  # heads x head_dim of the attention (may differ from hidden_size)
    intermediate_size: int  # vt_intermediate_size
    pos_emb_height: int  # init_pos_emb_height: the learnable grid interpolated to each image's patch grid
    pos_emb_width: int
    pos_emb_time: int
    pos_emb_interpolation: str  # "bilinear" | "bicubic"
    merge_kernel: tuple[int, int]  # patches merged into one feature row (height, width)
    norm_type: str  # "rmsnorm" | "layernorm"
    attn_bias: bool
    linear_bias: bool
    patch_embed_bias: bool
    projector_eps: float
    text_hidden_size: int

    @property
    def head_dim(self) -> int:
        return self.qkv_hidden_size // self.num_heads

    @property
    def merged_size(self) -> int:
        """Width of one merged feature row before the projector: hidden x merge_kernel patches."""
        return self.hidden_size * self.merge_kernel[0] * self.merge_kernel[1]


@dataclass(frozen=True)
class ModelConfig:
    family: str  # "kimi_linear" | "kimi_k3"
    weight_prefix: str  # "" for kimi_linear, "language_model." for kimi_k3
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    kda: KDAConfig | None
    mla: MLAConfig
    moe: MoEConfig | None
    activation: ActivationConfig
    attn_res_block_size: int | None
    layers: tuple[LayerSpec, ...]
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    media_placeholder_token_id: int | None = None
    torch_dtype: str | None = None
    vision: VisionConfig | None = None
    mtp_layers: tuple[LayerSpec, ...] = ()  # K3 MTP layers (num_nextn_predict_layers), indices after `layers`
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def kda_layer_ids(self) -> list[int]:
        return [s.index for s in self.layers if s.mixer == "kda"]

    @property
    def mla_layer_ids(self) -> list[int]:
        return [s.index for s in self.layers if s.mixer == "mla"]

    @property
    def mtp_weight_prefixes(self) -> tuple[str, ...]:
        """Checkpoint name prefix of each MTP layer (`{weight_prefix}model.layers.{num_hidden_layers + i}.`)."""
        return tuple(f"{self.weight_prefix}model.layers.{spec.index}." for spec in self.mtp_layers)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "ModelConfig":
        model_type = raw.get("model_type")
        if model_type == "kimi_k3":
            return _parse_k3(raw)
        if model_type == "kimi_linear":
            return _parse_text(raw, family="kimi_linear", prefix="", wrapper=raw)
        raise ConfigError(f"model_type {model_type!r} is not served; expected one of {MODEL_FAMILIES}")


def load_model_config(model_dir: str | Path) -> ModelConfig:
    """Reads `<model_dir>/config.json`."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ConfigError(f"{path} does not exist")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path} is not valid JSON: {exc}") from exc
    return ModelConfig.from_dict(raw)


def _parse_k3(raw: dict) -> ModelConfig:
    text = raw.get("text_config")
    if not isinstance(text, dict):
        raise ConfigError("kimi_k3 config.json needs a `text_config` object")
    config = _parse_text(text, family="kimi_k3", prefix="language_model.", wrapper=raw)
    vision = raw.get("vision_config")
    return replace(config, vision=_parse_vision(vision, config.hidden_size)) if vision else config


def _require(raw: dict, name: str) -> Any:
    if raw.get(name) is None:
        raise ConfigError(f"config.json is missing `{name}`")
    return raw[name]


def _parse_text(text: dict, family: str, prefix: str, wrapper: dict) -> ModelConfig:
    num_layers = int(_require(text, "num_hidden_layers"))
    activation = _parse_activation(text)
    moe = _parse_moe(text)
    residual = "attn_res" if text.get("attn_res_block_size") else "plain"
    mixers = _layer_mixers(text, num_layers)
    layers = tuple(
        LayerSpec(index=i, mixer=mixers[i], ffn=_ffn_kind(text, moe, i), residual=residual, activation=activation.kind)
        for i in range(num_layers)
    )
    mtp_layers = tuple(
        LayerSpec(index=i, mixer="mla", ffn=_ffn_kind(text, moe, i), residual="plain", activation=activation.kind)
        for i in range(num_layers, num_layers + int(text.get("num_nextn_predict_layers") or 0))
    )
    return ModelConfig(
        family=family,
        weight_prefix=prefix,
        vocab_size=int(_require(text, "vocab_size")),
        hidden_size=int(_require(text, "hidden_size")),
        intermediate_size=int(text.get("intermediate_size") or 0),
        num_hidden_layers=num_layers,
        rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(text.get("model_max_length") or text.get("max_position_embeddings") or 1 << 20),
        tie_word_embeddings=bool(text.get("tie_word_embeddings", False)),
        kda=_parse_kda(text) if "kda" in mixers else None,
        mla=_parse_mla(text),
        moe=moe,
        activation=activation,
        attn_res_block_size=text.get("attn_res_block_size") or None,
        layers=layers,
        bos_token_id=_first_id(text.get("bos_token_id", wrapper.get("bos_token_id"))),
        eos_token_id=_first_id(text.get("eos_token_id", wrapper.get("eos_token_id"))),
        pad_token_id=_first_id(text.get("pad_token_id", wrapper.get("pad_token_id"))),
        media_placeholder_token_id=wrapper.get("media_placeholder_token_id"),
        torch_dtype=text.get("torch_dtype") or text.get("dtype") or wrapper.get("torch_dtype") or wrapper.get("dtype"),
        mtp_layers=mtp_layers,
        raw=wrapper,
    )


def _first_id(value: Any) -> int | None:
    if isinstance(value, list):
        return int(value[0]) if value else None
    return None if value is None else int(value)


def _layer_mixers(text: dict, num_layers: int) -> list[str]:
    lac = text.get("linear_attn_config")
    if not lac:
        return ["mla"] * num_layers
    kda_layers = set(_require(lac, "kda_layers"))
    full_layers = set(lac.get("full_attn_layers") or [])
    for name, ids in (("kda_layers", kda_layers), ("full_attn_layers", full_layers)):
        bad = sorted(i for i in ids if not 1 <= i <= num_layers)
        if bad:
            raise ConfigError(f"linear_attn_config.{name} has {bad}: layer numbers are 1-based, 1..{num_layers}")
    both = sorted(kda_layers & full_layers)
    if both:
        raise ConfigError(f"layers {both} are in both kda_layers and full_attn_layers")
    return ["kda" if i + 1 in kda_layers else "mla" for i in range(num_layers)]


def _ffn_kind(text: dict, moe: MoEConfig | None, index: int) -> str:
    if moe is None:
        return "dense"
    first_dense = int(text.get("first_k_dense_replace", 0) or 0)
    freq = int(text.get("moe_layer_freq", 1) or 1)
    return "moe" if index >= first_dense and index % freq == 0 else "dense"


def _parse_activation(text: dict) -> ActivationConfig:
    kind = text.get("hidden_act", "silu")
    if kind == "silu":
        return ActivationConfig("silu")
    if kind == "situ":
        return ActivationConfig(
            "situ",
            situ_beta=float(text.get("activation_situ_beta") or 1.0),
            situ_linear_beta=text.get("activation_situ_linear_beta"),
        )
    raise ConfigError(f"hidden_act {kind!r} is not supported (silu, situ)")


def _parse_kda(text: dict) -> KDAConfig:
    lac = text["linear_attn_config"]
    lower = lac.get("gate_lower_bound")
    return KDAConfig(
        num_heads=int(_require(lac, "num_heads")),
        head_dim=int(_require(lac, "head_dim")),
        conv_kernel_size=int(lac.get("short_conv_kernel_size", 4)),
        gate_lower_bound=None if lower is None else float(lower),
        full_rank_output_gate=bool(lac.get("use_full_rank_gate", False)),
    )


def _parse_mla(text: dict) -> MLAConfig:
    return MLAConfig(
        num_heads=int(_require(text, "num_attention_heads")),
        q_lora_rank=text.get("q_lora_rank"),
        kv_lora_rank=int(_require(text, "kv_lora_rank")),
        qk_nope_head_dim=int(_require(text, "qk_nope_head_dim")),
        qk_rope_head_dim=int(_require(text, "qk_rope_head_dim")),
        v_head_dim=int(_require(text, "v_head_dim")),
        output_gate=bool(text.get("mla_use_output_gate", False)),
    )


def _parse_moe(text: dict) -> MoEConfig | None:
    num_experts = text.get("num_experts") or text.get("num_local_experts")
    if not num_experts:
        return None
    func = text.get("moe_router_activation_func", "sigmoid")
    if func != "sigmoid":
        raise ConfigError(f"moe_router_activation_func {func!r} is not supported (sigmoid)")
    groups = int(text.get("num_expert_group", 1) or 1)
    if num_experts % groups:
        raise ConfigError(f"num_experts {num_experts} is not divisible by num_expert_group {groups}")
    return MoEConfig(
        num_experts=int(num_experts),
        top_k=int(text.get("num_experts_per_token") or text.get("num_experts_per_tok") or 1),
        num_shared_experts=int(text.get("num_shared_experts", 0) or 0),
        intermediate_size=int(_require(text, "moe_intermediate_size")),
        num_expert_group=groups,
        topk_group=int(text.get("topk_group", 1) or 1),
        renormalize=bool(text.get("moe_renormalize", True)),
        routed_scaling_factor=float(text.get("routed_scaling_factor", 1.0)),
        latent_size=text.get("routed_expert_hidden_size"),
        latent_use_norm=bool(text.get("latent_moe_use_norm", False)),
    )


# Official `KimiK3VisionConfig` defaults for the fields a `vision_config` may omit.
_VISION_DEFAULTS = {
    "patch_size": 14, "init_pos_emb_height": 64, "init_pos_emb_width": 64, "init_pos_emb_time": 4,
    "pos_emb_type": "divided_fixed", "vt_num_attention_heads": 12, "vt_num_hidden_layers": 27,
    "vt_hidden_size": 1024, "vt_intermediate_size": 4096, "merge_kernel_size": (2, 2), "merge_type": "sd2_tpool",
    "mm_projector_type": "patchmergerv2", "projector_ln_eps": 1e-5, "qkv_hidden_size": 1536,
    "norm_type": "rmsnorm", "attn_bias": False, "patch_embed_proj_bias": False, "mlp_type": "mlp2",
    "linear_bias": False, "pos_emb_interpolation_mode": "bilinear", "text_hidden_size": 7168,
}
_VISION_CHOICES = {"pos_emb_type": ("divided_fixed",), "merge_type": ("sd2_tpool",), "mlp_type": ("mlp2",),
                   "mm_projector_type": ("patchmergerv2",), "norm_type": ("rmsnorm", "layernorm"),
                   "pos_emb_interpolation_mode": ("bilinear", "bicubic")}


def _parse_vision(raw: dict, text_hidden: int) -> VisionConfig:
    """`vision_config` -> `VisionConfig`. The activations are fixed by the official code (tanh-GELU in the tower,
    exact GELU in the projector) whatever `activation_func` / `projector_hidden_act` say, as there."""
    v = {**_VISION_DEFAULTS, **{k: val for k, val in raw.items() if val is not None}}
    for name, choices in _VISION_CHOICES.items():
        if v[name] not in choices:
            raise ConfigError(f"vision_config.{name} {v[name]!r} is not supported ({', '.join(choices)})")
    hidden = int(v["vt_hidden_size"])
    if int(v.get("mm_hidden_size") or hidden) != hidden:
        raise ConfigError(f"vision_config.mm_hidden_size {v['mm_hidden_size']} must equal vt_hidden_size {hidden}")
    if int(v["text_hidden_size"]) != text_hidden:
        raise ConfigError(f"vision_config.text_hidden_size {v['text_hidden_size']} must equal the text "
                          f"hidden_size {text_hidden}")
    heads, qkv = int(v["vt_num_attention_heads"]), int(v["qkv_hidden_size"])
    if qkv % heads or (qkv // heads) % 4:
        raise ConfigError(f"vision_config.qkv_hidden_size {qkv} must split into {heads} heads of a multiple of 4")
    kernel = v["merge_kernel_size"]
    if not isinstance(kernel, (list, tuple)) or len(kernel) != 2:
        raise ConfigError(f"vision_config.merge_kernel_size {kernel!r} must be [height, width]")
    return VisionConfig(
        patch_size=int(v["patch_size"]), hidden_size=hidden, num_layers=int(v["vt_num_hidden_layers"]),
        num_heads=heads, qkv_hidden_size=qkv, intermediate_size=int(v["vt_intermediate_size"]),
        pos_emb_height=int(v["init_pos_emb_height"]), pos_emb_width=int(v["init_pos_emb_width"]),
        pos_emb_time=int(v["init_pos_emb_time"]), pos_emb_interpolation=v["pos_emb_interpolation_mode"],
        merge_kernel=(int(kernel[0]), int(kernel[1])), norm_type=v["norm_type"], attn_bias=bool(v["attn_bias"]),
        linear_bias=bool(v["linear_bias"]), patch_embed_bias=bool(v["patch_embed_proj_bias"]),
        projector_eps=float(v["projector_ln_eps"]), text_hidden_size=text_hidden,
    )
