"""Full-model prefill throughput and decode step time: ours vs a reference implementation, same process.

Usage: `python -m bench.bench_model [--preset small-linear] [--prompt-len 4096] [--decode-steps 16] [--out FILE]`

Both models load the same generated checkpoint in fp32 and run with the same torch thread count. The reference is
transformers' `KimiLinearForCausalLM` (pure-torch KDA, `fla` blocked) for `kimi_linear` presets and the official
Kimi K3 modeling code with pure-torch `fla` stand-ins (tests/reference) for `kimi_k3` presets. Reported: prefill
tokens/s, decode step ms at the end of the prompt, and the ratio ours/reference.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.common import best_time
from engine.model.checkpoint import make_checkpoint
from engine.model.loader import LoadConfig, load_model
from tests.model_driver import SequenceDriver


def bench_ours(model_dir: Path, tokens: list[int], decode_steps: int) -> dict:
    model = load_model(model_dir, LoadConfig(dtype="float32"))
    driver = SequenceDriver(model, max_seqs=1, max_len=len(tokens) + decode_steps + 16)
    prefill_s = best_time(lambda: driver.prefill(0, tokens, all_logits=False))
    start = time.perf_counter()
    for i in range(decode_steps):
        driver.decode(0, tokens[i])
    decode_s = (time.perf_counter() - start) / decode_steps
    return {"prefill_s": prefill_s, "prefill_tok_s": len(tokens) / prefill_s, "decode_ms": decode_s * 1e3}


def _reference_model(model_dir: Path, family: str):
    if family == "kimi_linear":
        sys.modules["fla"] = None  # transformers' pure-torch KDA
        from transformers import KimiLinearForCausalLM

        return KimiLinearForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    from tests.reference.k3_reference import load_reference_k3

    return load_reference_k3(model_dir)


def bench_reference(model_dir: Path, family: str, tokens: list[int], decode_steps: int) -> dict:
    ref = _reference_model(model_dir, family)
    ids = torch.tensor([tokens])
    out = {}
    with torch.no_grad():
        start = time.perf_counter()
        result = ref(ids, use_cache=True)
        out["prefill_s"] = time.perf_counter() - start
        cache = getattr(result, "past_key_values", None) or getattr(result, "cache", None)
        start = time.perf_counter()
        for i in range(decode_steps):
            step = ref(torch.tensor([[tokens[i]]]), past_key_values=cache, use_cache=True)
            cache = getattr(step, "past_key_values", None) or getattr(step, "cache", None)
        out["decode_ms"] = (time.perf_counter() - start) / decode_steps * 1e3
    out["prefill_tok_s"] = len(tokens) / out["prefill_s"]
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small-linear")
    parser.add_argument("--prompt-len", type=int, default=4096)
    parser.add_argument("--decode-steps", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--skip-reference", action="store_true")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_checkpoint(args.preset, Path(tmp) / args.preset, seed=0)
        family = json.loads((model_dir / "config.json").read_text())["model_type"]
        tokens = torch.randint(0, 7900, (args.prompt_len,), generator=gen).tolist()
        result = {"preset": args.preset, "prompt_len": args.prompt_len, "threads": args.threads,
                  "ours": bench_ours(model_dir, tokens, args.decode_steps)}
        if not args.skip_reference:
            result["reference"] = bench_reference(model_dir, family, tokens, args.decode_steps)
            result["prefill_speedup"] = result["reference"]["prefill_s"] / result["ours"]["prefill_s"]
            result["decode_speedup"] = result["reference"]["decode_ms"] / result["ours"]["decode_ms"]
    print(_markdown(result))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    return result


def _markdown(r: dict) -> str:
    rows = ["| impl | prefill s | prefill tok/s | decode step ms |", "|---|---|---|---|"]
    for name in ("ours", "reference"):
        if name in r:
            v = r[name]
            rows.append(f"| {name} | {v['prefill_s']:.2f} | {v['prefill_tok_s']:.0f} | {v['decode_ms']:.1f} |")
    if "prefill_speedup" in r:
        rows.append(f"\nspeedup (reference / ours): prefill {r['prefill_speedup']:.1f}×, "
                    f"decode {r['decode_speedup']:.1f}×")
    return f"### {r['preset']}, {r['prompt_len']}-token prompt, {r['threads']} threads\n" + "\n".join(rows)


if __name__ == "__main__":
    main()
