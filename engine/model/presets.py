"""Preset configs for generated checkpoints, written exactly in the released `config.json` layouts.

Contract: `DRAFTER_PRESETS` are `k3_dspark` drafter configs, each matching one K3 target preset.
`preset_config(name)` returns the dict that goes to `config.json` (a `kimi_linear` config, or a `kimi_k3`
wrapper with `text_config` and a `vision_config` with every released field: a small MoonViT3d tower whose
learnable position grid is smaller than most images' patch grids, so interpolation is exercised). Token ids follow the released offsets from the tokenizer's base
vocabulary: bos = base+0, eos/end-of-message = base+2, media placeholder = base+21, pad = base+255.
"""

from __future__ import annotations

import copy

NUM_BASE_TOKENS = 7936  # generated tokenizer ranks; + 256 specials = vocab 8192
VOCAB_SIZE = NUM_BASE_TOKENS + 256
BOS_ID, EOS_ID = NUM_BASE_TOKENS, NUM_BASE_TOKENS + 2
MEDIA_ID, PAD_ID = NUM_BASE_TOKENS + 21, NUM_BASE_TOKENS + 255


def _kimi_linear(hidden: int, layers: int, mla_layers: list[int], kda_heads: int, kda_head_dim: int,
                 mla_heads: int, kv_lora: int, nope: int, rope: int, v_dim: int, experts: int, top_k: int,
                 shared: int, moe_inter: int, inter: int, groups: int = 1, topk_group: int = 1) -> dict:
    """A `kimi_linear` config.json with the released field names; `mla_layers` are 1-based."""
    kda_layers = [i for i in range(1, layers + 1) if i not in mla_layers]
    return {
        "architectures": ["KimiLinearForCausalLM"],
        "model_type": "kimi_linear",
        "dtype": "float32",
        "vocab_size": VOCAB_SIZE,
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": mla_heads,
        "num_key_value_heads": mla_heads,
        "head_dim": kv_lora + rope,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "initializer_range": 0.02,
        "model_max_length": 1048576,
        "tie_word_embeddings": False,
        "use_cache": True,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": PAD_ID,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "q_lora_rank": None,
        "kv_lora_rank": kv_lora,
        "qk_nope_head_dim": nope,
        "qk_rope_head_dim": rope,
        "v_head_dim": v_dim,
        "mla_use_nope": True,
        "num_experts": experts,
        "num_experts_per_token": top_k,
        "num_shared_experts": shared,
        "moe_intermediate_size": moe_inter,
        "moe_renormalize": True,
        "moe_router_activation_func": "sigmoid",
        "routed_scaling_factor": 2.446,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "use_grouped_topk": True,
        "num_expert_group": groups,
        "topk_group": topk_group,
        "num_nextn_predict_layers": 0,
        "linear_attn_config": {
            "full_attn_layers": mla_layers,
            "kda_layers": kda_layers,
            "num_heads": kda_heads,
            "head_dim": kda_head_dim,
            "short_conv_kernel_size": 4,
        },
    }


def _vision(text_hidden: int, hidden: int, layers: int, heads: int, inter: int, pos_grid: int) -> dict:
    """A `vision_config` with every field of the released layout (MoonViT3d + patchmergerv2), at test width."""
    return {
        "patch_size": 14, "init_pos_emb_height": pos_grid, "init_pos_emb_width": pos_grid, "init_pos_emb_time": 4,
        "pos_emb_type": "divided_fixed", "pos_emb_interpolation_mode": "bilinear",
        "vt_hidden_size": hidden, "vt_num_hidden_layers": layers, "vt_num_attention_heads": heads,
        "vt_intermediate_size": inter, "qkv_hidden_size": hidden, "norm_type": "rmsnorm", "attn_bias": False,
        "linear_bias": False, "patch_embed_proj_bias": False, "mlp_type": "mlp2",
        "activation_func": "gelu_pytorch_tanh", "merge_kernel_size": [2, 2], "merge_type": "sd2_tpool",
        "mm_projector_type": "patchmergerv2", "mm_hidden_size": hidden, "projector_hidden_act": "gelu",
        "projector_ln_eps": 1e-5, "text_hidden_size": text_hidden, "media_placeholder_token_id": MEDIA_ID,
        "pad_token_id": PAD_ID,
    }


def _kimi_k3(text: dict, q_lora: int, latent: int, block_size: int, vision: dict, mtp_layers: int = 0) -> dict:
    """Wraps a text config in the released `kimi_k3` layout with the K3 forms switched on (`mtp_layers`: the
    `num_nextn_predict_layers` the checkpoint carries)."""
    text = copy.deepcopy(text)
    text.update({
        "num_nextn_predict_layers": mtp_layers,
        "hidden_act": "situ",
        "activation_situ_beta": 4.0,
        "activation_situ_linear_beta": 25.0,
        "q_lora_rank": q_lora,
        "mla_use_output_gate": True,
        "attn_res_block_size": block_size,
        "routed_expert_hidden_size": latent,
        "latent_moe_use_norm": True,
        "topk_method": "noaux_tc",
    })
    text.pop("architectures", None)
    text["linear_attn_config"].update({"gate_lower_bound": -5.0, "use_full_rank_gate": True})
    return {
        "architectures": ["KimiK3ForConditionalGeneration"],
        "model_type": "kimi_k3",
        "dtype": "float32",
        "media_placeholder_token_id": MEDIA_ID,
        "pad_token_id": PAD_ID,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "text_config": text,
        "vision_config": vision,
    }


