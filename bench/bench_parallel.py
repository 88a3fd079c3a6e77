"""Tensor/expert parallelism and packed MXFP4 experts on CPU: memory per rank, and the MoE step, same run.

Run: `python -m bench.bench_parallel [--preset small-k3] [--tokens 32 512] [--threads 1] [--out FILE]`
(pipeline: `python -m bench.bench_parallel --parts pipeline --prompts 32 --max-tokens 8`).

1. Memory per rank at TP=1, TP=2 and TP=2 + EP (two gloo rank processes): resident parameter bytes (distinct
   storages, so fused tensors count once), split across ranks vs replicated (with the largest replicated
   parameters listed), routed expert bytes, and one KDA state slot; beside each, `engine.plan`'s prediction.
   All from one generated MXFP4 checkpoint, experts kept packed.
2. Packed vs dequantised experts, same checkpoint, same process: expert bytes and the MoE layer's time
   (`SparseMoE.forward` of the first MoE layer, median of `--repeats`) at each token count, and the whole model's
   decode step (one sequence, batch 8). Packed experts are decoded per expert tile inside the MoE
   (kernels/moe/mxfp4.py), so their time includes the decoding.
3. The decode step at TP=1 and TP=2 (two gloo rank processes on this CPU, each with `--threads` threads; batch 8
   after a 32-token prefill each, median of `--repeats` <= 30), and the communication share of rank 0's step: the time
   inside the collectives (`TimedComm` around the communicator) over the step time.
4. Pipeline parallelism (`--parts pipeline`): `--prompts` prompts of 32 tokens, `--max-tokens` greedy tokens each,
   through `LLM` at PP=1 and PP=2 (two gloo rank processes, micro-batches), interleaved `--rounds` times: output
   tokens per second; and, model level (two ranks, one prefill of all prompts as PP micro-batches then decode steps),
   the bubble fraction: the share of each stage's step time spent waiting in a receive (stage 1 for the stream,
   stage 0 for the logits), averaged over the stages.
`--parts` picks among memory, moe, decode, pipeline (default: memory, moe, decode). Prints markdown; `--out` writes the numbers as JSON too.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from bench.gpu_validate import median_ms
from engine.model.checkpoint import make_checkpoint
from engine.model.loader import LoadConfig, load_model, shard_dims
from engine.parallel.comm import RankContext
from engine.parallel.config import ParallelConfig
from engine.parallel.launch import run_ranks
from engine.plan import rank_weight_bytes, state_bytes_per_request


def memory(model) -> dict:
    """This rank's resident bytes: distinct storages in all; parameters split across ranks, replicated ones (the
    largest named), routed experts, and the fused tensors' padding rows; one KDA state slot."""
    dims = shard_dims(model)
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()}
    split = replicated = experts = 0
    largest = []
    for name, p in model.named_parameters():
        nbytes = p.numel() * p.element_size()
        if ".experts.w" in name:
            experts += nbytes
        elif name in dims:
            split += nbytes
        else:
            replicated += nbytes
            largest.append((nbytes, name))
    total = sum(storages.values())
    heads = model.num_local_kda_heads
    state = state_bytes_per_request(model.config, 4, model.config.kda.num_heads // heads) if heads else 0
    return {"total": total, "split": split, "replicated": replicated, "experts": experts,
            "padding": total - split - replicated - experts, "state_slot": state,
            "largest_replicated": [f"{n} ({b / 1e6:.1f} MB)" for b, n in sorted(largest, reverse=True)[:3]]}


def _rank_memory(comm, rank: int, folder: str, expert_parallel: bool) -> dict:
    ctx = RankContext(ParallelConfig(comm.size, rank, expert_parallel), comm)
    return memory(load_model(folder, LoadConfig(), ctx))


def memory_table(folder: str) -> list[dict]:
    from engine.model.config import load_model_config

    config = load_model_config(folder)
    rows = [{"layout": "TP=1", **memory(load_model(folder)),
             "planned": rank_weight_bytes(config, 1, False, "mxfp4", 4).total}]
    for ep in (False, True):
        ranks = run_ranks(_rank_memory, 2, (folder, ep), timeout_s=300)
        rows.append({"layout": "TP=2 + EP" if ep else "TP=2", **ranks[0],
                     "planned": rank_weight_bytes(config, 2, ep, "mxfp4", 4).total,
                     "ranks_equal": ranks[0]["total"] == ranks[1]["total"]})
    return rows


def moe_times(folder: str, token_counts: list[int], repeats: int) -> list[dict]:
    from tests.model_driver import SequenceDriver

    rows = []
    for fmt in ("mxfp4", "dense"):
        model = load_model(folder, LoadConfig(experts_format=fmt))
        moe = next(layer.block_sparse_moe for layer in model.model.layers if layer.spec.ffn == "moe")
        expert_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".experts.w" in n)
        row = {"experts": fmt, "expert_bytes": expert_bytes}
        gen = torch.Generator().manual_seed(0)
        with torch.inference_mode():
            for t in token_counts:
                x = torch.randn(t, model.config.hidden_size, generator=gen)
                row[f"moe_ms_{t}"] = median_ms(lambda: moe(x), repeats)
        driver = SequenceDriver(model, max_seqs=8, max_len=96)
        driver.step({s: [(17 * s + i) % 7900 for i in range(64)] for s in range(8)})
        row["decode_step_ms"] = median_ms(lambda: driver.step({s: [5] for s in range(8)}), repeats)
        rows.append(row)
    return rows


