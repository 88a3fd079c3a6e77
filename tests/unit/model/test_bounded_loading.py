"""Bounded loading: the memory a load adds peaks at the final weights + one file (round) + the largest parameter (on
CPU the loader re-lays weights out input-major for one-row products, engine/model/fused.py, one copy at a time) + a
stated slack, for the
safetensors path and fastsafetensors' rounds, measured in a subprocess on a checkpoint of several files; the loaded
weights equal the seeded model that wrote the checkpoint (cast to the serving dtype).

Negative control: fastsafetensors with every file in one round (what the loader did before rounds: all of a rank's
file buffers next to the weights) breaks the same bound, so the measurement sees what it is meant to see."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.model.checkpoint import make_checkpoint
from engine.model.config import ModelConfig
from engine.model.init import init_random_weights
from engine.model.loader import LoadConfig, build_empty_model, checkpoint_files, load_model
from engine.model.presets import preset_config

ROOT = Path(__file__).resolve().parents[3]
OVERRIDES = {"hidden_size": 128, "num_experts": 32, "moe_intermediate_size": 1024}  # ~150 MB of fp32 experts
SHARD_BYTES = 8 << 20
# allocator arenas, per-tensor temporaries: measured 22 MB over weights + file + parameter on an idle AVX2 machine,
# 39 MB once in a loaded clean-clone CI run there (24 MB held on the earlier AVX-512 machine); the negative
# control below still exceeds the bound by ~85 MB
SLACK_BYTES = 48 << 20
# fastsafetensors' reader: a fixed cost whatever the checkpoint (its 16 MiB bounce buffer, I/O threads' arenas);
# measured +43..51 MB over the safetensors path with 8 MB and 32 MB shards alike
READER_BYTES = {"safetensors": 0, "fastsafetensors": 48 << 20}


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    return make_checkpoint("tiny-linear", tmp_path_factory.mktemp("ckpt") / "wide", seed=3,
                           max_shard_bytes=SHARD_BYTES, text_overrides=OVERRIDES)


def _measure(model_dir: Path, load_format: str, files_per_rank: int = 1) -> dict:
    env = os.environ | {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-m", "tests.unit.model.load_memory", str(model_dir), load_format,
                          str(files_per_rank)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _bound(model_dir: Path, got: dict, load_format: str) -> int:
    largest_file = max(f.stat().st_size for f in checkpoint_files(model_dir))
    return got["weights"] + largest_file + got["largest_parameter"] + SLACK_BYTES + READER_BYTES[load_format]


@pytest.mark.parametrize("load_format", ["safetensors", "fastsafetensors"])
def test_peak_memory_is_weights_plus_one_file(sharded, load_format):
    if load_format == "fastsafetensors":
        pytest.importorskip("fastsafetensors")
    files = checkpoint_files(sharded)
    assert len(files) >= 8
    got = _measure(sharded, load_format)
    total_files = sum(f.stat().st_size for f in files)
    assert got["weights"] > 70 << 20 and total_files > 2 * got["weights"] - (8 << 20)  # bf16 from fp32 files
    assert got["peak_added"] <= _bound(sharded, got, load_format), got
    assert got["peak_added"] >= got["weights"] * 0.9  # the measurement sees the weights themselves


def test_all_files_in_one_round_breaks_the_bound(sharded):
    pytest.importorskip("fastsafetensors")
    files = checkpoint_files(sharded)
    got = _measure(sharded, "fastsafetensors", files_per_rank=len(files))
    assert got["peak_added"] > _bound(sharded, got, "fastsafetensors"), got


@pytest.mark.parametrize("load_format", ["safetensors", "fastsafetensors"])
def test_bounded_loading_keeps_the_weights(sharded, load_format):
    if load_format == "fastsafetensors":
        pytest.importorskip("fastsafetensors")
    raw = preset_config("tiny-linear")
    raw.update(OVERRIDES)
    reference = build_empty_model(ModelConfig.from_dict(raw), torch.float32, "cpu")
    init_random_weights(reference, seed=3)
    expected = dict(reference.named_parameters())
    for dtype in ("float32", "bfloat16"):
        model = load_model(sharded, LoadConfig(load_format=load_format, dtype=dtype))
        for name, param in model.named_parameters():
            assert torch.equal(param, expected[name].to(param.dtype)), (dtype, name)


def test_build_never_allocates_fp32_copies():
    raw = preset_config("tiny-linear")
    model = build_empty_model(ModelConfig.from_dict(raw), torch.bfloat16, "meta")
    dtypes = {p.dtype for n, p in model.named_parameters() if not n.endswith(("A_log", "dt_bias", "conv1d.weight",
                                                                             "gate.weight", "correction_bias"))}
    assert dtypes == {torch.bfloat16}
