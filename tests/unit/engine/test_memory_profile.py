"""`--gpu-memory-utilization` on CPU: the pools get what a profile run of the largest step leaves of the fraction of
`--cpu-memory` (engine/memory_profile.py); the profile really measures the step (a larger step measures more: the
negative control); a budget that leaves nothing, and option combinations with two meanings, are refused by name;
an engine sized this way generates what one sized by `--kv-cache-memory` generates, with tensor parallelism too
(every rank runs the profile's collective forward; they agree on the tightest rank's budget)."""

from __future__ import annotations

import json

import pytest

from engine import LLM, SamplingParams
from engine.config import EngineArgs, parse_bytes, plan_cache
from engine.errors import EngineConfigError
from engine.memory_profile import profiled_kv_budget
from engine.model.loader import LoadConfig, load_model
from engine.model.presets import preset_config

GREEDY = dict(temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def wide_dir(tmp_path_factory):
    """A config-only tiny-linear, wide enough that a 2048-token step's activations are tens of MiB (dummy weights)."""
    folder = tmp_path_factory.mktemp("profile")
    raw = preset_config("tiny-linear") | {"hidden_size": 256, "intermediate_size": 1024, "moe_intermediate_size": 256}
    (folder / "config.json").write_text(json.dumps(raw))
    return folder


def _cpu_memory(headroom: int = 384 << 20) -> int:
    """A --cpu-memory whose half is this process's resident memory now + `headroom` (the test process's own size
    depends on what ran before it)."""
    with open("/proc/self/status") as f:
        rss = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
    return 2 * (rss + headroom)


def _args(folder, **kw) -> EngineArgs:
    return EngineArgs(model=str(folder), load_format="dummy", **({"gpu_memory_utilization": 0.5,
                                                                  "cpu_memory": "8GiB"} | kw))


def test_a_larger_step_measures_more(wide_dir):
    model = load_model(wide_dir, LoadConfig(load_format="dummy"))
    small = profiled_kv_budget(_args(wide_dir, max_num_batched_tokens=32), model)
    large = profiled_kv_budget(_args(wide_dir, max_num_batched_tokens=2048), model)
    assert (small.profiled_tokens, large.profiled_tokens) == (32, 2048)
    assert large.activation_peak > 2 * small.activation_peak + (8 << 20), (small, large)
    for r in (small, large):
        assert r.total == 8 << 30 and r.kv_budget == (4 << 30) - r.in_use - r.activation_peak
        assert r.in_use > sum(p.numel() * p.element_size() for p in model.parameters())  # weights + runtime


def test_the_engine_sizes_its_pools_from_the_profile_and_generates_the_same(wide_dir):
    total = _cpu_memory()
    sized = LLM(str(wide_dir), load_format="dummy", gpu_memory_utilization=0.5, cpu_memory=total,
                max_num_batched_tokens=512, max_num_seqs=4)
    profile, plan = sized.engine.memory_profile, sized.engine.plan
    # (activation_peak may be 0 here: an earlier test's larger step left heap this one reuses, counted in in_use)
    assert profile.total == total and profile.fraction == 0.5 and profile.profiled_tokens == 512
    assert profile.kv_budget == total // 2 - profile.in_use - profile.activation_peak
    used = plan.kv_bytes + plan.state_bytes
    assert profile.kv_budget - plan.block_size * plan.bytes_per_token - plan.bytes_per_state < used
    assert used <= profile.kv_budget
    fixed = LLM(str(wide_dir), load_format="dummy", kv_cache_memory="64MiB", max_num_batched_tokens=512,
                max_num_seqs=4)
    assert fixed.engine.memory_profile is None and fixed.engine.plan.num_blocks != plan.num_blocks
    prompts = [{"prompt_token_ids": [(11 * i + j) % 200 + 5 for i in range(40 + 9 * j)]} for j in range(3)]
    params = SamplingParams(max_tokens=6, **GREEDY)
    assert [o.outputs[0].token_ids for o in sized.generate(prompts, params)] == \
           [o.outputs[0].token_ids for o in fixed.generate(prompts, params)]


def test_a_fraction_that_leaves_nothing_is_refused_with_every_term(wide_dir):
    with pytest.raises(EngineConfigError, match="--gpu-memory-utilization 0.9: .* in use .* activations"):
        LLM(str(wide_dir), load_format="dummy", gpu_memory_utilization=0.9, cpu_memory="64MiB")


@pytest.mark.parametrize("kw, flag", [
    (dict(gpu_memory_utilization=1.5), "--gpu-memory-utilization"),
    (dict(gpu_memory_utilization=0.0), "--gpu-memory-utilization"),
    (dict(gpu_memory_utilization=0.5, kv_cache_memory="1GiB"), "--kv-cache-memory"),
    (dict(cpu_memory="4GiB"), "--cpu-memory"),
    (dict(gpu_memory_utilization=0.5, cpu_memory="4GiB", device="cuda"), "--cpu-memory"),
])
def test_ambiguous_or_unbuilt_combinations_are_refused_by_name(kw, flag):
    with pytest.raises(EngineConfigError, match=flag):
        EngineArgs(model="m", **kw)


def test_plan_cache_needs_the_profiled_budget(wide_dir):
    from engine.model.config import load_model_config

    config = load_model_config(wide_dir)
    args = _args(wide_dir)
    with pytest.raises(EngineConfigError, match="profile"):
        plan_cache(args, config, 4)
    plan = plan_cache(args, config, 4, budget=256 << 20)
    assert plan.kv_bytes + plan.state_bytes <= 256 << 20
    default = plan_cache(EngineArgs(model="m"), config, 4)  # unset: the 1 GiB default, as before
    assert default.kv_bytes + default.state_bytes <= parse_bytes("1GiB") < default.kv_bytes + 2 * default.state_bytes \
        + default.block_size * default.bytes_per_token


def test_tensor_parallel_ranks_profile_together(wide_dir):
    prompts = [{"prompt_token_ids": [(13 * i + j) % 200 + 5 for i in range(30 + 7 * j)]} for j in range(2)]
    params = SamplingParams(max_tokens=5, **GREEDY)
    total = _cpu_memory()
    sized = LLM(str(wide_dir), load_format="dummy", gpu_memory_utilization=0.5, cpu_memory=total,
                max_num_batched_tokens=256, max_num_seqs=2, tensor_parallel_size=2, collective_timeout_s=120)
    try:
        profile, plan = sized.engine.memory_profile, sized.engine.plan  # the tightest rank's: this process's
        assert profile.total == total and profile.kv_budget == total // 2 - profile.in_use - profile.activation_peak
        assert plan.kv_bytes + plan.state_bytes <= profile.kv_budget
        got = [o.outputs[0].token_ids for o in sized.generate(prompts, params)]
    finally:
        sized.close()
    alone = LLM(str(wide_dir), load_format="dummy", kv_cache_memory="64MiB", max_num_batched_tokens=256,
                max_num_seqs=2)
    assert got == [o.outputs[0].token_ids for o in alone.generate(prompts, params)]


def test_the_vision_encoder_runs_on_the_largest_image_it_admits(tmp_path):
    from engine.model.checkpoint import make_checkpoint
    from engine.vision.feed import load_media
    from engine.vision.processor import ProcessorConfig

    from engine.memory_profile import largest_image_grid

    assert largest_image_grid(ProcessorConfig()) == (128, 128)  # the released limits: 16,384 patches
    assert largest_image_grid(ProcessorConfig(in_patch_limit=1000, merge_kernel_size=2)) == (30, 30)
    assert largest_image_grid(ProcessorConfig(in_patch_limit=16384, patch_limit_on_one_side=100)) == (100, 100)
    folder = make_checkpoint("tiny-k3", tmp_path / "k3", seed=2)
    config_path = folder / "preprocessor_config.json"
    raw = json.loads(config_path.read_text())
    raw["media_proc_cfg"]["in_patch_limit"] = 1024
    config_path.write_text(json.dumps(raw))
    model = load_model(folder, LoadConfig())
    media = load_media(folder, LoadConfig(), model.config.media_placeholder_token_id, 1 << 20)
    seen = []
    media.feeder.encoder.register_forward_hook(lambda module, inputs, out: seen.append(
        (tuple(inputs[0].shape), inputs[1].tolist(), tuple(out.shape))))
    args = EngineArgs(model=str(folder), gpu_memory_utilization=0.5, cpu_memory="8GiB", max_num_batched_tokens=64)
    profiled_kv_budget(args, model)
    assert seen == []  # text only without the media
    profiled_kv_budget(args, model, media)
    assert seen == [((32 * 32, 3, 14, 14), [[1, 32, 32]], (16 * 16, model.config.hidden_size))]


def test_without_clear_refs_the_mark_since_start_up_counts(monkeypatch, caplog):
    import builtins

    from engine.memory_profile import HostMeter

    real_open = builtins.open

    def guarded(path, *args, **kwargs):
        if str(path) == "/proc/self/clear_refs":
            raise PermissionError("read-only /proc")
        return real_open(path, *args, **kwargs)

    meter = HostMeter(EngineArgs(model="m", gpu_memory_utilization=0.5))
    monkeypatch.setattr(builtins, "open", guarded)
    meter.start()
    grown = bytearray(64 << 20)  # 64 MiB touched after the start
    assert meter.peak() >= 60 << 20 and len(grown)
    assert "cannot reset the resident high-water mark" in caplog.text
