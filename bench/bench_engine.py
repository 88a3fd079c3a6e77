"""Engine benchmarks: offline throughput vs transformers, prefix-cache TTFT, and memory per token of context.

Usage: `python -m bench.bench_engine [--presets small-linear,small-k3] [--threads 1] [--out FILE]`

1. Throughput: output tokens/s of `LLM.generate` on `--num-prompts` concurrent prompts (`--input-len` random ids in,
   `--output-len` greedy tokens out, EOS ignored) against transformers' `KimiLinearForCausalLM.generate` in the same
   process, one prompt at a time and batched. All prompts have the same length, so the batched baseline needs no
   padding. One prompt at a time is slow, so it runs on the first `--hf-single-prompts` prompts (tokens/s does
   not depend on how many); batched runs all `--hf-batch-prompts` (default: all 32) in one `generate` call. The
   first prompt's greedy tokens are compared with ours. `kimi_k3` presets have no transformers class; their
   baseline is the official Kimi K3 modeling code (`llmcompressor`'s files, loaded by path as in the tests:
   tests/reference/k3_reference.py) in a greedy loop on its own `KimiDynamicCache` (it has no `generate`), one
   prompt at a time and batched, with the same prompt counts. Its `fla` kernels (Triton, GPU-only) are replaced by
   the tests' pure-torch stand-ins, whose KDA and short conv step token by token.
2. Prefix cache: time to first token (`max_tokens=1`) of a `--ttft-len` prompt whose first `--ttft-cached` tokens
   were the whole prompt of an earlier request (their blocks and prompt-end KDA snapshot are cached), vs the same
   prompt on an empty cache.
   Each throughput table ends with a compute floor: the matmul FLOPs the workload needs at the least (every weight
   matrix once per token, routed experts at top_k / num_experts, the LM head for sampled positions only, MLA scores
   over each token's context, four state-sized products per KDA token), divided by this run's single-GEMM rate
   (a [2048, 768] x [768, 4096] fp32 product, best of 5). No implementation on these threads beats it, so
   `baseline seconds / floor seconds` bounds the ratio any engine can reach against that baseline here.
3. Memory: bytes per token of context from the pools' own sizing (`bytes_per_token`, `bytes_per_state`) for a
   preset and the released Kimi K3 and Kimi-Linear-48B configs (bf16), against an all-MLA model of the same shape.

Torch runs with `--threads` threads for both sides (default 1: on a busy two-core box two threads make small ops
many times slower). Prints markdown tables; `--out` writes the numbers as JSON.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

from engine import LLM, SamplingParams
from engine.model.batch import bytes_per_state, bytes_per_token
from engine.model.checkpoint import make_checkpoint
from engine.model.config import ModelConfig
from engine.model.presets import _kimi_k3, _kimi_linear, preset_config

VOCAB_FOR_PROMPTS = 7900
BASELINE_LABELS = {
    "ours": "kdamesh LLM.generate (continuous batching)",
    "hf_single": "transformers generate, one prompt at a time",
    "hf_batched": "transformers generate, batched",
    "k3ref_single": "official Kimi K3 code (fla stand-ins), greedy loop, one prompt at a time",
    "k3ref_batched": "official Kimi K3 code (fla stand-ins), greedy loop, batched",
}


def random_ids(n: int, rng: random.Random) -> list[int]:
    return [rng.randrange(VOCAB_FOR_PROMPTS) for _ in range(n)]


# -- 1. throughput ---------------------------------------------------------------------------------------------


def bench_ours(model_dir: Path, prompts: list[list[int]], output_len: int, dtype: str) -> dict:
    llm = LLM(str(model_dir), dtype=dtype, kv_cache_memory=2 << 30, max_num_seqs=len(prompts),
              max_num_batched_tokens=4096, enable_prefix_caching=False)
    llm.generate({"prompt_token_ids": prompts[0][:16]}, SamplingParams(max_tokens=2, temperature=0))  # warm up
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    flops = workload_flops(llm.engine.model, len(prompts), len(prompts[0]), output_len)
    return {"prompts": len(prompts), "seconds": seconds, "tok_s": tokens / seconds,
            "first_output": outs[0].outputs[0].token_ids, "workload_gflop": flops / 1e9}


def _transformers_model(model_dir: Path, dtype: str):
    saved = sys.modules.get("fla", "absent")
    sys.modules["fla"] = None  # transformers' pure-torch KDA
    try:
        from transformers import KimiLinearForCausalLM

        return KimiLinearForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    finally:
        if saved == "absent":
            sys.modules.pop("fla", None)
        else:
            sys.modules["fla"] = saved


def _k3_reference_model(model_dir: Path, dtype: str):
    from tests.reference.k3_reference import load_reference_k3

    return load_reference_k3(model_dir).to(getattr(torch, dtype))


def bench_k3_reference(model, prompts: list[list[int]], output_len: int, batched: bool) -> dict:
    from tests.reference.k3_reference import reference_generate_batch

    groups = [prompts] if batched else [[p] for p in prompts]
    tokens, first = 0, None
    start = time.perf_counter()
    for group in groups:
        out = reference_generate_batch(model, group, output_len)
        tokens += sum(len(row) for row in out)
        if first is None:
            first = out[0]
    seconds = time.perf_counter() - start
    return {"prompts": len(prompts), "seconds": seconds, "tok_s": tokens / seconds, "first_output": first}


def bench_transformers(model, prompts: list[list[int]], output_len: int, batched: bool) -> dict:
    groups = [prompts] if batched else [[p] for p in prompts]
    tokens, first = 0, None
    start = time.perf_counter()
    with torch.no_grad():
        for group in groups:
            ids = torch.tensor(group)
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=output_len, min_new_tokens=output_len, eos_token_id=None,
                                 pad_token_id=0)
            tokens += (out.shape[1] - ids.shape[1]) * out.shape[0]
            if first is None:
                first = out[0, ids.shape[1]:].tolist()
    seconds = time.perf_counter() - start
    return {"prompts": len(prompts), "seconds": seconds, "tok_s": tokens / seconds, "first_output": first}


def bench_baselines(preset: str, model_dir: Path, prompts: list[list[int]], args) -> dict:
    """The same-process baselines of a preset: transformers for `kimi_linear`, the official code for `kimi_k3`."""
    if preset_config(preset)["model_type"] == "kimi_linear":
        ref, run, prefix = _transformers_model(model_dir, args.dtype), bench_transformers, "hf"
    else:
        ref, run, prefix = _k3_reference_model(model_dir, args.dtype), bench_k3_reference, "k3ref"
    r = {}
    if args.hf_single_prompts:
        r[f"{prefix}_single"] = run(ref, prompts[: args.hf_single_prompts], args.output_len, batched=False)
    if args.hf_batch_prompts:
        r[f"{prefix}_batched"] = run(ref, prompts[: args.hf_batch_prompts], args.output_len, batched=True)
    return r


def gemm_gflops() -> float:
    """This machine's fp32 matmul rate right now: a [2048, 768] x [768, 4096] product, best of 5 (GFLOP/s)."""
    x, w = torch.randn(2048, 768), torch.randn(4096, 768)
    torch.nn.functional.linear(x, w)
    best = min(_timed(lambda: torch.nn.functional.linear(x, w)) for _ in range(5))
    return 2 * 2048 * 768 * 4096 / best / 1e9


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def workload_flops(model, num_prompts: int, input_len: int, output_len: int) -> float:
    """The fewest matmul FLOPs of the throughput workload on `model` (see the module docstring, item 1)."""
    config = model.config
    dense = routed = 0
    for name, p in model.named_parameters():
        if p.dim() < 2 or "embed_tokens" in name or "lm_head" in name or name.endswith("gate.weight"):
            continue
        if ".experts." in name:
            routed += p.numel()
        else:
            dense += p.numel()
    moe = config.moe
    per_token = 2 * dense + (2 * routed * moe.top_k / moe.num_experts if moe else 0)
    kda = config.kda
    per_token += 8 * len(config.kda_layer_ids) * kda.num_heads * kda.head_dim * kda.head_dim
    mla = config.mla
    attn_per_context = 2 * len(config.mla_layer_ids) * mla.num_heads * (mla.cache_dim + mla.kv_lora_rank)
    tokens = num_prompts * (input_len + output_len - 1)
    context = num_prompts * sum(range(1, input_len + output_len))  # Σ over tokens of the positions they attend to
    lm_head = 2 * config.hidden_size * config.vocab_size * num_prompts * output_len
    return tokens * per_token + context * attn_per_context + lm_head


