"""Engine arguments and the cache plan: pool sizes from the memory budget, the auto snapshot interval."""

from __future__ import annotations

import pytest

from engine.config import EngineArgs, auto_snapshot_interval, parse_bytes, plan_cache
from engine.errors import EngineConfigError
from engine.model.config import ModelConfig
from engine.model.presets import preset_config

TINY = ModelConfig.from_dict(preset_config("tiny-linear"))  # 160 B/token of KV, 31488 B of KDA state (fp32)


def test_parse_bytes():
    assert parse_bytes(4096) == 4096
    assert parse_bytes("512MiB") == 512 << 20
    assert parse_bytes("2GB") == 2_000_000_000
    assert parse_bytes("1.5g") == 3 << 29
    with pytest.raises(EngineConfigError):
        parse_bytes("lots")


def test_plan_splits_the_budget():
    args = EngineArgs(model="m", kv_cache_memory=1 << 20, max_num_seqs=4, block_size=16)
    plan = plan_cache(args, TINY, dtype_bytes=4)
    assert plan.num_running_slots == 4
    rest = (1 << 20) - 4 * 31488
    assert plan.num_snapshot_slots == int(rest / 3) // 31488
    assert plan.num_blocks == (rest - plan.num_snapshot_slots * 31488) // (16 * 160)
    assert plan.kv_bytes + plan.state_bytes <= 1 << 20
    assert plan.snapshot_interval == 192 and plan.max_model_len == plan.num_blocks * 16


def test_plan_overrides_and_speculative_layout():
    args = EngineArgs(model="m", num_kv_blocks=10, num_snapshot_slots=3, max_num_seqs=2, num_speculative_tokens=2,
                      snapshot_interval=64)
    plan = plan_cache(args, TINY, dtype_bytes=4)
    assert (plan.num_blocks, plan.num_snapshot_slots, plan.slots_per_request, plan.num_running_slots) == (10, 3, 3, 6)
    assert plan.snapshot_interval == 64
    off = plan_cache(EngineArgs(model="m", enable_prefix_caching=False, kv_cache_memory=4 << 20), TINY, 4)
    assert off.num_snapshot_slots == 0 and off.snapshot_interval == 0


def test_auto_interval():
    assert auto_snapshot_interval(16, 160, 31488) == 192
    assert auto_snapshot_interval(16, 160, 10) == 16  # at least one block
    assert auto_snapshot_interval(16, 27648, 449 << 20) == 16 * round((449 << 20) / 27648 / 16)  # K3: ~17K tokens


@pytest.mark.parametrize("kwargs", [dict(block_size=0), dict(max_num_seqs=-1), dict(snapshot_interval=24),
                                    dict(kv_cache_memory=0), dict(snapshot_memory_fraction=1.0),
                                    dict(num_speculative_tokens=-1), dict(max_model_len=0)])
def test_bad_args(kwargs):
    with pytest.raises(EngineConfigError):
        EngineArgs(model="m", **kwargs)


def test_budget_too_small_for_running_states():
    with pytest.raises(EngineConfigError, match="max_num_seqs"):
        plan_cache(EngineArgs(model="m", kv_cache_memory=100_000, max_num_seqs=8), TINY, 4)
    with pytest.raises(EngineConfigError, match="exceeds"):
        plan_cache(EngineArgs(model="m", max_model_len=1 << 30), TINY, 4)
