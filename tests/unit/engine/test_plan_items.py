"""`kdamesh plan`'s new per-rank items equal what the engine builds for the presets: the MTP drafter's weights
(`build_mtp_layers`), a DSpark folder's weights (`load_dspark`) and context rows, the vision tower
(`build_vision`), the speculative scratch slots (`plan_cache`'s 1 + k slots per request); pipeline stages
partition the weights, latents and state exactly; the totals and the refusals reach the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from deploy.plan_cli import drafter_bytes, main, vision_bytes
from engine.config import EngineArgs, plan_cache
from engine.model.checkpoint import make_checkpoint
from engine.model.config import ModelConfig, load_model_config
from engine.model.loader import LoadConfig, load_model
from engine.model.presets import preset_config
from engine.plan import (PlanArgs, kv_bytes_per_token, mtp_weight_bytes, plan, rank_weight_bytes,
                         state_bytes_per_request)
from engine.plan_weights import stage_layers
from engine.spec.dspark import load_dspark
from engine.spec.mtp_model import build_mtp_layers
from engine.vision.loader import build_vision

CONFIGS = Path(__file__).resolve().parents[3] / "engine" / "plan_configs"


def _bytes(params) -> int:
    return sum(p.numel() * p.element_size() for p in params)


@pytest.mark.parametrize("preset", ["tiny-k3", "small-k3"])
def test_mtp_drafter_weights_equal_the_built_layers(preset):
    config = ModelConfig.from_dict(preset_config(preset))
    layers = build_mtp_layers(config, torch.nn.Embedding(1, 1), torch.bfloat16, "meta")
    assert mtp_weight_bytes(config, "dense", 2) == sum(_bytes(layer.parameters()) for layer in layers) > 0


def test_vision_bytes_equal_the_built_tower():
    config = ModelConfig.from_dict(preset_config("small-k3"))
    assert vision_bytes(config, 2) == _bytes(build_vision(config, torch.bfloat16, "meta").parameters()) > 0
    assert vision_bytes(ModelConfig.from_dict(preset_config("tiny-linear")), 2) == 0


def test_dspark_folder_bytes_equal_the_loaded_drafter(tmp_path):
    target_dir = make_checkpoint("tiny-k3", tmp_path / "target", seed=1)
    folder = make_checkpoint("tiny-k3-dspark", tmp_path / "dspark", seed=1)
    target = load_model(target_dir, LoadConfig(dtype="float32"))
    drafter = load_dspark(folder, target)
    shared = {id(p) for p in target.parameters()}
    own = [p for p in drafter.parameters() if id(p) not in shared]
    got = drafter_bytes(str(folder), 4)
    assert got.weights == _bytes(own) > 0
    raw = json.loads((folder / "config.json").read_text())
    assert got.row_bytes == raw["num_hidden_layers"] * (raw["kv_lora_rank"] + raw["qk_rope_head_dim"]) * 4


def test_speculative_scratch_slots_are_what_the_engine_reserves():
    config = ModelConfig.from_dict(preset_config("tiny-k3"))
    cache = plan_cache(EngineArgs(model="m", num_speculative_tokens=3, max_num_seqs=2), config, 2)
    base = PlanArgs(context_len=64, runtime_bytes=0)
    spec = PlanArgs(context_len=64, runtime_bytes=0, num_speculative_tokens=3, speculative_method="ngram")
    extra = plan(config, spec).ranks[0].per_request - plan(config, base).ranks[0].per_request
    assert extra == 3 * state_bytes_per_request(config, 2) == (cache.slots_per_request - 1) * cache.bytes_per_state


@pytest.mark.parametrize("preset", ["k3-93-pattern", "linear-48b-pattern"])
def test_pipeline_stages_partition_the_model(preset):
    config = ModelConfig.from_dict(preset_config(preset))
    whole = rank_weight_bytes(config, 2, False, "dense", 2).total
    stages = [rank_weight_bytes(config, 2, False, "dense", 2, stages=2, stage=s).total for s in range(2)]
    assert sum(stages) == whole and min(stages) > 0
    parts = [stage_layers(len(config.layers), 2, s) for s in range(2)]
    assert [i for p in parts for i in p] == list(range(len(config.layers)))
    assert sum(kv_bytes_per_token(config, 2, layers=p) for p in parts) == kv_bytes_per_token(config, 2)
    assert sum(state_bytes_per_request(config, 2, 2, p) for p in parts) == state_bytes_per_request(config, 2, 2)


def test_lead_ranks_carry_vision_and_drafter_and_the_totals_add_up():
    config = load_model_config(CONFIGS / "kimi-k3")
    args = PlanArgs(tensor_parallel_size=8, enable_expert_parallel=True, gpus=16, pipeline_parallel_size=2,
                    vision_bytes=10**9, num_speculative_tokens=2, speculative_method="ngram")
    p = plan(config, args)
    assert [(r.stage, r.lead, r.vision > 0) for r in p.ranks] == [(0, True, True), (0, False, False),
                                                                   (1, True, False), (1, False, False)]
    for r in p.ranks:
        assert r.usable == int(args.gpu_memory * 0.9) - r.weights - r.vision - r.runtime - r.activations
        assert r.load_peak == r.weights + args.shard_bytes
    assert p.concurrency == min(r.concurrency for r in p.ranks) and p.replicas == 1


def test_cli_prints_per_rank_totals_and_refuses_by_name(capsys):
    k3 = str(CONFIGS / "kimi-k3")
    assert main([k3, "-tp", "8", "--enable-expert-parallel", "--gpu-memory", "288GB"]) == 0
    out = capsys.readouterr().out
    assert "stage 0 lead rank: weights 202.02 GB" in out and "activations of a 16384-token step" in out
    assert main([k3, "-tp", "8", "--speculative-method", "dspark", "--num-speculative-tokens", "3"]) == 2
    assert "--drafter-dir" in capsys.readouterr().err
    assert main([k3, "-tp", "8", "--speculative-method", "mtp", "--num-speculative-tokens", "1"]) == 2
    assert "no MTP layers" in capsys.readouterr().err
    assert main([k3, "-tp", "8", "--enable-expert-parallel", "--gpu-memory", "288GB", "--json"]) == 0
    ranks = json.loads(capsys.readouterr().out)["ranks"]
    assert len(ranks) == 2 and ranks[0]["vision"] > 0 and ranks[1]["vision"] == 0
