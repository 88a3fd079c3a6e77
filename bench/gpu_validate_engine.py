"""bench/gpu_validate.py's engine sections: host syncs around decode and verify steps (`torch.cuda.set_sync_debug_mode`),
engine decode tok/s at batch 1/16/64 on a K3-shaped random config (per-layer figures extrapolated to 93 layers),
and eager vs compiled/captured decode steps. Without CUDA each records why it could not run."""

from __future__ import annotations

import json
import tempfile
import warnings
from pathlib import Path

import torch

from bench.gpu_checks import Check, Report, _decode_batch, model_steps


def count_syncs(fn) -> tuple[int, list[str]]:
    """Runs `fn()` under `torch.cuda.set_sync_debug_mode("warn")`; -> the synchronising calls it made and their
    messages."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    messages = [str(w.message) for w in caught if "synchroniz" in str(w.message)]
    return len(messages), messages


def sync_check(report: Report, label: str, fn, budget: int) -> None:
    """One sync-count check: pass when `fn` synchronises at most `budget` times."""
    count, messages = count_syncs(fn)
    note = f"{count} sync(s), budget {budget}" + (f"; first: {messages[0][:160]}" if messages else "")
    report.add(Check(f"sync {label}", "cuda", "pass" if count <= budget else "fail", note=note))


def _steady_engine(folder: str, batch: int, **engine_args):
    """An `EngineCore` on CUDA whose `batch` greedy requests are past their prefill (the next step decodes)."""
    from bench.llamacpp_worker import random_prompt
    from engine.config import EngineArgs
    from engine.core import EngineCore
    from engine.sampling import SamplingParams

    core = EngineCore(EngineArgs(model=folder, device="cuda", max_num_seqs=batch, kv_cache_memory=1 << 30,
                                 enable_prefix_caching=False, **engine_args))
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    for i in range(batch):
        core.add_request(f"sync-{i}", {"prompt_token_ids": random_prompt(32, seed=i)}, params)
    for _ in range(4):  # prefill, then a few decode steps (speculation starts once the drafter has a state)
        core.step()
    return core


def sync_checks(report: Report, preset: str = "tiny-k3") -> None:
    from engine.model.batch import CacheTensors
    from engine.model.checkpoint import make_checkpoint
    from engine.model.loader import LoadConfig, load_model

    with tempfile.TemporaryDirectory() as tmp:
        folder = str(make_checkpoint(preset, Path(tmp) / preset, seed=0))
        model = load_model(folder, LoadConfig(device="cuda", dtype="float32"))
        model_steps(model, [[5, 6, 7, 8]] * 4, 1)  # warms the kernels up
        cache = CacheTensors.allocate(model.config, 4 * 4, 16, 4, model.dtype, model.device,
                                      kda_heads=model.num_local_kda_heads)
        batch = _decode_batch([8, 8, 8, 8], [1, 2, 3, 4], 16, 4).to(model.device)
        torch.cuda.synchronize()
        sync_check(report, f"{preset} model decode forward x4", lambda: model(batch, cache), 0)
        sync_check(report, f"{preset} engine decode step x4", _steady_engine(folder, 4).step, 2)
        spec = {"method": "mtp", "num_speculative_tokens": 2}
        sync_check(report, f"{preset} engine MTP verify step x4",
                   _steady_engine(folder, 4, speculative_config=spec).step, 2)


def k3_shaped_config(layers: int, experts: int) -> dict:
    """The released K3 layer shapes (bench/bench_engine.py's `released_configs`) with `layers` layers (MLA every
    4th and last), `experts` routed experts and the generated tokenizer's vocabulary."""
    from engine.model.presets import VOCAB_SIZE, _kimi_k3, _kimi_linear, _vision

    mla = sorted({i for i in range(4, layers + 1, 4)} | {layers})
    text = _kimi_linear(hidden=7168, layers=layers, mla_layers=mla, kda_heads=96, kda_head_dim=128, mla_heads=96,
                        kv_lora=512, nope=128, rope=64, v_dim=128, experts=experts, top_k=min(16, experts), shared=2,
                        moe_inter=3072, inter=18432)
    text.update(vocab_size=VOCAB_SIZE)
    raw = _kimi_k3(text, q_lora=1536, latent=3584, block_size=min(12, layers),
                   vision=_vision(7168, hidden=32, layers=1, heads=2, inter=64, pos_grid=16))
    raw["dtype"] = raw["text_config"]["dtype"] = "bfloat16"
    return raw


