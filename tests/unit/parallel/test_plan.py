"""`kdamesh plan`: the planner's per-rank bytes equal what the models and pools built for the tiny presets hold
(TP=1, TP=2, EP=2, packed MXFP4), the released configs give docs/architecture.md's per-request numbers, and the CLI says
clearly when something does not fit."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from deploy.plan_cli import main
from engine.model.batch import CacheTensors
from engine.model.config import ModelConfig, load_model_config
from engine.model.loader import build_empty_model
from engine.model.presets import preset_config
from engine.plan import PlanArgs, kv_bytes_per_token, plan, rank_weight_bytes, state_bytes_per_request
from tests.unit.parallel.test_sharding import _ctx

CONFIGS = Path(__file__).resolve().parents[3] / "engine" / "plan_configs"
LAYOUTS = [(1, False, "dense"), (2, False, "dense"), (2, True, "dense"), (1, False, "mxfp4"), (2, True, "mxfp4")]


def resident_bytes(model: torch.nn.Module) -> int:
    """Bytes of the distinct storages behind the parameters (fused tensors count once, with their padding)."""
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()}
    return sum(storages.values())


def _weight_cases() -> list:
    """Every preset x layout, except MXFP4 for experts narrower than one 32-column scale group (not packable)."""
    cases = []
    for preset in ("tiny-linear", "tiny-k3", "linear-48b-pattern", "k3-93-pattern", "small-k3"):
        packable = ModelConfig.from_dict(preset_config(preset)).moe.intermediate_size % 32 == 0
        cases += [pytest.param(preset, tp, ep, fmt, id=f"{preset}-tp{tp}{'-ep' if ep else ''}-{fmt}")
                  for tp, ep, fmt in LAYOUTS if packable or fmt != "mxfp4"]
    return cases


@pytest.mark.parametrize("preset,tp,ep,fmt", _weight_cases())
def test_weights_equal_the_built_model(preset, tp, ep, fmt):
    config = ModelConfig.from_dict(preset_config(preset))
    model = build_empty_model(config, torch.bfloat16, "cpu", _ctx(tp, ep=ep), experts_format=fmt)
    assert resident_bytes(model) == rank_weight_bytes(config, tp, ep, fmt, dtype_bytes=2).total


@pytest.mark.parametrize("preset", ["tiny-linear", "k3-93-pattern"])
@pytest.mark.parametrize("tp", [1, 2])
def test_pools_equal_the_allocated_cache(preset, tp):
    config = ModelConfig.from_dict(preset_config(preset))
    cache = CacheTensors.allocate(config, num_blocks=3, block_size=16, num_slots=2, dtype=torch.bfloat16,
                                  kda_heads=config.kda.num_heads // tp)
    per_slot = sum(t[0].numel() * t.element_size() for t in list(cache.conv.values()) + list(cache.recurrent.values()))
    per_block = sum(t[0].numel() * t.element_size() for t in cache.kv.values())
    assert per_slot == state_bytes_per_request(config, 2, tp)
    assert per_block == 16 * kv_bytes_per_token(config, 2)


def test_released_configs_match_the_design_numbers():
    k3, linear = load_model_config(CONFIGS / "kimi-k3"), load_model_config(CONFIGS / "kimi-linear-48b")
    assert len(k3.kda_layer_ids) == 69 and kv_bytes_per_token(k3, 2) == 27648  # docs/architecture.md: 69 layers, 27,648 B
    assert state_bytes_per_request(k3, 2) == pytest.approx(449e6, rel=0.01)  # ≈449 MB at TP1
    assert state_bytes_per_request(linear, 2) == pytest.approx(43e6, rel=0.02)  # ≈43 MB
    assert state_bytes_per_request(k3, 2, tp=8) * 8 == state_bytes_per_request(k3, 2)
    dense = rank_weight_bytes(linear, 1, False, "dense", 2).total
    assert 47e9 < dense / 2 < 50e9  # a 48B-parameter model
    experts = rank_weight_bytes(k3, 8, True, "mxfp4", 2).experts
    assert experts == pytest.approx(92 * 896 * 3 * 3072 * 3584 * 17 / 32 / 8, rel=1e-9)


def test_plan_concurrency_and_does_not_fit():
    config = load_model_config(CONFIGS / "kimi-linear-48b")
    args = PlanArgs(tensor_parallel_size=8, gpus=16, gpu_memory=141 * 10**9, context_len=32768)
    p = plan(config, args)
    assert p.fits and p.replicas == 2
    fixed = p.weights.total + args.runtime_bytes + sum(p.activation_terms.values())  # no drafter, no vision
    assert p.concurrency == (int(141e9 * 0.9) - fixed) // p.request_bytes
    assert p.handoff_bytes == state_bytes_per_request(config, 2) + 32768 * p.kv_per_token
    k3 = plan(load_model_config(CONFIGS / "kimi-k3"), PlanArgs(tensor_parallel_size=8, gpu_memory=141 * 10**9))
    assert not k3.fits and "weights need" in k3.reason
    long = plan(config, PlanArgs(tensor_parallel_size=8, gpu_memory=24 * 10**9, context_len=2_000_000))
    assert not long.fits and "one request" in long.reason


def test_cli(capsys):
    assert main([str(CONFIGS / "kimi-k3"), "--tensor-parallel-size", "8", "--gpu-memory", "288GB"]) == 0
    out = capsys.readouterr().out
    assert "fits:" in out and "experts mxfp4" in out
    assert main([str(CONFIGS / "kimi-k3"), "-tp", "8", "--gpu-memory", "141GB"]) == 1
    assert "does not fit" in capsys.readouterr().out
    assert main([str(CONFIGS / "kimi-linear-48b"), "-tp", "3"]) == 2
    assert "not divisible by --tensor-parallel-size 3" in capsys.readouterr().err
    assert main([str(CONFIGS / "kimi-linear-48b"), "-tp", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["fits"] is True


def test_planner_is_torch_free():
    code = "import sys, engine.plan; assert 'torch' not in sys.modules, 'engine.plan imports torch'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[3])


def test_cli_proposes_tp_x_pp_for_a_node_size(capsys):
    """K3 does not fit one 8 x H200 node (TP8); the fewest nodes that fit are two: TP8 x PP2. Control: on 8 x B300
    the same call proposes one node."""
    assert main([str(CONFIGS / "kimi-k3"), "--gpus-per-node", "8", "--gpu-memory", "141GB"]) == 0
    out = capsys.readouterr().out
    assert "TP8 x PP1 (1 node(s) of 8): does not fit" in out
    assert "proposed: --tensor-parallel-size 8 --pipeline-parallel-size 2 --nnodes 2" in out
    assert main([str(CONFIGS / "kimi-k3"), "--gpus-per-node", "8", "--gpu-memory", "288GB"]) == 0
    assert "proposed: --tensor-parallel-size 8 --pipeline-parallel-size 1 --nnodes 1" in capsys.readouterr().out
    assert main([str(CONFIGS / "kimi-k3"), "--gpus-per-node", "8", "--gpu-memory", "24GB", "--max-nodes", "2"]) == 1