class TimedComm:
    """A communicator that adds up the wall time spent in its collectives (seconds, `self.seconds`)."""

    def __init__(self, comm):
        self.comm, self.size, self.rank, self.seconds = comm, comm.size, comm.rank, 0.0

    def _timed(self, fn, *args):
        t0 = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.seconds += time.perf_counter() - t0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return self._timed(self.comm.all_reduce, x)

    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        return self._timed(self.comm.all_gather, x, dim)

    def broadcast_object(self, obj, src: int = 0):
        return self._timed(self.comm.broadcast_object, obj, src)

    def barrier(self) -> None:
        self._timed(self.comm.barrier)


def _decode_step(comm, rank: int, folder: str, repeats: int, threads: int) -> dict:
    from tests.unit.parallel.ranks import rank_driver

    torch.set_num_threads(threads)
    timed = TimedComm(comm)
    model = load_model(folder, LoadConfig(), RankContext(ParallelConfig(comm.size, rank), timed))
    driver = rank_driver(model, 8)  # 64 positions per sequence: 32 prompt tokens + up to 32 decode steps
    with torch.inference_mode():
        driver.step({s: [(17 * s + i) % 7900 for i in range(32)] for s in range(8)})
        timed.seconds, t0 = 0.0, time.perf_counter()
        step_ms = median_ms(lambda: driver.step({s: [5] for s in range(8)}), repeats)
        total = time.perf_counter() - t0
    return {"step_ms": step_ms, "comm_share": timed.seconds / total if comm.size > 1 else 0.0}


def decode_table(folder: str, repeats: int, threads: int) -> list[dict]:
    from engine.parallel.comm import SingleProcess

    rows = [{"layout": "TP=1", **_decode_step(SingleProcess(), 0, folder, repeats, threads)}]
    ranks = run_ranks(_decode_step, 2, (folder, repeats, threads), timeout_s=600, threads_per_rank=threads)
    rows.append({"layout": "TP=2", **ranks[0]})
    return rows


PIPE_ARGS = dict(kv_cache_memory=256 << 20, max_num_seqs=32, max_num_batched_tokens=2048, block_size=16,
                 enable_prefix_caching=False, collective_timeout_s=120.0)