def _tiny_linear() -> dict:
    return _kimi_linear(hidden=64, layers=4, mla_layers=[4], kda_heads=2, kda_head_dim=32, mla_heads=2,
                        kv_lora=32, nope=16, rope=8, v_dim=16, experts=8, top_k=2, shared=1, moe_inter=32,
                        inter=128, groups=4, topk_group=2)


def _small_linear() -> dict:
    return _kimi_linear(hidden=768, layers=8, mla_layers=[4, 8], kda_heads=6, kda_head_dim=128, mla_heads=12,
                        kv_lora=256, nope=64, rope=32, v_dim=64, experts=32, top_k=4, shared=1, moe_inter=128,
                        inter=2048)


def _linear_48b_pattern() -> dict:
    """The released Kimi-Linear-48B layer pattern (27 layers, MLA at 4, 8, …, 24, 27) at test width."""
    return _kimi_linear(hidden=32, layers=27, mla_layers=[4, 8, 12, 16, 20, 24, 27], kda_heads=2, kda_head_dim=16,
                        mla_heads=2, kv_lora=16, nope=8, rope=8, v_dim=8, experts=4, top_k=2, shared=1,
                        moe_inter=16, inter=64)


def _tiny_k3() -> dict:
    return _kimi_k3(_kimi_linear(hidden=64, layers=4, mla_layers=[4], kda_heads=2, kda_head_dim=32, mla_heads=2,
                                 kv_lora=32, nope=16, rope=8, v_dim=16, experts=8, top_k=2, shared=1, moe_inter=32,
                                 inter=128, groups=4, topk_group=2),
                    q_lora=32, latent=32, block_size=2,
                    vision=_vision(64, hidden=32, layers=2, heads=2, inter=64, pos_grid=16), mtp_layers=1)


def _small_k3() -> dict:
    return _kimi_k3(_kimi_linear(hidden=768, layers=8, mla_layers=[4, 8], kda_heads=6, kda_head_dim=128,
                                 mla_heads=12, kv_lora=256, nope=64, rope=32, v_dim=64, experts=32, top_k=4,
                                 shared=2, moe_inter=256, inter=2048),
                    q_lora=384, latent=384, block_size=4,
                    vision=_vision(768, hidden=256, layers=4, heads=4, inter=1024, pos_grid=64), mtp_layers=1)


def _k3_93_pattern() -> dict:
    """The released K3 layer pattern (93 layers, MLA at 0-based 3, 7, …, 91 and 92; blocks of 12) at test width."""
    mla_one_based = [i + 1 for i in range(3, 92, 4)] + [93]
    return _kimi_k3(_kimi_linear(hidden=32, layers=93, mla_layers=mla_one_based, kda_heads=2, kda_head_dim=16,
                                 mla_heads=2, kv_lora=16, nope=8, rope=8, v_dim=8, experts=4, top_k=2, shared=2,
                                 moe_inter=32, inter=64),
                    q_lora=16, latent=32, block_size=12,
                    vision=_vision(32, hidden=32, layers=2, heads=2, inter=64, pos_grid=16))


def demo_k3_config(tiny: bool = False) -> dict:
    """The architecture of the trained `demo-k3` (trainer/): KDA:MLA 3:1, attention residuals in blocks of 2 layers,
    SiTU, gated Q-LoRA MLA, latent MoE (8 experts, top-2, one shared), a one-layer vision tower (untrained: the demo
    is text-only, the tower is there because the K3 format has one); bf16 weights. `tiny` is the suite's
    end-to-end training test (the same forms, 4 layers at width 64)."""
    if tiny:
        text = _kimi_linear(hidden=64, layers=4, mla_layers=[4], kda_heads=2, kda_head_dim=32, mla_heads=2,
                            kv_lora=32, nope=16, rope=8, v_dim=16, experts=4, top_k=2, shared=1, moe_inter=32,
                            inter=128)
        raw = _kimi_k3(text, q_lora=32, latent=32, block_size=2,
                       vision=_vision(64, hidden=32, layers=1, heads=2, inter=64, pos_grid=16))
    else:
        text = _kimi_linear(hidden=256, layers=8, mla_layers=[4, 8], kda_heads=4, kda_head_dim=64, mla_heads=4,
                            kv_lora=128, nope=32, rope=16, v_dim=64, experts=8, top_k=2, shared=1, moe_inter=256,
                            inter=768)
        raw = _kimi_k3(text, q_lora=128, latent=128, block_size=2,
                       vision=_vision(256, hidden=32, layers=1, heads=2, inter=64, pos_grid=16))
    raw["dtype"] = raw["text_config"]["dtype"] = "bfloat16"
    return raw


