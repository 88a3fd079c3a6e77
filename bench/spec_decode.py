"""Speculative decoding vs plain decoding, in the same run: per-user decode tokens/s at batch 1 and throughput at
batch `--batch` (default 32), with and without `--speculative-config` (default: n-gram, k = 3).

Usage: `python -m bench.spec_decode [--preset small-linear] [--model DIR] [--output-len 128] [--batch 32]
[--speculative-config JSON] [--workload prompt-lookup|loop|all] [--repeats 3] [--threads 1] [--out FILE]
[--verify-cost] [--draft-cost] [--compilation-config JSON]`

Prompts: each a random 32-token segment repeated four times. Workloads (`WORKLOADS`; the same prompts and sampling
for the plain and the speculative run):
- `prompt-lookup`: plain greedy. The drafter has the prompt's pattern to copy; whether the target repeats it is the
  model's business (a generated, untrained preset does not: its greedy output never repeats the prompt, acceptance
  1.00 — this row measures what failed drafts cost).
- `loop`: greedy with `frequency_penalty` -2 (the OpenAI range's end): every token already generated gains 2 logits
  per occurrence, so the output falls into short loops that prompt lookup predicts (repetitive by construction:
  the random model is not made to copy, its own output is). The table's speed-up is what accepted drafts buy.
Greedy, EOS ignored, every run checks that the speculative outputs equal the plain ones token for token. Batch 1: the
wall time of `--solo-requests` requests (default 1) run one after another, `--output-len` tokens each (prefill
included, the same for both), as tokens/s per user; `decode-phase ratio` leaves out each side's time to the first
token (the same requests with one output token, timed alone). Batch N: N such requests at once, output tokens/s. Each side runs once untimed (the warm-up: a compiled engine builds
its graphs there), then `--repeats` times in turn, best time kept; acceptance is
that of the last speculative run (deterministic: greedy). `CPU-time ratio` is the same ratio of the process's CPU
time (with one torch thread: robust on a loaded machine, where wall time includes waiting for a core). Each row
also gives the drafter's own wall time per step
(`draft ms/step`: its `propose`, `observe`, `rollback` and `release` calls in the best speculative run, divided by
the steps it proposed in). Prints a markdown table; `--out` writes the numbers as JSON.

`--compilation-config` is the engines' (plain and speculative alike; default: the engine's, eager on CPU):
`'{"level": 3, "cudagraph_capture_sizes": [1, 8]}'` compiles decode and verification steps (engine/decode_graphs.py;
a verification runs compiled when every row verifies the same number of drafts); the warm-up builds each bucket.

`--verify-cost` measures instead what one verification step costs against a plain decode step, at batch 1: the same
engine decodes one request plain and with a drafter that proposes `num_speculative_tokens` tokens every step (all
rejected: every step verifies k + 1 positions and emits one token); the median wall time of a decode step
(`EngineCore.step`, sampling and acceptance included) of each, and their ratio, by wall and by CPU time. `--draft-cost` times the drafter of
`--speculative-config` alone (`draft_cost`: `--output-len` steps of `propose` + `observe` at batch 1 and `--batch`).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from bench.common import model_folder, op_counter, report
from engine.spec.drafter import Draft, Drafter

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


def _run(llm, prompts, output_len: int, sampling: dict, one_at_a_time: bool = False
         ) -> tuple[float, float, list[list[int]]]:
    """-> (wall seconds, process CPU seconds, output ids); `one_at_a_time`: each prompt alone (batch 1)."""
    from engine.sampling import SamplingParams

    params = SamplingParams(max_tokens=output_len, temperature=0, **{"ignore_eos": True, **sampling})
    start, start_cpu = time.perf_counter(), time.process_time()
    outs = [o for p in prompts for o in llm.generate([p], params)] if one_at_a_time else llm.generate(prompts, params)
    return time.perf_counter() - start, time.process_time() - start_cpu, [o.outputs[0].token_ids for o in outs]


def _workload_prompts(workload: str, batch: int, folder: str) -> list[list[int]]:
    if workload not in TEXT_WORKLOADS:
        return _prompts(batch)
    from bench.spec_prompts import chat_prompts, code_prompts

    return code_prompts(folder, batch) if workload == "code" else chat_prompts(folder, batch)


class DraftClock:
    """Wall time the drafter of a speculative `LLM` spends in its own calls (wraps them on the instance)."""

    CALLS = ("propose", "observe", "rollback", "release")

    def __init__(self, llm):
        self.seconds, self.proposals = 0.0, 0
        drafter = llm.engine.spec.drafter
        for name in self.CALLS:
            setattr(drafter, name, self._timed(getattr(drafter, name), name == "propose"))

    def _timed(self, call, counts: bool):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return call(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
                self.proposals += counts
        return timed

    def reset(self) -> None:
        self.seconds, self.proposals = 0.0, 0

    @property
    def ms_per_step(self) -> float:
        return 1000 * self.seconds / max(self.proposals, 1)


def _measure(plain, spec, workload: str, batch: int, output_len: int, repeats: int, solo: int = 1) -> dict | None:
    """One row: plain and speculative in turn on the same prompts and sampling, `repeats` times each, best time of
    each (a shared machine's noise only ever slows a run down); None when the outputs differ. Batch 1 runs `solo`
    prompts one after another, and times their first tokens alone too (the prefill: `decode_speedup` leaves it
    out)."""
    alone = batch == 1
    sampling = WORKLOADS[workload]
    prompts = _workload_prompts(workload, solo if alone else batch, plain.engine.args.model)
    # warm-up: one whole untimed run each, so a compiled engine builds every graph the timed runs use (a 4-token,
    # one-prompt warm-up left the verification graphs' build to the first timed runs)
    _run(plain, prompts, output_len, sampling, alone), _run(spec, prompts, output_len, sampling, alone)
    t_plain = t_spec = cpu_plain = cpu_spec = first_plain = first_spec = float("inf")
    clock, draft_ms = DraftClock(spec), 0.0
    for _ in range(repeats):
        t, cpu, ids_plain = _run(plain, prompts, output_len, sampling, alone)
        t_plain, cpu_plain = min(t_plain, t), min(cpu_plain, cpu)
        before = spec.engine.stats()
        clock.reset()
        t, cpu, ids_spec = _run(spec, prompts, output_len, sampling, alone)
        draft_ms = clock.ms_per_step if t < t_spec else draft_ms
        t_spec, cpu_spec, after = min(t_spec, t), min(cpu_spec, cpu), spec.engine.stats()
        if ids_plain != ids_spec:
            return None
        if alone:
            first_plain = min(first_plain, _run(plain, prompts, 1, sampling, alone)[0])
            first_spec = min(first_spec, _run(spec, prompts, 1, sampling, alone)[0])
    drafts = after.spec_num_drafts - before.spec_num_drafts
    accepted = after.spec_num_accepted_tokens - before.spec_num_accepted_tokens
    per_pos = [(a - b) / max(drafts, 1) for a, b in zip(after.spec_accepted_per_pos, before.spec_accepted_per_pos)]
    tokens = sum(len(ids) for ids in ids_plain)  # = batch * output_len unless the workload lets requests stop
    return {"workload": workload, "batch": batch, "plain_tok_s": tokens / t_plain, "spec_tok_s": tokens / t_spec,
            "speedup": t_plain / t_spec, "cpu_speedup": cpu_plain / cpu_spec, "draft_ms_per_step": draft_ms,
            "decode_speedup": (t_plain - first_plain) / (t_spec - first_spec) if alone else None,
            "requests": len(prompts), "mean_acceptance_length": 1 + accepted / max(drafts, 1),
            "acceptance_per_pos": per_pos, "distinct_output_tokens": len({t for ids in ids_plain for t in ids})}


class RejectedDrafter(Drafter):
    """Proposes `k` copies of one token every step: what a verification costs when nothing is accepted."""

    def __init__(self, k: int, token: int = 0):
        self.k, self.token = k, token

    def propose(self, queries):
        return [Draft((self.token,) * min(q.num_tokens, self.k)) for q in queries]


def _step_times(llm, prompt: list[int], steps: int) -> list[tuple[float, float]]:
    """(wall, process CPU) seconds of each decode step of one greedy request (its prefill step left out)."""
    from engine.sampling import SamplingParams

    llm.engine.add_request(f"verify-cost-{time.perf_counter_ns()}", prompt,
                           SamplingParams(max_tokens=steps + 1, temperature=0, ignore_eos=True))
    times = []
    while llm.engine.has_unfinished_requests():
        start, start_cpu = time.perf_counter(), time.process_time()
        llm.engine.step()
        times.append((time.perf_counter() - start, time.process_time() - start_cpu))
    return times[1:]


def verify_cost(folder: str, k: int, steps: int, repeats: int, compilation_config: str | None = None) -> dict:
    """Median decode-step time (wall and CPU), plain and verifying k drafts, one request: the best median of
    `repeats` runs each (the first run of each also builds its compiled step: `repeats` ≥ 2 with a
    `compilation_config`)."""
    from engine.llm import LLM

    engine = dict(max_num_seqs=1, kv_cache_memory="512MiB", max_num_batched_tokens=1024,
                  compilation_config=compilation_config)
    plain = LLM(folder, **engine)
    spec = LLM(folder, **engine, speculative_config={"method": "ngram", "num_speculative_tokens": k})
    spec.engine.spec.drafter = RejectedDrafter(k)
    prompt = _prompts(1)[0]
    best = {(name, clock): float("inf") for name in ("plain", "verify") for clock in (0, 1)}
    for _ in range(repeats):
        for name, llm in (("plain", plain), ("verify", spec)):
            times = _step_times(llm, prompt, steps)
            for clock in (0, 1):
                best[name, clock] = min(best[name, clock], statistics.median(t[clock] for t in times))
    return {"k": k, "plain_ms": 1000 * best["plain", 0], "verify_ms": 1000 * best["verify", 0],
            "ratio": best["verify", 0] / best["plain", 0], "plain_cpu_ms": 1000 * best["plain", 1],
            "verify_cpu_ms": 1000 * best["verify", 1], "cpu_ratio": best["verify", 1] / best["plain", 1]}


def draft_cost(folder: str, spec_json: str, batch: int, steps: int, prompt_len: int = 128, accepted: int = 2,
               compilation_config: str | None = None) -> dict:
    """The drafter alone (no target step): `batch` requests that observed `prompt_len` positions, then per step one
    `propose` for all of them and each request's `observe` of `accepted + 1` positions (as after a verification
    that accepted `accepted` drafts). Hidden rows are seeded noise in the target's dtype (drafting cost does not
    depend on their values); the drafter's step compiles as an engine with `compilation_config` would compile it
    (its first steps build the graphs: the median leaves them out). -> per step (propose + observes): median wall ms, median process CPU ms (robust on
    a loaded machine: time spent waiting for a core is not counted) and the aten calls of one step."""
    import importlib

    from engine.compilation import CompilationConfig
    from engine.model.loader import load_model
    from engine.spec.config import SpeculativeConfig, factory_path
    from engine.spec.drafter import DraftQuery, DraftTarget

    config = SpeculativeConfig.parse(spec_json)
    model = load_model(folder)
    module, func = factory_path(config.method).split(":")
    target = DraftTarget(model=model, model_dir=folder, device=model.device, dtype=model.dtype,
                         max_model_len=prompt_len + (steps + 1) * (accepted + 1) + 64, max_num_seqs=batch,
                         compilation=CompilationConfig.parse(compilation_config))
    drafter = getattr(importlib.import_module(module), func)(config, target)
    gen = torch.Generator().manual_seed(0)
    width = len(drafter.taps) * model.config.hidden_size
    vocab = model.config.vocab_size

    def noise(n: int) -> torch.Tensor:
        return torch.randn(n, width, generator=gen).to(model.dtype)

    seqs = [torch.randint(0, vocab, (prompt_len,), generator=gen).tolist() for _ in range(batch)]
    for i, ids in enumerate(seqs):
        drafter.observe(f"r{i}", 0, ids, noise(len(ids)))
        ids.append(int(torch.randint(0, vocab, (1,), generator=gen)))
    inputs = [[(torch.randint(0, vocab, (accepted + 1,), generator=gen).tolist(), noise(accepted + 1))
               for _ in seqs] for _ in range(steps + 1)]

    def step(new_rows) -> None:
        drafter.propose([DraftQuery(f"r{i}", ids, config.num_speculative_tokens) for i, ids in enumerate(seqs)])
        for i, (ids, (new, hidden)) in enumerate(zip(seqs, new_rows)):
            drafter.observe(f"r{i}", len(ids) - 1, [ids[-1]] + new[:-1], hidden)
            ids.extend(new)

    wall, cpu = [], []
    for new_rows in inputs[:-1]:
        start, start_cpu = time.perf_counter(), time.process_time()
        step(new_rows)
        wall.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    with op_counter() as ops:
        step(inputs[-1])
    return {"method": config.method, "batch": batch, "draft_ms_per_step": 1000 * statistics.median(wall),
            "draft_cpu_ms_per_step": 1000 * statistics.median(cpu), "aten_calls_per_step": ops.count}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="small-linear")
    p.add_argument("--model", default=None)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--speculative-config", default=DEFAULT_SPEC)
    p.add_argument("--workload", choices=[*WORKLOADS, "all"], default="all")
    p.add_argument("--repeats", type=int, default=3, help="runs of each side per row (best time)")
    p.add_argument("--solo-requests", type=int, default=1,
                   help="batch 1: this many prompts, one after another (per-user tok/s over all of them)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--verify-cost", action="store_true", help="a (k+1)-position verify step vs a plain step")
    p.add_argument("--draft-cost", action="store_true", help="the drafter's own time per step at batch 1 and --batch")
    p.add_argument("--compilation-config", default=None,
                   help="the engines' --compilation-config JSON (default: the engine's, eager on CPU)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    from engine.llm import LLM

    folder = str(model_folder(args))
    if args.verify_cost:
        k = json.loads(args.speculative_config)["num_speculative_tokens"]
        r = verify_cost(folder, k, args.output_len, args.repeats, args.compilation_config)
        table = ("| k | plain step ms | verify step ms | ratio | plain CPU ms | verify CPU ms | CPU ratio |\n"
                 "| --- | --- | --- | --- | --- | --- | --- |\n"
                 f"| {r['k']} | {r['plain_ms']:.2f} | {r['verify_ms']:.2f} | {r['ratio']:.2f}x | "
                 f"{r['plain_cpu_ms']:.2f} | {r['verify_cpu_ms']:.2f} | {r['cpu_ratio']:.2f}x |")
        return report(table, args, r)
    if args.draft_cost:
        rows = [draft_cost(folder, args.speculative_config, b, args.output_len, compilation_config=args.compilation_config)
                for b in (1, args.batch)]
        table = ("| method | batch | draft ms/step (wall) | CPU ms/step | aten calls/step |\n"
                 "| --- | --- | --- | --- | --- |\n") + "\n".join(
            f"| {r['method']} | {r['batch']} | {r['draft_ms_per_step']:.2f} | {r['draft_cpu_ms_per_step']:.2f} | "
            f"{r['aten_calls_per_step']} |" for r in rows)
        return report(table, args, rows)
    engine = dict(max_num_seqs=max(args.batch, 1), kv_cache_memory="2GiB", max_num_batched_tokens=4096,
                  compilation_config=args.compilation_config)
    plain, spec = LLM(folder, **engine), LLM(folder, **engine, speculative_config=args.speculative_config)
    rows = []
    default = [w for w in WORKLOADS if w not in TEXT_WORKLOADS]  # "all": the workloads any model can run
    for workload in default if args.workload == "all" else [args.workload]:
        for batch in (1, args.batch):
            row = _measure(plain, spec, workload, batch, args.output_len, args.repeats, args.solo_requests)
            if row is None:
                print(f"{workload}, batch {batch}: speculative output differs from plain", file=sys.stderr)
                return 1
            rows.append(row)
    table = ["| workload | batch | plain tok/s | speculative tok/s | ratio | CPU-time ratio | decode-phase ratio | "
             "draft ms/step | mean acceptance length | per position | distinct output tokens |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    table += [f"| {r['workload']} | {r['batch']} | {r['plain_tok_s']:.1f} | {r['spec_tok_s']:.1f} | "
              f"{r['speedup']:.2f}x | {r['cpu_speedup']:.2f}x | "
              f"{'-' if r['decode_speedup'] is None else format(r['decode_speedup'], '.2f') + 'x'} | "
              f"{r['draft_ms_per_step']:.2f} | "
              f"{r['mean_acceptance_length']:.2f} | "
              f"{', '.join(f'{x:.2f}' for x in r['acceptance_per_pos'])} | {r['distinct_output_tokens']} |"
              for r in rows]
    return report("\n".join(table), args, rows)


if __name__ == "__main__":
    sys.exit(main())