def prefill_flops(model, prompt_len: int, chunk: int) -> float:
    """Matmul FLOPs of one `prompt_len`-token prefill in chunks of `chunk` tokens (the engine's
    `max_num_batched_tokens`): the weights as `workload_flops` counts them, the KDA state updates, and MLA in the
    non-absorbed prefill form (kernels/attention/mla_prefill.py): per query, head and earlier key 2·(nope + rope + v),
    and per chunk every cached key expanded once, 2·lora·(nope + v) per head."""
    config = model.config
    weights = workload_flops(model, 1, prompt_len, 1) - _attention_flops(config, prompt_len)
    mla = config.mla
    per_pair = 2 * (mla.qk_nope_head_dim + mla.qk_rope_head_dim + mla.v_head_dim) * mla.num_heads
    pairs = prompt_len * (prompt_len + 1) // 2  # (query, key) pairs, causal
    expanded = sum(min(start + chunk, prompt_len) for start in range(0, prompt_len, chunk))  # keys seen per chunk
    expand = 2 * mla.kv_lora_rank * (mla.qk_nope_head_dim + mla.v_head_dim) * mla.num_heads
    return weights + len(config.mla_layer_ids) * (pairs * per_pair + expanded * expand)


def _attention_flops(config, prompt_len: int) -> float:
    """`workload_flops`' absorbed attention term for one prompt of `prompt_len` tokens and one output."""
    mla = config.mla
    return prompt_len * (prompt_len + 1) // 2 * 2 * len(config.mla_layer_ids) * mla.num_heads * (
        mla.cache_dim + mla.kv_lora_rank)