def _prompts(n: int) -> list[list[int]]:
    return [[(17 * s + 7 * i) % 7900 + 10 for i in range(32)] for s in range(n)]


def pipeline_throughput(folder: str, prompts: int, max_tokens: int, rounds: int) -> dict:
    from engine.llm import LLM
    from engine.sampling import SamplingParams

    greedy = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    llms = {pp: LLM(folder, pipeline_parallel_size=pp, **PIPE_ARGS) for pp in (1, 2)}
    seconds = {1: 0.0, 2: 0.0}
    tokens = {}
    try:
        for _ in range(rounds):  # interleaved A/B
            for pp, llm in llms.items():
                t0 = time.perf_counter()
                out = llm.generate(_prompts(prompts), greedy)
                seconds[pp] += time.perf_counter() - t0
                tokens[pp] = [list(o.outputs[0].token_ids) for o in out]
    finally:
        for llm in llms.values():
            llm.close()
    rate = {pp: rounds * prompts * max_tokens / seconds[pp] for pp in seconds}
    return {"tok_s_pp1": rate[1], "tok_s_pp2": rate[2], "ratio": rate[2] / rate[1], "same_tokens": tokens[1] == tokens[2]}


class _WaitTimer:
    """`torch.distributed` as engine/parallel/pipeline.py uses it, adding up the time spent in `recv`."""

    def __init__(self):
        import torch.distributed as dist

        self.dist, self.seconds = dist, 0.0

    def __getattr__(self, name):
        return getattr(self.dist, name)

    def recv(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return self.dist.recv(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - t0


def _pipe_bubble(comm, rank: int, folder: str, prompts: int, steps: int, threads: int) -> dict:
    import engine.parallel.pipeline as pipeline
    from engine.model.batch import CacheTensors
    from engine.model.config import load_model_config
    from engine.parallel.comm import SingleProcess
    from tests.model_driver import SequenceDriver

    torch.set_num_threads(threads)
    timer = _WaitTimer()
    pipeline._dist = lambda: timer
    config = load_model_config(folder)
    stage = pipeline.Stage.of(config.num_hidden_layers, comm.size, rank)
    ctx = RankContext(ParallelConfig(), SingleProcess(), stage=stage)
    model = load_model(folder, LoadConfig(), ctx)
    driver = SequenceDriver(model, max_seqs=prompts, max_len=32 + steps + 1)
    driver.cache = CacheTensors.allocate(config, num_blocks=prompts * driver.blocks_per_seq, block_size=16,
                                         num_slots=prompts, dtype=model.dtype,
                                         layers=model.model.owned_layers(config, ctx))
    batches = []
    driver.model = type("Split", (), {"device": model.device, "__call__": lambda self, b, c: batches.append(b)})()
    half = prompts // 2  # the prefill as two micro-batches of whole sequences
    driver.step({s: p for s, p in enumerate(_prompts(prompts)) if s < half})
    driver.step({s: p for s, p in enumerate(_prompts(prompts)) if s >= half})
    driver.model = model
    t0 = time.perf_counter()
    model.forward_micro_batches(batches, driver.cache)
    prefill = time.perf_counter() - t0
    prefill_wait, timer.seconds = timer.seconds, 0.0
    t0 = time.perf_counter()
    for _ in range(steps):
        driver.step({s: [5] for s in range(prompts)})
    decode = time.perf_counter() - t0
    return {"prefill_s": prefill, "prefill_wait": prefill_wait / prefill, "decode_s": decode,
            "decode_wait": timer.seconds / decode}


def pipeline_bubble(folder: str, prompts: int, steps: int, threads: int) -> dict:
    ranks = run_ranks(_pipe_bubble, 2, (folder, prompts, steps, threads), timeout_s=600, threads_per_rank=threads)
    return {"prefill_bubble": sum(r["prefill_wait"] for r in ranks) / 2,
            "decode_bubble": sum(r["decode_wait"] for r in ranks) / 2, "ranks": ranks}


def markdown(result: dict) -> str:
    mb = 1e6
    lines = []
    if "pipeline" in result:
        p = result["pipeline"]
        lines += [f"**Pipeline parallelism** ({result['preset']}, {result['prompts']} prompts x {result['max_tokens']} "
                  f"tokens, {result['threads']} thread(s) per rank)", "",
                  "| PP=1 tok/s | PP=2 tok/s | PP=2 / PP=1 | same tokens | bubble, prefill (2 micro-batches) | "
                  "bubble, decode |", "| ---: | ---: | ---: | --- | ---: | ---: |",
                  f"| {p['tok_s_pp1']:.1f} | {p['tok_s_pp2']:.1f} | {p['ratio']:.2f} | {p['same_tokens']} | "
                  f"{100 * p['prefill_bubble']:.0f}% | {100 * p['decode_bubble']:.0f}% |", ""]
    if "decode" in result:
        lines += [f"**Decode step, batch 8** ({result['preset']}, {result['threads']} thread(s) per rank)", "",
                  "| layout | step | communication share (rank 0) |", "| --- | ---: | ---: |"]
        lines += [f"| {r['layout']} | {r['step_ms']:.2f} ms | {100 * r['comm_share']:.0f}% |" for r in result["decode"]]
        lines.append("")
    if "memory" not in result:
        return "\n".join(lines)
    lines += [f"**Memory per rank** ({result['preset']}, MXFP4 experts packed, fp32, CPU/gloo)", "",
             "| layout | resident | split | replicated | routed experts | fused padding | planned | KDA state slot |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in result["memory"]:
        lines.append(f"| {r['layout']} | {r['total'] / mb:.2f} MB | {r['split'] / mb:.2f} MB | "
                     f"{r['replicated'] / mb:.2f} MB | {r['experts'] / mb:.2f} MB | {r['padding'] / mb:.3f} MB | "
                     f"{r['planned'] / mb:.2f} MB | {r['state_slot'] / mb:.3f} MB |")
    lines += ["", "Largest replicated parameters at TP=2: " + ", ".join(result["memory"][1]["largest_replicated"]), "",
              f"**Packed vs dequantised experts** (same checkpoint, same process, {result['threads']} thread(s))", "",
              "| experts | expert bytes | " + " | ".join(f"MoE layer, {t} tokens" for t in result["tokens"])
              + " | model decode step (batch 8) |", "| --- | ---: | " + " | ".join("---:" for _ in result["tokens"])
              + " | ---: |"]
    for r in result["moe"]:
        times = " | ".join(f"{r[f'moe_ms_{t}']:.2f} ms" for t in result["tokens"])
        lines.append(f"| {r['experts']} | {r['expert_bytes'] / mb:.2f} MB | {times} | {r['decode_step_ms']:.2f} ms |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small-k3")
    parser.add_argument("--tokens", type=int, nargs="+", default=[32, 512])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--out", default=None)
    parser.add_argument("--parts", nargs="+", choices=["memory", "moe", "decode", "pipeline"],
                        default=["memory", "moe", "decode"])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        folder = str(make_checkpoint(args.preset, Path(tmp) / args.preset, seed=0, experts_format="mxfp4"))
        result = {"preset": args.preset, "threads": args.threads, "tokens": args.tokens, "prompts": args.prompts,
                  "max_tokens": args.max_tokens}
        if "pipeline" in args.parts:
            result["pipeline"] = {**pipeline_throughput(folder, args.prompts, args.max_tokens, args.rounds),
                                  **pipeline_bubble(folder, args.prompts, args.max_tokens, args.threads)}
        if "decode" in args.parts:
            result["decode"] = decode_table(folder, args.repeats, args.threads)
        if "memory" in args.parts or "moe" in args.parts:  # the two tables print together
            result.update(memory=memory_table(folder), moe=moe_times(folder, args.tokens, args.repeats))
    print(markdown(result))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
