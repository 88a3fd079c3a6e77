"""`kdamesh make-checkpoint`: random, seeded checkpoints in the official folder layouts.

Contract: a drafter preset (`DRAFTER_PRESETS`, e.g. `tiny-k3-dspark`) writes a `k3_dspark` drafter folder
(engine/spec/dspark.py) matching its target preset; any other `make_checkpoint(preset, out_dir)` writes `config.json` (released layout), `generation_config.json`
(stopping on the end-of-message token), `*.safetensors` under the official names (sharded with an index above
`max_shard_bytes`), and the tokenizer (`tiktoken.model` + `tokenizer_config.json` in Moonshot's format, plus
`tokenizer.json` and our `tokenization_kimi.py`, so `transformers.AutoTokenizer.from_pretrained` loads it with or
without `trust_remote_code` — see `engine.tokenizer_build` — and the family's `chat_template.jinja`). The same
preset and seed give the same bytes. K3 presets can write routed experts as MXFP4 (`experts_format="mxfp4"`), as released.
K3 presets also write their vision tower and projector (`vision_tower.*`, `mm_projector.*`, seeded from their own
generator, so the text weights of a seed do not depend on the tower) and `preprocessor_config.json`
(`media_proc_cfg` in the released form, see `engine.vision.processor`).
K3 presets with `num_nextn_predict_layers` also write their MTP layers (`model.layers.{N + i}.*`, engine/spec/mtp_model.py),
seeded per tensor name, so the target's weights of a seed do not depend on them either.
`text_overrides` replaces fields of the (text) config, for variants of a preset (e.g. a wider expert intermediate).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from engine.model.config import ModelConfig
from engine.model.init import init_random_weights
from engine.model.loader import DTYPES, build_empty_model, save_weights
from engine.model.mxfp4 import dequantize_mxfp4, quantize_mxfp4
from engine.model.presets import DRAFTER_PRESETS, EOS_ID, NUM_BASE_TOKENS, preset_config

logger = logging.getLogger(__name__)

EXPERT_FORMATS = ("dense", "mxfp4")


def make_checkpoint(preset: str, out_dir: str | Path, seed: int = 0, dtype: str = "float32",
                    max_shard_bytes: int = 2 << 30, experts_format: str = "dense",
                    text_overrides: dict | None = None) -> Path:
    if experts_format not in EXPERT_FORMATS:
        raise ValueError(f"experts_format {experts_format!r}: expected one of {EXPERT_FORMATS}")
    if preset in DRAFTER_PRESETS:
        return _make_drafter(preset, out_dir, seed, dtype)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    raw = preset_config(preset)
    raw.get("text_config", raw).update(text_overrides or {})
    if experts_format == "mxfp4":
        _declare_mxfp4(raw)
    config = ModelConfig.from_dict(raw)
    model = build_empty_model(config, torch.float32, "cpu")
    init_random_weights(model, seed=seed)
    if experts_format == "mxfp4":
        _round_experts_to_mxfp4(model)
    mtp = _mtp_weights(config, seed, DTYPES[dtype], experts_format == "mxfp4")
    vision_params = write_checkpoint(model, raw, out, DTYPES[dtype], seed=seed, max_shard_bytes=max_shard_bytes,
                                     experts_mxfp4=experts_format == "mxfp4", extra_tensors=mtp)
    logger.info("wrote %s checkpoint (%s parameters, %s of them vision) to %s", preset,
                f"{count_parameters(model) + vision_params:,}", f"{vision_params:,}", out)
    return out


def write_checkpoint(model: torch.nn.Module, raw: dict, out: Path, dtype: torch.dtype, seed: int = 0,
                     max_shard_bytes: int = 2 << 30, experts_mxfp4: bool = False,
                     tiktoken_path: Path | None = None, extra_tensors: dict[str, torch.Tensor] | None = None) -> int:
    """Writes `model` (a whole `KimiForCausalLM` of config `raw`) as a checkpoint folder in the official layout:
    config.json, generation_config.json, the weights (plus `extra_tensors` under their official names, e.g. MTP
    layers), the seeded vision tower of a K3 config and the tokenizer (`tiktoken_path`: its vocabulary, default the
    shipped small one). Returns the vision tower's parameter count."""
    config = ModelConfig.from_dict(raw)
    (out / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps(_generation_config(raw), indent=2) + "\n")
    vision = _vision_weights(config, seed, dtype, out)
    save_weights(model, out, dtype=dtype, max_shard_bytes=max_shard_bytes, experts_mxfp4=experts_mxfp4,
                 extra_tensors=(extra_tensors or {}) | vision)
    _write_tokenizer(out, config.family, tiktoken_path)
    return sum(t.numel() for t in vision.values())