# -- 2. prefix-cache TTFT ----------------------------------------------------------------------------------------


def bench_ttft(model_dir: Path, total: int, cached: int, rng: random.Random, dtype: str) -> dict:
    llm = LLM(str(model_dir), dtype=dtype, kv_cache_memory=1 << 30, max_num_seqs=4,
              max_num_batched_tokens=4096)
    prefix = random_ids(cached, rng)
    prompt = {"prompt_token_ids": prefix + random_ids(total - cached, rng)}
    first = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    llm.generate({"prompt_token_ids": prefix[:32]}, first)  # warm up
    llm.engine.reset_prefix_cache()
    start = time.perf_counter()
    [cold] = llm.generate(prompt, first)
    cold_s = time.perf_counter() - start
    llm.engine.reset_prefix_cache()
    llm.generate({"prompt_token_ids": prefix}, first)  # a request whose prompt was the prefix
    start = time.perf_counter()
    [warm] = llm.generate(prompt, first)
    warm_s = time.perf_counter() - start
    same = warm.outputs[0].token_ids == cold.outputs[0].token_ids
    # fp32 is exact (the tests prove hit == miss); in bf16 a different chunking rounds differently and a near-tie
    # among random-weight logits can flip, so there it is only reported.
    assert same or dtype != "float32", "a prefix hit changed the output"
    return {"prompt": total, "cached_tokens": warm.num_cached_tokens, "cold_s": cold_s, "warm_s": warm_s,
            "speedup": cold_s / warm_s, "snapshot_interval": llm.engine.plan.snapshot_interval,
            "same_first_token": same}


