"""Checkpoints with a vision tower: K3 presets write a small seeded tower in the released layout (deterministic,
text weights independent of it), `load_vision` reads it back (single file, sharded, dummy, bf16), text-only K3
folders still load, a wrong vision tensor is named, and `vision_config` parsing refuses what the official code
does not build."""

from __future__ import annotations

import copy
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.model.checkpoint import make_checkpoint
from engine.model.config import ConfigError, ModelConfig, load_model_config
from engine.model.init import init_random_weights
from engine.model.loader import CheckpointError, LoadConfig, build_empty_model, checkpoint_layout, load_model
from engine.model.presets import preset_config
from engine.vision.encoder import VISION_PREFIXES
from engine.vision.loader import build_vision, init_vision_weights, load_vision
from tests.unit.vision.conftest import CHECKPOINT_SEED


def _seeded_encoder(config: ModelConfig, seed: int):
    encoder = build_vision(config, torch.float32, "cpu")
    init_vision_weights(encoder, seed=seed)
    return encoder


@pytest.mark.parametrize("preset, low, high", [("tiny-k3", 3_000, 100_000), ("k3-93-pattern", 3_000, 100_000),
                                               ("small-k3", 1_000_000, 20_000_000)])
def test_k3_presets_carry_a_vision_tower(preset, low, high):
    config = ModelConfig.from_dict(preset_config(preset))
    assert config.vision is not None and config.vision.text_hidden_size == config.hidden_size
    with torch.device("meta"):
        count = sum(p.numel() for p in build_vision(config, torch.float32, "meta").parameters())
    assert low <= count <= high


def test_same_seed_same_bytes_and_text_weights_do_not_depend_on_the_tower(tiny_dir, tmp_path):
    again = make_checkpoint("tiny-k3", tmp_path / "again", seed=CHECKPOINT_SEED)
    for name in ("model.safetensors", "preprocessor_config.json", "config.json"):
        assert (again / name).read_bytes() == (tiny_dir / name).read_bytes()
    stored = load_file(str(tiny_dir / "model.safetensors"))
    config = load_model_config(tiny_dir)
    text = build_empty_model(config, torch.float32, "cpu")
    init_random_weights(text, seed=CHECKPOINT_SEED)  # the text model alone, as before the tower existed
    params = dict(text.named_parameters())
    for official, target in checkpoint_layout(text).items():
        want = params[target.param_name] if target.index is None else params[target.param_name][target.index]
        got = stored[official]
        assert torch.equal(got.reshape(-1)[: want.numel()], want.reshape(-1)), official
    for name, value in _seeded_encoder(config, CHECKPOINT_SEED).state_dict().items():
        assert torch.equal(stored[name], value), name


def test_load_vision_reads_the_folder(tiny_dir, encoder):
    want = _seeded_encoder(load_model_config(tiny_dir), CHECKPOINT_SEED).state_dict()
    assert encoder.state_dict().keys() == want.keys()
    assert all(torch.equal(encoder.state_dict()[n], want[n]) for n in want)
    half = load_vision(tiny_dir, LoadConfig(dtype="bfloat16"))
    assert half.dtype == torch.bfloat16
    dummy = load_vision(tiny_dir, LoadConfig(load_format="dummy", seed=CHECKPOINT_SEED))
    assert all(torch.equal(dummy.state_dict()[n], want[n]) for n in want)
    with pytest.raises(ValueError, match="load-format"):
        load_vision(tiny_dir, LoadConfig(load_format="pickle"))


def test_sharded_checkpoint_indexes_the_vision_weights(tmp_path):
    folder = make_checkpoint("tiny-k3", tmp_path / "sharded", seed=1, max_shard_bytes=200_000)
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    assert any(n.startswith("vision_tower.") for n in index) and any(n.startswith("mm_projector.") for n in index)
    assert load_vision(folder) is not None and load_model(folder) is not None


def _copy_folder(src, dst, edit_tensors=None, edit_config=None):
    shutil.copytree(src, dst)
    if edit_tensors:
        tensors = load_file(str(dst / "model.safetensors"))
        edit_tensors(tensors)
        save_file(tensors, str(dst / "model.safetensors"))
    if edit_config:
        raw = json.loads((dst / "config.json").read_text())
        edit_config(raw)
        (dst / "config.json").write_text(json.dumps(raw))
    return dst


def _drop_vision(tensors):
    for name in [n for n in tensors if n.startswith(VISION_PREFIXES)]:
        del tensors[name]


def test_text_only_k3_folders_still_load(tiny_dir, tmp_path):
    no_weights = _copy_folder(tiny_dir, tmp_path / "no-weights", edit_tensors=_drop_vision)
    no_config = _copy_folder(tiny_dir, tmp_path / "no-config", edit_tensors=_drop_vision,
                             edit_config=lambda raw: raw.pop("vision_config"))
    for folder in (no_weights, no_config):
        assert load_vision(folder) is None
        assert load_model(folder).config.family == "kimi_k3"
    assert load_model_config(no_config).vision is None


def test_wrong_vision_tensors_are_named(tiny_dir, tmp_path):
    def edit(tensors):
        tensors["vision_tower.patch_embed.proj.weight"] = torch.zeros(4, 3)
        del tensors["mm_projector.post_norm.weight"]
        tensors["mm_projector.surprise.weight"] = torch.zeros(2)

    bad = _copy_folder(tiny_dir, tmp_path / "bad", edit_tensors=edit)
    with pytest.raises(CheckpointError) as err:
        load_vision(bad)
    message = str(err.value)
    assert "mis-shaped: vision_tower.patch_embed.proj.weight: checkpoint [4, 3], model expects [32, 3, 14, 14]" in message
    assert "missing: mm_projector.post_norm.weight" in message
    assert "unexpected: mm_projector.surprise.weight" in message
    load_model(bad)  # the text model does not read vision tensors


@pytest.mark.parametrize("field, value, match", [
    ("mm_projector_type", "mlp", "mm_projector_type"), ("merge_type", "sd2", "merge_type"),
    ("text_hidden_size", 65, "text_hidden_size"), ("mm_hidden_size", 16, "mm_hidden_size"),
    ("qkv_hidden_size", 30, "qkv_hidden_size"), ("merge_kernel_size", 2, "merge_kernel_size"),
])
def test_unsupported_vision_configs_are_refused(field, value, match):
    raw = copy.deepcopy(preset_config("tiny-k3"))
    raw["vision_config"][field] = value
    with pytest.raises(ConfigError, match=match):
        ModelConfig.from_dict(raw)


def test_omitted_fields_take_the_official_defaults():
    raw = copy.deepcopy(preset_config("tiny-k3"))
    raw["vision_config"] = {"vt_hidden_size": 32, "qkv_hidden_size": 32, "vt_num_attention_heads": 2,
                            "text_hidden_size": 64}
    vision = ModelConfig.from_dict(raw).vision
    assert (vision.patch_size, vision.num_layers, vision.pos_emb_height, vision.merge_kernel) == (14, 27, 64, (2, 2))
    assert (vision.norm_type, vision.attn_bias, vision.pos_emb_interpolation) == ("rmsnorm", False, "bilinear")
