"""Loader: official names in, named errors out, sharded/dummy/dtype/MXFP4 variants."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.model.checkpoint import make_checkpoint
from engine.model.config import ConfigError, ModelConfig, load_model_config
from engine.model.loader import CheckpointError, LoadConfig, load_model
from engine.model.mxfp4 import MXFP4Error, dequantize_mxfp4, quantize_mxfp4
from engine.model.presets import preset_config


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_checkpoint("tiny-linear", tmp_path_factory.mktemp("ckpt") / "tiny-linear", seed=0)


def _rewrite(src_dir, dst_dir, edit):
    """Copies a single-file checkpoint, applying `edit(tensors)` to its weights."""
    dst_dir.mkdir()
    for f in src_dir.iterdir():
        if f.suffix != ".safetensors":
            (dst_dir / f.name).write_bytes(f.read_bytes())
    tensors = load_file(str(src_dir / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst_dir / "model.safetensors"))
    return dst_dir


def test_layer_lists_are_one_based():
    config = ModelConfig.from_dict(preset_config("linear-48b-pattern"))
    assert config.mla_layer_ids == [3, 7, 11, 15, 19, 23, 26]
    assert [s.ffn for s in config.layers[:2]] == ["dense", "moe"]
    k3 = ModelConfig.from_dict(preset_config("k3-93-pattern"))
    assert k3.mla_layer_ids == list(range(3, 92, 4)) + [92]
    assert k3.weight_prefix == "language_model." and k3.activation.kind == "situ"


def test_bad_config_names_the_field():
    raw = preset_config("tiny-linear")
    raw["linear_attn_config"]["kda_layers"] = [0, 1, 2]
    with pytest.raises(ConfigError, match="1-based"):
        ModelConfig.from_dict(raw)
    with pytest.raises(ConfigError, match="model_type"):
        ModelConfig.from_dict({"model_type": "llama"})


def test_missing_tensor_is_named(tiny_dir, tmp_path):
    name = "model.layers.1.self_attn.k_proj.weight"
    bad = _rewrite(tiny_dir, tmp_path / "bad", lambda t: t.pop(name))
    with pytest.raises(CheckpointError, match="missing") as err:
        load_model(bad)
    assert name in str(err.value)


def test_extra_tensor_is_named(tiny_dir, tmp_path):
    name = "model.layers.0.self_attn.surprise.weight"
    bad = _rewrite(tiny_dir, tmp_path / "bad", lambda t: t.__setitem__(name, torch.zeros(2)))
    with pytest.raises(CheckpointError, match="unexpected") as err:
        load_model(bad)
    assert name in str(err.value)


def test_misshaped_tensor_is_named(tiny_dir, tmp_path):
    name = "model.layers.3.self_attn.kv_b_proj.weight"
    bad = _rewrite(tiny_dir, tmp_path / "bad", lambda t: t.__setitem__(name, torch.zeros(3, 3)))
    with pytest.raises(CheckpointError, match="mis-shaped") as err:
        load_model(bad)
    assert name in str(err.value) and "[3, 3]" in str(err.value)


def test_all_problems_reported_at_once(tiny_dir, tmp_path):
    def edit(t):
        t.pop("lm_head.weight")
        t["model.extra"] = torch.zeros(1)
        t["model.layers.2.block_sparse_moe.experts.3.w2.weight"] = torch.zeros(1, 1)
    bad = _rewrite(tiny_dir, tmp_path / "bad", edit)
    with pytest.raises(CheckpointError) as err:
        load_model(bad)
    text = str(err.value)
    assert "lm_head.weight" in text and "model.extra" in text and "experts.3.w2.weight" in text


def test_sharded_index_loads_identically(tiny_dir, tmp_path):
    sharded = make_checkpoint("tiny-linear", tmp_path / "sharded", seed=0, max_shard_bytes=200_000)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    a, b = load_model(tiny_dir), load_model(sharded)
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(pa, pb), name


def test_generation_is_deterministic(tiny_dir, tmp_path):
    again = make_checkpoint("tiny-linear", tmp_path / "again", seed=0)
    assert (again / "model.safetensors").read_bytes() == (tiny_dir / "model.safetensors").read_bytes()


def test_dummy_format_reads_no_weights(tiny_dir, tmp_path):
    only_config = tmp_path / "cfg"
    only_config.mkdir()
    (only_config / "config.json").write_text((tiny_dir / "config.json").read_text())
    model = load_model(only_config, LoadConfig(load_format="dummy", seed=7))
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_fastsafetensors_falls_back(tiny_dir, caplog, monkeypatch):
    """Without the package (hidden here when installed), one warning and a safetensors load."""
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "fastsafetensors" else real_find_spec(name, *a))
    with caplog.at_level(logging.WARNING):
        model = load_model(tiny_dir, LoadConfig(load_format="fastsafetensors"))
    assert "safetensors" in caplog.text
    reference = load_model(tiny_dir)
    assert torch.equal(model.lm_head.weight, reference.lm_head.weight)


def test_fastsafetensors_loads_through_the_package(tiny_dir, caplog):
    """With the package installed (its CPU `nogds` path here), every parameter equals the safetensors load."""
    pytest.importorskip("fastsafetensors")
    with caplog.at_level(logging.INFO, logger="engine.model.loader"):
        model = load_model(tiny_dir, LoadConfig(load_format="fastsafetensors"))
    assert "through fastsafetensors" in caplog.text and "instead" not in caplog.text
    reference = dict(load_model(tiny_dir).named_parameters())
    for name, param in model.named_parameters():
        assert torch.equal(param, reference[name]), name


def test_dtype_bfloat16_keeps_fp32_params(tiny_dir):
    model = load_model(tiny_dir, LoadConfig(dtype="bfloat16"))
    params = dict(model.named_parameters())
    assert params["lm_head.weight"].dtype == torch.bfloat16
    assert params["model.layers.0.self_attn.A_log"].dtype == torch.float32
    assert params["model.layers.1.block_sparse_moe.gate.weight"].dtype == torch.float32


def test_unknown_load_format_and_dtype(tiny_dir):
    with pytest.raises(ValueError, match="load-format"):
        load_model(tiny_dir, LoadConfig(load_format="pickle"))
    with pytest.raises(ValueError, match="dtype"):
        load_model(tiny_dir, LoadConfig(dtype="int8"))


def test_k3_set_aside_vision_and_mxfp4_experts(tmp_path, caplog):
    dense = make_checkpoint("tiny-k3", tmp_path / "dense", seed=2)
    mx = make_checkpoint("tiny-k3", tmp_path / "mx", seed=2, experts_format="mxfp4")
    assert load_model_config(mx).family == "kimi_k3"
    names = load_file(str(mx / "model.safetensors")).keys()
    assert "language_model.model.layers.1.block_sparse_moe.experts.0.w1.weight_packed" in names
    with_vision = _rewrite(mx, tmp_path / "vision",
                           lambda t: t.update({"vision_tower.patch_embed.proj.weight": torch.zeros(4, 3),
                                               "mm_projector.proj.0.weight": torch.zeros(2, 2)}))
    with caplog.at_level(logging.INFO):
        model = load_model(with_vision, LoadConfig(experts_format="dense"))  # dequantised on load
    assert "set aside 18 vision tensors" in caplog.text  # tiny-k3's tower (18 tensors; the edit replaced two)
    # The MXFP4 checkpoint holds the dense model's experts rounded to MXFP4, exactly.
    dense_model = load_model(dense)
    w = dict(dense_model.named_parameters())["model.layers.1.block_sparse_moe.experts.w1"][0]
    got = dict(model.named_parameters())["model.layers.1.block_sparse_moe.experts.w1"][0]
    assert torch.equal(got, dequantize_mxfp4(*quantize_mxfp4(w)))


def test_mxfp4_round_trip_and_layout():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(8, 64, generator=gen)
    packed, scale = quantize_mxfp4(w)
    assert packed.shape == (8, 32) and scale.shape == (8, 2) and packed.dtype == torch.uint8
    deq = dequantize_mxfp4(packed, scale)
    assert torch.equal(dequantize_mxfp4(*quantize_mxfp4(deq)), deq)  # exact on representable values
    assert float((deq - w).abs().max()) <= float(w.abs().max()) * 0.25  # e2m1: coarse but bounded
    # low nibble first: column 0 is the low nibble of byte 0
    one = torch.zeros(1, 32)
    one[0, 0], one[0, 1] = 1.0, -6.0
    p, s = quantize_mxfp4(one)
    assert int(p[0, 0]) & 0x0F == 0b0010  # +1.0: index 2, sign clear
    assert dequantize_mxfp4(p, s)[0, :2].tolist() == [1.0, -6.0]
    assert int(p[0, 0]) >> 4 == 0b1111  # -6: sign bit + index 7


def test_mxfp4_wrong_scale_shape_is_clear(tmp_path):
    packed, scale = quantize_mxfp4(torch.randn(4, 64))
    with pytest.raises(MXFP4Error, match="weight_scale"):
        dequantize_mxfp4(packed, scale[:, :1])


def test_mxfp4_misshaped_scale_in_checkpoint_is_named(tmp_path):
    mx = make_checkpoint("tiny-k3", tmp_path / "mx", seed=2, experts_format="mxfp4")
    name = "language_model.model.layers.2.block_sparse_moe.experts.1.w3.weight_scale"
    bad = _rewrite(mx, tmp_path / "bad", lambda t: t.__setitem__(name, torch.zeros(3, dtype=torch.uint8)))
    with pytest.raises(CheckpointError, match="weight_scale") as err:
        load_model(bad)
    assert name in str(err.value)