# -- 3. memory -------------------------------------------------------------------------------------------------


def released_configs() -> dict[str, dict]:
    """config.json dicts with the released shapes of docs/architecture.md (bf16)."""
    linear = _kimi_linear(hidden=2304, layers=27, mla_layers=[4, 8, 12, 16, 20, 24, 27], kda_heads=32,
                          kda_head_dim=128, mla_heads=32, kv_lora=512, nope=128, rope=64, v_dim=128, experts=256,
                          top_k=8, shared=1, moe_inter=1024, inter=9216)
    linear.update(vocab_size=163840, dtype="bfloat16")
    k3_mla_one_based = [i + 1 for i in range(3, 92, 4)] + [93]
    k3_text = _kimi_linear(hidden=7168, layers=93, mla_layers=k3_mla_one_based, kda_heads=96, kda_head_dim=128,
                           mla_heads=96, kv_lora=512, nope=128, rope=64, v_dim=128, experts=896, top_k=16, shared=2,
                           moe_inter=3072, inter=18432)
    k3_text.update(vocab_size=163840)
    k3 = _kimi_k3(k3_text, q_lora=1536, latent=3584, block_size=12)
    k3["dtype"] = "bfloat16"
    return {"Kimi-Linear-48B (released)": linear, "Kimi K3 (released)": k3}


def memory_rows(preset: str) -> list[dict]:
    configs = {f"{preset} (fp32)": (preset_config(preset), 4)}
    configs.update({name: (raw, 2) for name, raw in released_configs().items()})
    rows = []
    for name, (raw, dtype_bytes) in configs.items():
        config = ModelConfig.from_dict(raw)
        kv, state = bytes_per_token(config, dtype_bytes), bytes_per_state(config, dtype_bytes)
        all_mla = config.num_hidden_layers * config.mla.cache_dim * dtype_bytes
        per_token = {ctx: (kv * ctx + state) / ctx for ctx in (4096, 32768, 131072, 1048576)}
        rows.append({"model": name, "layers": f"{len(config.mla_layer_ids)} MLA / {config.num_hidden_layers}",
                     "kv_b_per_token": kv, "state_b": state, "all_mla_b_per_token": all_mla,
                     "per_token": per_token, "ratio_long": kv / all_mla})
    return rows


# -- report ----------------------------------------------------------------------------------------------------


