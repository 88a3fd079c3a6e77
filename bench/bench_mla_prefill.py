"""MLA prefill: the absorbed form vs the non-absorbed one (kernels/attention/mla_prefill.py), same model, same run.

Usage: `python -m bench.bench_mla_prefill [--preset small-k3] [--lengths 1024,8192] [--repeats 2]`

Loads the generated preset (seed 1, under /tmp/kdamesh-bench), then per prompt length prefills one sequence in
2048-token chunks (the engine's CPU forward size) with every MLA layer forced absorbed, and with the default
break-even (`non_absorbed_min_queries`), the two interleaved `--repeats` times; reports tokens per CPU second
(`time.process_time`, 1 torch thread: the machine is shared) and the ratio.
"""

from __future__ import annotations

import argparse
import time

import torch

from engine.model.checkpoint import make_checkpoint
from engine.model.loader import load_model
from tests.model_driver import SequenceDriver

CHUNK = 2048


def _prefill_seconds(model, prompt: list[int]) -> float:
    driver = SequenceDriver(model, max_seqs=1, max_len=len(prompt) + 16)
    t0 = time.process_time()
    for a in range(0, len(prompt), CHUNK):
        driver.prefill(0, prompt[a:a + CHUNK], all_logits=False)
    return time.process_time() - t0


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small-k3")
    parser.add_argument("--lengths", default="1024,8192")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    model = load_model(make_checkpoint(args.preset, f"/tmp/kdamesh-bench/{args.preset}", seed=1))
    mixers = [layer.self_attn for layer in model.model.layers if layer.spec.mixer == "mla"]
    default = mixers[0].min_prefill_queries
    print(f"| prompt tokens | absorbed tok/s | non-absorbed tok/s | ratio |  ({args.preset}, break-even {default})")
    print("|---|---|---|---|")
    for n in (int(x) for x in args.lengths.split(",")):
        prompt = [(37 * i + 11) % 7900 for i in range(n)]
        best = {}
        for _ in range(args.repeats):
            for name, min_queries in (("absorbed", 1 << 30), ("non-absorbed", default)):
                for m in mixers:
                    m.min_prefill_queries = min_queries
                seconds = _prefill_seconds(model, prompt)
                best[name] = min(best.get(name, seconds), seconds)
        a, b = best["absorbed"], best["non-absorbed"]
        print(f"| {n} | {n / a:.0f} | {n / b:.0f} | {a / b:.2f}× |", flush=True)


if __name__ == "__main__":
    main()