def dummy_folder(raw: dict, out: Path) -> str:
    """A folder for `load_format="dummy"` with the K3 config `raw`: `tiny-k3`'s generated checkpoint (its tokenizer,
    generation and preprocessor configs) with `raw` as config.json and no weights."""
    from engine.model.checkpoint import make_checkpoint

    make_checkpoint("tiny-k3", out, seed=0)
    (out / "config.json").write_text(json.dumps(raw, indent=2))
    for weights in out.glob("*.safetensors*"):
        weights.unlink()
    return str(out)


def engine_decode(folder: str, batch: int, tokens: int, device: str, dtype: str, **engine_args) -> dict:
    """Decode tok/s of `batch` greedy requests (32-token prompts) in one `EngineCore` with dummy weights."""
    from bench.llamacpp_worker import random_prompt, run_requests
    from engine.config import EngineArgs
    from engine.core import EngineCore

    core = EngineCore(EngineArgs(model=folder, load_format="dummy", device=device, dtype=dtype, max_num_seqs=batch,
                                 enable_prefix_caching=False, num_kv_blocks=batch * 8 + 8,
                                 kv_cache_memory=64 << 30, **engine_args))
    run_requests(core, [random_prompt(8, seed=0)], 2)  # warm-up
    run = run_requests(core, [random_prompt(32, seed=i) for i in range(batch)], tokens + 1)
    seconds = run["end"] - run["all_first"]
    layers = core.model.config.num_hidden_layers
    return {"tok_s": batch * tokens / seconds, "step_ms": 1e3 * seconds / tokens,
            "per_user_93_layers": 1e3 / (1e3 * seconds / tokens / layers * 93), "layers": layers}


def engine_checks(report: Report, raw: dict, batches: tuple[int, ...], tokens: int, device: str = "cuda",
                  dtype: str = "bfloat16", eager_vs_graph: bool = True) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        folder = dummy_folder(raw, Path(tmp) / "k3-shaped")
        for batch in batches:
            r = engine_decode(folder, batch, tokens, device, dtype)
            report.add(Check(f"engine decode tok/s batch {batch}", device, "pass", None, r["step_ms"],
                             f"{r['tok_s']:.1f} tok/s over {r['layers']} layers; ms per step; 93 layers: "
                             f"≥ {r['per_user_93_layers']:.1f} tok/s per user"))
        if eager_vs_graph:
            eager_vs_graph_check(report, lambda **kw: engine_decode(folder, 1, tokens, device, dtype, **kw), device)


def eager_vs_graph_check(report: Report, decode, device: str) -> None:
    """`decode(enforce_eager=...)` -> its `step_ms`; "skipped" while `EngineArgs` has no `enforce_eager` field."""
    from engine.config import EngineArgs

    if "enforce_eager" not in EngineArgs.__dataclass_fields__:
        report.add(Check("engine eager vs graph batch 1", device, "skipped",
                         note="EngineArgs has no enforce_eager field in this tree"))
        return
    eager, graph = decode(enforce_eager=True), decode(enforce_eager=False)
    report.add(Check("engine eager vs graph batch 1", device, "pass", None, graph["step_ms"],
                     f"eager {eager['step_ms']:.2f} ms, graph {graph['step_ms']:.2f} ms per step "
                     f"({eager['step_ms'] / graph['step_ms']:.2f}x)"))


