"""Fair share of the running slots (issue 27): a short request of tenant B while tenant A fills every slot.

Usage: `python -m bench.bench_fair_share [--preset tiny-k3] [--flood 64] [--flood-tokens 512] [--short-tokens 8]
[--shorts 8] [--threads 1] [--out FILE]`

One `EngineCore` (`--flood` slots, greedy, EOS ignored) on the preset's generated checkpoint, three arms in the same
process after a warm-up run of the first: `idle` (B's short requests alone), `fair` (A's flood of `--flood` requests
of `--flood-tokens` tokens; once all run, B sends `--shorts` short requests at once, each of `--short-tokens`
tokens, as its own tenant) and `unfair` (the same, B's requests sent under A's tenant: what an engine without fair
share does, B waits for one of A's slots). Reported per arm: B's latency (median, max; seconds and engine steps from
its arrival to its last token), A's output tokens per second, the preemptions, and whether A's outputs equal the
unfair arm's (preempted requests continue exactly). Prints a markdown table; `--out` writes the numbers as JSON.
The issue's own measure, through a launched mesh, is bench/bench_fair_share_mesh.py.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from bench.common import model_folder, report
from engine.config import EngineArgs
from engine.core import EngineCore
from engine.fair_share import TenantShare
from engine.sampling import SamplingParams


def _params(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


def _add_shorts(engine: EngineCore, tenant: str, args) -> None:
    for k in range(args.shorts):
        engine.add_request(f"b{k}", {"prompt_token_ids": [11 + k, 12, 13, 14, 15, 16]}, _params(args.short_tokens),
                           tenant=TenantShare(tenant))


def _arm(engine: EngineCore, short_tenant: str, args, flood: int) -> dict:
    """`flood` requests of tenant A; once all run, B's short requests all at once -> B's latencies (seconds and
    steps from their arrival), A's outputs and tokens per second, the preemptions."""
    rng = random.Random(0)
    for i in range(flood):
        engine.add_request(f"a{i}", {"prompt_token_ids": [rng.randrange(7000) for _ in range(16)]},
                           _params(args.flood_tokens), tenant=TenantShare("a"))
    fair_before, pre_before = engine.stats().num_fair_preemptions, engine.stats().num_preemptions
    outputs, latencies, tokens, start, steps = {}, [], 0, None, 0
    while start is None or engine.has_unfinished_requests():
        if start is None and len(engine.scheduler.running) == flood:  # with no flood: at once
            _add_shorts(engine, short_tenant, args)
            start, steps = time.perf_counter(), 0
        steps += 1
        for out in engine.step():
            if out.finished and out.request_id.startswith("b"):
                latencies.append((time.perf_counter() - start, steps))
            elif out.finished:
                outputs[out.request_id] = out.outputs[0].token_ids
                tokens += len(out.outputs[0].token_ids)
    stats = engine.stats()
    return {"latency_s": [s for s, _ in latencies], "latency_steps": [n for _, n in latencies], "outputs": outputs,
            "a_tokens_per_s": tokens / (time.perf_counter() - start) if flood else 0.0,
            "fair_preemptions": stats.num_fair_preemptions - fair_before,
            "preemptions": stats.num_preemptions - pre_before}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny-k3")
    parser.add_argument("--model", default=None)
    parser.add_argument("--flood", type=int, default=64)
    parser.add_argument("--flood-tokens", type=int, default=512)
    parser.add_argument("--short-tokens", type=int, default=8)
    parser.add_argument("--shorts", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    engine = EngineCore(EngineArgs(model=str(model_folder(args)), max_num_seqs=args.flood,
                                   kv_cache_memory=256 << 20, max_num_batched_tokens=2048))
    _arm(engine, "b", args, 0)  # warm-up: the first steps of a process pay one-time costs (weight packing)
    idle = _arm(engine, "b", args, 0)
    arms = {"fair": _arm(engine, "b", args, args.flood), "unfair": _arm(engine, "a", args, args.flood)}
    rows = {"idle": {k: v for k, v in idle.items() if k != "outputs"}}
    lines = ["| arm | B latency median (s) | B latency max (s) | B steps median | x idle | A tokens/s | "
             "fair preemptions | A outputs = unfair arm's |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    idle_s = statistics.median(rows["idle"]["latency_s"])
    lines.append(f"| idle (B's {args.shorts} alone) | {idle_s:.3f} | {max(rows['idle']['latency_s']):.3f} | "
                 f"{statistics.median(rows['idle']['latency_steps'])} | 1.0 | - | - | - |")
    for name, arm in arms.items():
        med = statistics.median(arm["latency_s"])
        lines.append(f"| {name} | {med:.3f} | {max(arm['latency_s']):.3f} | {statistics.median(arm['latency_steps'])}"
                     f" | {med / idle_s:.1f} | {arm['a_tokens_per_s']:.0f} | {arm['fair_preemptions']} | "
                     f"{arm['outputs'] == arms['unfair']['outputs']} |")
        rows[name] = {k: v for k, v in arm.items() if k != "outputs"}
    return report("\n".join(lines), args, rows)


if __name__ == "__main__":
    sys.exit(main())
