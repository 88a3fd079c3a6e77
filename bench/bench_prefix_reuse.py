"""Hybrid prefix reuse vs today's snapshot policy, same process, same run: hit rates, TTFT and snapshot memory.

Usage: `python -m bench.bench_prefix_reuse [--preset small-k3] [--threads 1] [--out FILE]`

One `EngineCore` per policy on the same generated checkpoint (fp32, greedy, EOS ignored), driven by closed-loop
clients in process (a client sends its next request when its previous one finishes, as `vllm bench serve
--max-concurrency` does):
- `prefix_repetition`: the issue's workload — `--num-prefixes` (4) random prefixes of `--prefix-len` (512) tokens,
  each followed by `num_prompts / num_prefixes` random suffixes of `--suffix-len` (64), `--output-len` (8) tokens
  out, `--num-prompts` (32) shuffled prompts, `--concurrency` (4) clients (servebench/datasets.py, token ids).
  Reported: the share of the reusable shared-prefix tokens (the prefix of every prompt after the first with that
  prefix) served from the cache, the prompt-token hit rate, and TTFT (mean, p50, p90). No structure hints: only
  junctions can help here (a completions request of token ids carries none).
- `chat`: `--conversations` (8) clients, each a conversation of `--turns` (6) turns sharing one system prompt, rendered
  with the K3 chat format (gateway/chat/k3.py); turn t+1 = turn t's prompt + its response + a new user message (and
  the generation prompt); the structure hints the gateway will send (where the system block and every earlier
  message end). Reported: the share of the previous turns' tokens (prompt + response of turn t, for turn t+1) served
  from the cache, the system prompt's hit on first turns, and TTFT per turn.
Policies: `periodic` (snapshots at prompt ends and every `snapshot_interval` — the behaviour before this issue) and
`hybrid` (also structure hints, junctions, turn ends). Snapshot memory per policy: snapshot copies made and the bytes
held at the end, per request. Prints markdown tables; `--out` writes the numbers as JSON.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections.abc import Generator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.config import EngineArgs
from engine.core import EngineCore
from engine.sampling import SamplingParams

POLICIES = ("periodic", "hybrid")


@dataclass(frozen=True)
class Job:
    prompt: list[int]
    max_tokens: int
    hints: tuple[int, ...] = ()
    reusable: int = 0  # leading prompt tokens an earlier request of the workload computed (what may be reused)
    kind: str = ""  # what the reusable tokens are: "prefix" | "system" (a first turn) | "history" (a later turn)


@dataclass
class Result:
    job: Job
    output: list[int] = field(default_factory=list)
    cached: int = 0
    ttft_s: float = 0.0


Client = Generator[Job, Result, None]


def checkpoint(preset: str, model: str | None) -> Path:
    if model:
        return Path(model)
    from deploy.checkpoints import kdamesh_home
    from engine.model.checkpoint import make_checkpoint

    folder = kdamesh_home() / "checkpoints" / preset
    if not (folder / "config.json").is_file():
        make_checkpoint(preset, folder)
    return folder


def run_clients(engine: EngineCore, clients: list[Client]) -> list[Result]:
    """Drives closed-loop clients to the end; results in completion order."""
    active: dict[str, tuple[Client, Result, float]] = {}
    done: list[Result] = []
    ids = iter(range(1 << 30))

    def submit(client: Client, job: Job | None) -> None:
        if job is None:
            return
        rid = f"r{next(ids)}"
        params = SamplingParams(max_tokens=job.max_tokens, temperature=0, ignore_eos=True)
        engine.add_request(rid, {"prompt_token_ids": job.prompt}, params, snapshot_hints=job.hints)
        active[rid] = (client, Result(job), time.perf_counter())

    for client in clients:
        submit(client, next(client, None))
    while active:
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            client, result, t0 = active[out.request_id]
            if not result.output:
                result.ttft_s, result.cached = now - t0, out.num_cached_tokens
            result.output.extend(out.outputs[0].delta_token_ids)
            if out.finished:
                del active[out.request_id]
                done.append(result)
                try:
                    submit(client, client.send(result))
                except StopIteration:
                    pass
    return done


# -- workloads ---------------------------------------------------------------------------------------------------


def prefix_repetition_jobs(tokenizer, args: argparse.Namespace) -> list[Job]:
    from bench.serve.datasets import sample_prefix_repetition

    requests = sample_prefix_repetition(tokenizer, args.num_prompts, prefix_len=args.prefix_len,
                                        suffix_len=args.suffix_len, num_prefixes=args.num_prefixes,
                                        output_len=args.output_len, token_ids=True, seed=args.seed)
    seen, jobs = set(), []
    for r in requests:
        prefix = tuple(r.prompt_token_ids[: args.prefix_len])
        reusable = args.prefix_len if prefix in seen else 0
        jobs.append(Job(list(r.prompt_token_ids), r.expected_output_len, reusable=reusable, kind="prefix"))
        seen.add(prefix)
    return jobs


def queue_client(queue: list[Job]) -> Client:
    while queue:
        yield queue.pop(0)


def chat_client(renderer, system: dict, users: list[str], output_len: int, first: bool) -> Client:
    """One conversation: each turn extends the previous prompt with its response and a new user message."""
    head = renderer.render([system], add_generation_prompt=False).token_ids
    prompt = renderer.render([system, {"role": "user", "content": users[0]}]).token_ids
    hints, reusable, kind = [len(head)], 0 if first else len(head), "system"
    for turn in range(len(users)):
        result = yield Job(prompt, output_len, tuple(hints), reusable, kind)
        if turn + 1 == len(users):
            return
        previous = prompt + result.output  # the rendered history up to here
        tail = renderer.render([{"role": "user", "content": users[turn + 1]}]).token_ids
        hints.append(len(previous))
        prompt, reusable, kind = previous + tail, len(previous), "history"


def chat_clients(tokenizer, args: argparse.Namespace) -> list[Client]:
    from gateway.chat.k3 import K3Renderer

    rng = random.Random(args.seed)
    words = [tokenizer.decode([rng.randrange(300, 7000)]).strip() or "x" for _ in range(400)]

    def text(n: int) -> str:
        return " ".join(rng.choice(words) for _ in range(n))

    renderer = K3Renderer(tokenizer)
    system = {"role": "system", "content": text(args.system_words)}
    return [chat_client(renderer, system, [text(rng.randrange(20, 40)) for _ in range(args.turns)],
                        args.chat_output_len, first=i == 0) for i in range(args.conversations)]


# -- measuring ---------------------------------------------------------------------------------------------------


def reuse(results: list[Result]) -> dict[str, tuple[int, int]]:
    """Per kind of reusable tokens: (tokens served from the cache, reusable tokens)."""
    found: dict[str, tuple[int, int]] = {}
    for r in results:
        served, total = found.get(r.job.kind, (0, 0))
        found[r.job.kind] = (served + min(r.cached, r.job.reusable), total + r.job.reusable)
    return found


def summary(results: list[Result], engine: EngineCore) -> dict:
    stats = engine.stats()
    ttft = sorted(r.ttft_s for r in results)
    return {"requests": len(results), "reuse": reuse(results),
            "prompt_tokens": stats.prefix_lookup_tokens, "cached_tokens": stats.prefix_hit_tokens,
            "ttft_mean_s": statistics.fmean(ttft), "ttft_p50_s": ttft[len(ttft) // 2],
            "ttft_p90_s": ttft[min(len(ttft) - 1, int(0.9 * len(ttft)))],
            "snapshot_copies": stats.num_snapshots_taken, "snapshots_held": stats.num_snapshots,
            "state_bytes": engine.plan.bytes_per_state, "junctions": stats.num_junctions}


def per_turn_ttft(results: list[Result]) -> dict[int, float]:
    """Mean TTFT by turn number (1-based), a turn being a conversation's n-th request."""
    by_hints: dict[int, list[float]] = {}
    for r in results:
        by_hints.setdefault(len(r.job.hints), []).append(r.ttft_s)
    return {turn: statistics.fmean(values) for turn, values in sorted(by_hints.items())}