def _markdown(result: dict) -> str:
    lines = []
    for preset, r in result["throughput"].items():
        lines += [f"### Throughput, {preset}: {r['ours']['prompts']} prompts x {result['input_len']} in, "
                  f"{result['output_len']} out, {result['threads']} thread(s)", "",
                  "| impl | prompts | seconds | output tok/s | ours / this |", "|---|---|---|---|---|"]
        ours = r["ours"]["tok_s"]
        for name, label in BASELINE_LABELS.items():
            if name in r:
                v = r[name]
                lines.append(f"| {label} | {v['prompts']} | {v['seconds']:.1f} | {v['tok_s']:.1f} | "
                             f"{ours / v['tok_s']:.1f}x |")
        if "floor" in r:
            f = r["floor"]
            lines.append(f"\ncompute floor: {f['workload_gflop']:.0f} GFLOP at {f['gemm_gflops']:.1f} GFLOP/s = "
                         f"{f['seconds']:.1f} s ({f['tok_s']:.0f} output tok/s); ours takes "
                         f"{r['ours']['seconds'] / f['seconds']:.2f}x the floor; the better baseline allows at most "
                         f"{f['best_possible_ratio']:.1f}x")
        if "outputs_match" in r:
            baseline = "the official code's" if "k3ref_single" in r or "k3ref_batched" in r else "transformers'"
            lines.append(f"\nfirst prompt's {result['output_len']} greedy tokens equal {baseline}: "
                         f"{r['outputs_match']}")
        lines.append("")
    lines += ["### Prefix cache: time to first token", "",
              "| preset | prompt | cached tokens | cold s | warm s | speedup | snapshot interval |",
              "|---|---|---|---|---|---|---|"]
    for preset, v in result["ttft"].items():
        lines.append(f"| {preset} | {v['prompt']} | {v['cached_tokens']} | {v['cold_s']:.2f} | {v['warm_s']:.2f} | "
                     f"{v['speedup']:.1f}x | {v['snapshot_interval']} |")
    lines += ["", "### Memory per token of context (MLA KV per token + one KDA state per request)", "",
              "| model | layers | KV B/token | KDA state B/request | B/token @4K | @32K | @128K | @1M | "
              "all-MLA B/token | hybrid/all-MLA (long context) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for v in result["memory"]:
        pt = v["per_token"]
        lines.append(f"| {v['model']} | {v['layers']} | {v['kv_b_per_token']:,} | {v['state_b']:,} | "
                     f"{pt[4096]:,.0f} | {pt[32768]:,.0f} | {pt[131072]:,.0f} | {pt[1048576]:,.0f} | "
                     f"{v['all_mla_b_per_token']:,} | {100 * v['ratio_long']:.1f}% |")
    return "\n".join(lines)


def compute_floor(r: dict) -> dict:
    """The workload's compute floor on this machine and the best ratio it leaves against the better baseline."""
    ours = r["ours"]
    rate = gemm_gflops()
    seconds = ours["workload_gflop"] / rate
    tok_s = ours["tok_s"] * ours["seconds"] / seconds  # the same output tokens in the floor's time
    baselines = [v["tok_s"] for k, v in r.items() if k != "ours" and isinstance(v, dict) and "tok_s" in v]
    return {"workload_gflop": ours["workload_gflop"], "gemm_gflops": rate, "seconds": seconds, "tok_s": tok_s,
            "best_possible_ratio": tok_s / max(baselines) if baselines else float("nan")}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", default="small-linear,small-k3")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--hf-single-prompts", type=int, default=4)
    parser.add_argument("--hf-batch-prompts", type=int, default=32)
    parser.add_argument("--ttft-len", type=int, default=4096)
    parser.add_argument("--ttft-cached", type=int, default=3584)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="compute dtype of both sides (bf16 matmuls are ~4x faster on CPUs with AVX512-BF16)")
    parser.add_argument("--memory-preset", default="small-k3")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    rng = random.Random(0)
    prompts = [random_ids(args.input_len, rng) for _ in range(args.num_prompts)]
    result = {"input_len": args.input_len, "output_len": args.output_len, "threads": args.threads, "dtype": args.dtype,
              "throughput": {}, "ttft": {}, "memory": memory_rows(args.memory_preset)}
    with tempfile.TemporaryDirectory() as tmp:
        for preset in [p for p in args.presets.split(",") if p]:
            model_dir = make_checkpoint(preset, Path(tmp) / preset, seed=0)
            r = {"ours": bench_ours(model_dir, prompts, args.output_len, args.dtype)}
            r.update(bench_baselines(preset, model_dir, prompts, args))
            r["floor"] = compute_floor(r)
            first = (r.get("hf_single") or r.get("hf_batched") or r.get("k3ref_single") or r.get("k3ref_batched")
                     or {}).get("first_output")
            if first is not None:
                r["outputs_match"] = first == r["ours"]["first_output"]
            result["throughput"][preset] = r
            if args.ttft_len:
                result["ttft"][preset] = bench_ttft(model_dir, args.ttft_len, args.ttft_cached, rng, args.dtype)
            print(f"[{preset} done]", file=sys.stderr, flush=True)
    for r in result["throughput"].values():
        for v in r.values():
            if isinstance(v, dict):
                v.pop("first_output", None)
    print(_markdown(result))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2, default=str))
    return result


if __name__ == "__main__":
    main()
