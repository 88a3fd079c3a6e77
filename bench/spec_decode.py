"""Speculative decoding vs plain decoding, in the same run: per-user decode tokens/s at batch 1 and throughput at
batch `--batch` (default 32), with and without `--speculative-config` (default: n-gram, k = 3).

Usage: `python -m bench.spec_decode [--preset small-linear] [--model DIR] [--output-len 128] [--batch 32]
[--speculative-config JSON] [--workload prompt-lookup|loop|all] [--repeats 3] [--threads 1] [--out FILE]`

Prompts: each a random 32-token segment repeated four times. Workloads (`WORKLOADS`; the same prompts and sampling
for the plain and the speculative run):
- `prompt-lookup`: plain greedy. The drafter has the prompt's pattern to copy; whether the target repeats it is the
  model's business (a generated, untrained preset does not: its greedy output never repeats the prompt, acceptance
  1.00 — this row measures what failed drafts cost).
- `loop`: greedy with `frequency_penalty` -2 (the OpenAI range's end): every token already generated gains 2 logits
  per occurrence, so the output falls into short loops that prompt lookup predicts (repetitive by construction:
  the random model is not made to copy, its own output is). The table's speed-up is what accepted drafts buy.
Greedy, EOS ignored, every run checks that the speculative outputs equal the plain ones token for token. Batch 1: the
wall time of one request's `--output-len` tokens (prefill included, the same for both), as tokens/s per user. Batch
N: N such requests at once, output tokens/s. Each side runs `--repeats` times in turn, best time kept; acceptance is
that of the last speculative run (deterministic: greedy). Prints a markdown table; `--out` writes the numbers as JSON.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch

from bench.common import model_folder, report

DEFAULT_SPEC = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 4}'


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1000, 5000) for _ in range(32)] * 4 for _ in range(n)]


# workload -> the sampling it adds to greedy decoding (the same for the plain and the speculative run)
WORKLOADS = {
    "prompt-lookup": {},  # the output is whatever the model makes of the repeated segment
    "loop": {"frequency_penalty": -2.0},  # repetitive by construction: the output falls into short loops
    "code": {},  # a trained model (demo-k3) completing held-out standard-library files
    "chat": {"ignore_eos": False},  # a trained model answering rendered chat prompts, until it stops by itself
}
TEXT_WORKLOADS = ("code", "chat")  # prompts from the model's own tokenizer (bench/spec_prompts.py)


def _run(llm, prompts, output_len: int, sampling: dict) -> tuple[float, list[list[int]]]:
    from engine.sampling import SamplingParams

    params = SamplingParams(max_tokens=output_len, temperature=0, **{"ignore_eos": True, **sampling})
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    return time.perf_counter() - start, [o.outputs[0].token_ids for o in outs]


def _workload_prompts(workload: str, batch: int, folder: str) -> list[list[int]]:
    if workload not in TEXT_WORKLOADS:
        return _prompts(batch)
    from bench.spec_prompts import chat_prompts, code_prompts

    return code_prompts(folder, batch) if workload == "code" else chat_prompts(folder, batch)


def _measure(plain, spec, workload: str, batch: int, output_len: int, repeats: int) -> dict | None:
    """One row: plain and speculative in turn on the same prompts and sampling, `repeats` times each, best time of
    each (a shared machine's noise only ever slows a run down); None when the outputs differ."""
    sampling, prompts = WORKLOADS[workload], _workload_prompts(workload, batch, plain.engine.args.model)
    _run(plain, prompts[:1], 4, sampling), _run(spec, prompts[:1], 4, sampling)  # warm-up
    t_plain = t_spec = float("inf")
    for _ in range(repeats):
        t, ids_plain = _run(plain, prompts, output_len, sampling)
        t_plain = min(t_plain, t)
        before = spec.engine.stats()
        t, ids_spec = _run(spec, prompts, output_len, sampling)
        t_spec, after = min(t_spec, t), spec.engine.stats()
        if ids_plain != ids_spec:
            return None
    drafts = after.spec_num_drafts - before.spec_num_drafts
    accepted = after.spec_num_accepted_tokens - before.spec_num_accepted_tokens
    per_pos = [(a - b) / max(drafts, 1) for a, b in zip(after.spec_accepted_per_pos, before.spec_accepted_per_pos)]
    tokens = sum(len(ids) for ids in ids_plain)  # = batch * output_len unless the workload lets requests stop
    return {"workload": workload, "batch": batch, "plain_tok_s": tokens / t_plain, "spec_tok_s": tokens / t_spec,
            "speedup": t_plain / t_spec, "mean_acceptance_length": 1 + accepted / max(drafts, 1),
            "acceptance_per_pos": per_pos, "distinct_output_tokens": len({t for ids in ids_plain for t in ids})}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="small-linear")
    p.add_argument("--model", default=None)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--speculative-config", default=DEFAULT_SPEC)
    p.add_argument("--workload", choices=[*WORKLOADS, "all"], default="all")
    p.add_argument("--repeats", type=int, default=3, help="runs of each side per row (best time)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    from engine.llm import LLM

    folder = str(model_folder(args))
    engine = dict(max_num_seqs=max(args.batch, 1), kv_cache_memory="2GiB", max_num_batched_tokens=4096)
    plain, spec = LLM(folder, **engine), LLM(folder, **engine, speculative_config=args.speculative_config)
    rows = []
    default = [w for w in WORKLOADS if w not in TEXT_WORKLOADS]  # "all": the workloads any model can run
    for workload in default if args.workload == "all" else [args.workload]:
        for batch in (1, args.batch):
            row = _measure(plain, spec, workload, batch, args.output_len, args.repeats)
            if row is None:
                print(f"{workload}, batch {batch}: speculative output differs from plain", file=sys.stderr)
                return 1
            rows.append(row)
    table = ["| workload | batch | plain tok/s | speculative tok/s | ratio | mean acceptance length | per position | "
             "distinct output tokens |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    table += [f"| {r['workload']} | {r['batch']} | {r['plain_tok_s']:.1f} | {r['spec_tok_s']:.1f} | "
              f"{r['speedup']:.2f}x | {r['mean_acceptance_length']:.2f} | "
              f"{', '.join(f'{x:.2f}' for x in r['acceptance_per_pos'])} | {r['distinct_output_tokens']} |"
              for r in rows]
    return report("\n".join(table), args, rows)


if __name__ == "__main__":
    sys.exit(main())
