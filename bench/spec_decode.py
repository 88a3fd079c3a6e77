"""Speculative decoding vs plain decoding, in the same run: per-user decode tokens/s at batch 1 and throughput at
batch `--batch` (default 32), with and without `--speculative-config` (default: n-gram, k = 3).

Usage: `python -m bench.spec_decode [--preset small-linear] [--model DIR] [--output-len 128] [--batch 32]
[--speculative-config JSON] [--threads 1] [--out FILE]`

Workload ("repetitive output"): each prompt is a random 32-token segment repeated four times, so the prompt-lookup
drafter has a pattern to copy; whether the target repeats it is the model's business (a generated, untrained
preset copies less than a trained model would), and the tables report the acceptance this run measured. Greedy,
EOS ignored, every run checks that the speculative outputs equal the plain ones token for token. Batch 1: the
wall time of one request's `--output-len` tokens (prefill included, the same for both), as tokens/s per user. Batch
N: N such requests at once, output tokens/s. Prints a markdown table; `--out` writes the numbers as JSON.
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


def _run(llm, prompts, output_len: int) -> tuple[float, list[list[int]]]:
    from engine.sampling import SamplingParams

    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    return time.perf_counter() - start, [o.outputs[0].token_ids for o in outs]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="small-linear")
    p.add_argument("--model", default=None)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--speculative-config", default=DEFAULT_SPEC)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    from engine.llm import LLM

    folder = str(model_folder(args))
    engine = dict(max_num_seqs=max(args.batch, 1), kv_cache_memory="2GiB", max_num_batched_tokens=4096)
    plain, spec = LLM(folder, **engine), LLM(folder, **engine, speculative_config=args.speculative_config)
    rows = []
    for batch in (1, args.batch):
        prompts = _prompts(batch)
        _run(plain, prompts[:1], 4), _run(spec, prompts[:1], 4)  # warm-up
        before = spec.engine.stats()
        t_plain, ids_plain = _run(plain, prompts, args.output_len)
        t_spec, ids_spec = _run(spec, prompts, args.output_len)
        after = spec.engine.stats()
        if ids_plain != ids_spec:
            print("speculative output differs from plain", file=sys.stderr)
            return 1
        drafts = after.spec_num_drafts - before.spec_num_drafts
        accepted = after.spec_num_accepted_tokens - before.spec_num_accepted_tokens
        per_pos = [(a - b) / max(drafts, 1) for a, b in zip(after.spec_accepted_per_pos, before.spec_accepted_per_pos)]
        tokens = batch * args.output_len
        rows.append({"batch": batch, "plain_tok_s": tokens / t_plain, "spec_tok_s": tokens / t_spec,
                     "speedup": t_plain / t_spec, "mean_acceptance_length": 1 + accepted / max(drafts, 1),
                     "acceptance_per_pos": per_pos})
    table = ["| batch | plain tok/s | speculative tok/s | ratio | mean acceptance length | per position |",
             "| --- | --- | --- | --- | --- | --- |"]
    table += [f"| {r['batch']} | {r['plain_tok_s']:.1f} | {r['spec_tok_s']:.1f} | {r['speedup']:.2f}x | "
              f"{r['mean_acceptance_length']:.2f} | {', '.join(f'{x:.2f}' for x in r['acceptance_per_pos'])} |"
              for r in rows]
    return report("\n".join(table), args, rows)


if __name__ == "__main__":
    sys.exit(main())