PRESETS = {
    "tiny-linear": _tiny_linear,
    "small-linear": _small_linear,
    "linear-48b-pattern": _linear_48b_pattern,
    "tiny-k3": _tiny_k3,
    "small-k3": _small_k3,
    "k3-93-pattern": _k3_93_pattern,
}


MASK_ID = NUM_BASE_TOKENS + 254  # a reserved special token: DSpark's mask (noise) token


def _k3_dspark(target: str, layers: int, heads: int, q_lora: int, kv_lora: int, nope: int, rope: int, v_dim: int,
               inter: int, markov_rank: int, block_size: int, target_layer_ids: list[int],
               rope_parameters: dict) -> dict:
    """A `k3_dspark` drafter config.json (vLLM's K3DSparkConfig fields) matching the target preset `target`."""
    return _k3_dspark_for(preset_config(target)["text_config"], layers, heads, q_lora, kv_lora, nope, rope, v_dim,
                          inter, markov_rank, block_size, target_layer_ids, rope_parameters)


def _k3_dspark_for(text: dict, layers: int, heads: int, q_lora: int, kv_lora: int, nope: int, rope: int,
                   v_dim: int, inter: int, markov_rank: int, block_size: int, target_layer_ids: list[int],
                   rope_parameters: dict) -> dict:
    """`_k3_dspark` for a target given by its text config."""
    return {
        "architectures": ["K3DSparkModel"], "model_type": "k3_dspark", "torch_dtype": "float32",
        "hidden_size": text["hidden_size"], "intermediate_size": inter, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": heads, "q_lora_rank": q_lora, "kv_lora_rank": kv_lora,
        "qk_nope_head_dim": nope, "qk_rope_head_dim": rope, "v_head_dim": v_dim, "hidden_act": "silu",
        "rms_norm_eps": text["rms_norm_eps"], "vocab_size": text["vocab_size"], "max_position_embeddings": 1048576,
        "rope_theta": rope_parameters["rope_theta"], "rope_parameters": rope_parameters,
        "mla_use_nope": False, "mla_use_output_gate": False, "mla_use_qk_norm": False, "tie_word_embeddings": False,
        "target_hidden_size": text["hidden_size"], "target_layer_ids": target_layer_ids,
        "num_target_layers": len(target_layer_ids), "markov_rank": markov_rank, "mask_token_id": MASK_ID,
        "block_size": block_size, "sample_from_anchor": True, "bos_token_id": BOS_ID, "eos_token_id": EOS_ID,
    }


def _tiny_k3_dspark() -> dict:
    yarn = {"rope_type": "yarn", "rope_theta": 50000.0, "factor": 4.0, "original_max_position_embeddings": 256,
            "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
    return _k3_dspark("tiny-k3", layers=2, heads=2, q_lora=32, kv_lora=32, nope=16, rope=8, v_dim=16, inter=128,
                      markov_rank=16, block_size=4, target_layer_ids=[0, 1, 3], rope_parameters=yarn)


def _small_k3_dspark() -> dict:
    return _k3_dspark("small-k3", layers=2, heads=12, q_lora=384, kv_lora=256, nope=64, rope=32, v_dim=64,
                      inter=2048, markov_rank=64, block_size=8, target_layer_ids=[1, 4, 7],
                      rope_parameters={"rope_type": "default", "rope_theta": 50000.0})


def demo_k3_dspark_config(tiny: bool = False) -> dict:
    """The DSpark drafter distilled for `demo_k3_config(tiny)` (trainer/distill.py): one layer, blocks of 4, taps on
    the first, middle and last decoder layers."""
    text = demo_k3_config(tiny)["text_config"]
    taps = [0, text["num_hidden_layers"] // 2, text["num_hidden_layers"] - 1]
    rope = {"rope_type": "default", "rope_theta": 50000.0}
    if tiny:
        return _k3_dspark_for(text, layers=1, heads=2, q_lora=32, kv_lora=32, nope=16, rope=8, v_dim=16, inter=64,
                              markov_rank=8, block_size=4, target_layer_ids=taps, rope_parameters=rope)
    return _k3_dspark_for(text, layers=1, heads=4, q_lora=128, kv_lora=128, nope=32, rope=16, v_dim=64, inter=512,
                          markov_rank=32, block_size=4, target_layer_ids=taps, rope_parameters=rope)


# Drafter presets: name -> (the target preset it matches, its config). `make-checkpoint` writes these as drafter
# folders (engine/spec/dspark.py), not as servable models.
DRAFTER_PRESETS = {
    "tiny-k3-dspark": ("tiny-k3", _tiny_k3_dspark),
    "small-k3-dspark": ("small-k3", _small_k3_dspark),
}


def preset_config(name: str) -> dict:
    if name not in PRESETS:
        raise KeyError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    return PRESETS[name]()


def preset_family(name: str) -> str:
    return preset_config(name)["model_type"]