def _vision_weights(config: ModelConfig, seed: int, dtype: torch.dtype, out: Path) -> dict[str, torch.Tensor]:
    """The seeded vision encoder's tensors (none for a text-only config); writes preprocessor_config.json."""
    if config.vision is None:
        return {}
    from engine.vision.loader import build_vision, init_vision_weights, vision_tensors
    from engine.vision.processor import PROCESSOR_FILE, ProcessorConfig

    encoder = build_vision(config, torch.float32, "cpu")
    init_vision_weights(encoder, seed=seed)
    media = ProcessorConfig(patch_size=config.vision.patch_size, merge_kernel_size=config.vision.merge_kernel[0])
    (out / PROCESSOR_FILE).write_text(json.dumps({"media_proc_cfg": media.media_proc_cfg()}, indent=2) + "\n")
    return vision_tensors(encoder, dtype)


def _make_drafter(preset: str, out_dir: str | Path, seed: int, dtype: str) -> Path:
    from engine.spec.dspark import write_dspark_checkpoint

    target, config = DRAFTER_PRESETS[preset]
    out = write_dspark_checkpoint(config(), out_dir, seed=seed, dtype=DTYPES[dtype])
    logger.info("wrote %s drafter checkpoint (for the %s target) to %s", preset, target, out)
    return out


def _mtp_weights(config: ModelConfig, seed: int, dtype: torch.dtype, mxfp4: bool) -> dict[str, torch.Tensor]:
    from engine.spec.mtp_model import mtp_tensors

    return mtp_tensors(config, seed, dtype, experts_mxfp4=mxfp4, round_experts=_round_experts_to_mxfp4 if mxfp4 else None)


def count_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def _generation_config(raw: dict) -> dict:
    from engine.tokenizer_build import stop_token_ids

    stops = stop_token_ids(raw["model_type"], NUM_BASE_TOKENS)  # end-of-message / im_end first, then [EOS]
    assert stops[0] == EOS_ID, "config eos and the tokenizer's end-of-message token must agree"
    return {"bos_token_id": raw.get("bos_token_id"), "eos_token_id": list(stops),
            "pad_token_id": raw.get("pad_token_id"), "do_sample": False, "_from_model_config": True}


def _declare_mxfp4(raw: dict) -> None:
    text = raw.get("text_config", raw)
    text["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "format": "mxfp4-pack-quantized",
        "config_groups": {"group_0": {"format": "mxfp4-pack-quantized", "targets": [r"re:.*experts\.\d+\.w[123]$"],
                                      "weights": {"num_bits": 4, "type": "float", "group_size": 32,
                                                  "strategy": "group", "scale_dtype": "uint8"}}},
        "ignore": ["lm_head"],
    }


def _round_experts_to_mxfp4(model: torch.nn.Module) -> None:
    """Replaces expert weights by their MXFP4 values so the written checkpoint is exactly what the model holds."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".experts.w" in name:
                for e in range(param.shape[0]):
                    param.data[e] = dequantize_mxfp4(*quantize_mxfp4(param.data[e]))


def _write_tokenizer(out: Path, family: str, tiktoken_path: Path | None = None) -> None:
    from engine.tokenizer_build import SMALL_TIKTOKEN_PATH, write_tokenizer

    write_tokenizer(out, family, tiktoken_path or SMALL_TIKTOKEN_PATH)  # with the family's chat_template.jinja