def new_engine(model: Path, policy: str, args: argparse.Namespace) -> EngineCore:
    return EngineCore(EngineArgs(model=str(model), snapshot_policy=policy, max_num_seqs=max(args.conversations, 8),
                                 kv_cache_memory=args.kv_cache_memory, max_num_batched_tokens=2048))


def run_workloads(model: Path, args: argparse.Namespace) -> dict:
    numbers: dict = {}
    for workload in ("prefix_repetition", "chat"):
        for policy in POLICIES:
            engine = new_engine(model, policy, args)
            if workload == "prefix_repetition":
                queue = prefix_repetition_jobs(engine.tokenizer, args)
                clients = [queue_client(queue) for _ in range(args.concurrency)]
            else:
                clients = chat_clients(engine.tokenizer, args)
            t0, cpu0, steps0 = time.perf_counter(), time.process_time(), engine.num_steps
            results = run_clients(engine, clients)
            numbers[(workload, policy)] = dict(summary(results, engine), wall_s=time.perf_counter() - t0,
                                               cpu_s=time.process_time() - cpu0, steps=engine.num_steps - steps0,
                                               ttft_by_turn=per_turn_ttft(results) if workload == "chat" else {})
            print(f"{workload} / {policy}: {len(results)} requests in {numbers[(workload, policy)]['wall_s']:.1f} s",
                  file=sys.stderr, flush=True)
    return numbers


