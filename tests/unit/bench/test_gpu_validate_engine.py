"""bench/gpu_validate.py's engine and sync sections without a GPU: the engine decode figures run on CPU at a tiny
config, the K3-shaped config has the released layer shapes, and the sync checks are skipped with the reason."""

import json

import torch

from bench import gpu_validate as gv
from engine.config import EngineArgs
from engine.model.config import ModelConfig
from engine.model.presets import preset_config


def test_engine_decode_section_runs_on_cpu_with_dummy_weights():
    report = gv.Report("cpu")
    gv.engine_checks(report, preset_config("tiny-k3"), (1, 3), 3, device="cpu", dtype="float32",
                     eager_vs_graph=False)
    assert [c.name for c in report.checks] == ["engine decode tok/s batch 1", "engine decode tok/s batch 3"]
    assert all(c.status == "pass" and c.ms > 0 and "tok/s per user" in c.note for c in report.checks)


def test_eager_vs_graph_passes_enforce_eager_or_says_the_field_is_missing():
    report, calls = gv.Report("cpu"), []

    def decode(**kw):
        calls.append(kw)
        return {"step_ms": 4.0 if kw["enforce_eager"] else 1.0}

    gv.eager_vs_graph_check(report, decode, "cpu")
    (check,) = report.checks
    if "enforce_eager" in EngineArgs.__dataclass_fields__:
        assert calls == [{"enforce_eager": True}, {"enforce_eager": False}]
        assert check.status == "pass" and "(4.00x)" in check.note
    else:  # this tree's engine has no such switch: reported, not faked
        assert calls == [] and check.status == "skipped" and "enforce_eager" in check.note


def test_k3_shaped_config_keeps_the_released_layer_and_shrinks_depth_and_experts():
    raw = gv.k3_shaped_config(layers=8, experts=32)
    config = ModelConfig.from_dict(json.loads(json.dumps(raw)))
    text = raw["text_config"]
    assert (text["hidden_size"], text["num_attention_heads"], text["q_lora_rank"], text["routed_expert_hidden_size"],
            text["moe_intermediate_size"], text["num_experts_per_token"]) == (7168, 96, 1536, 3584, 3072, 16)
    assert config.num_hidden_layers == 8 and text["num_experts"] == 32
    assert text["linear_attn_config"]["full_attn_layers"] == [4, 8]
    assert gv.k3_shaped_config(layers=4, experts=8)["text_config"]["num_experts_per_token"] == 8  # top-k ≤ experts


def test_without_cuda_the_sync_and_engine_sections_are_skipped_with_the_reason(tmp_path):
    if torch.cuda.is_available():
        return  # the real run is the check
    gv.main(["--out", str(tmp_path / "gpu.json")])
    checks = json.loads((tmp_path / "gpu.json").read_text())["checks"]
    assert {c["name"] for c in checks} >= {"sync", "engine"}
    assert all(c["status"] == "skipped" and c["note"] == "no CUDA device" for c in checks)