# -- reporting ---------------------------------------------------------------------------------------------------


def pct(a: float, b: float) -> str:
    return f"{100 * a / b:.1f}%" if b else "—"


def print_tables(numbers: dict, args: argparse.Namespace) -> None:
    print(f"\n`{args.preset}`, fp32, {args.threads} thread(s); block 16; snapshot interval auto; same process\n")
    print("| workload | policy | reusable tokens from cache | prompt tokens from cache | prompt tokens computed "
          "| TTFT mean (s) | TTFT p50 | TTFT p90 | CPU (s) | steps | snapshot copies / request "
          "| snapshots held / request (MiB) |")
    print("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for (workload, policy), n in numbers.items():
        held = n["snapshots_held"] * n["state_bytes"] / n["requests"] / 2 ** 20
        reused = "; ".join(f"{kind} {pct(a, b)} ({a:,} of {b:,})" for kind, (a, b) in sorted(n["reuse"].items()) if b)
        print(f"| {workload} | {policy} | {reused} | {pct(n['cached_tokens'], n['prompt_tokens'])} "
              f"| {n['prompt_tokens'] - n['cached_tokens']:,} | {n['ttft_mean_s']:.3f} | {n['ttft_p50_s']:.3f} "
              f"| {n['ttft_p90_s']:.3f} | {n['cpu_s']:.1f} | {n['steps']} | {n['snapshot_copies'] / n['requests']:.2f} "
              f"| {held:.2f} |")
    print("\n| chat turn | " + " | ".join(f"TTFT {p} (s)" for p in POLICIES) + " |")
    print("| ---: |" + " ---: |" * len(POLICIES))
    turns = sorted(numbers[("chat", POLICIES[0])]["ttft_by_turn"])
    for t in turns:
        print(f"| {t} | " + " | ".join(f"{numbers[('chat', p)]['ttft_by_turn'][t]:.3f}" for p in POLICIES) + " |")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.bench_prefix_reuse", description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="small-k3")
    p.add_argument("--model", default=None, help="a checkpoint folder instead of the generated preset")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--kv-cache-memory", default="1GiB")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--prefix-len", type=int, default=512)
    p.add_argument("--suffix-len", type=int, default=64)
    p.add_argument("--num-prefixes", type=int, default=4)
    p.add_argument("--output-len", type=int, default=8)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--system-words", type=int, default=150)
    p.add_argument("--chat-output-len", type=int, default=64)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    numbers = run_workloads(checkpoint(args.preset, args.model), args)
    print_tables(numbers, args)
    if args.out:
        args.out.write_text(json.dumps({f"{w}/{pol}": n for (w, pol), n in numbers.items()}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
