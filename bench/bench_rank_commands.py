"""The cost of sending one step's command to the ranks of a TP group: pickled `broadcast_object` vs the tensor
payloads of engine/parallel/channel.py, on 2 gloo ranks (CPU).

Usage: `python -m bench.bench_rank_commands [--batches 1,32] [--context 4096] [--repeats 200]`

The command is a decode step's `RankStep` as the runner plans it (a `ForwardBatch` of `batch` rows at `context`
tokens: ids, lengths, block tables, slots, host copies) and, for the import column, a step that also loads one
request's KDA state of the tiny-k3 shape per rank. Rank 0 sends it `--repeats` times per method, the methods
interleaved in rounds of 20; rank 1 receives. Reported: microseconds of rank 0 per command (median of rounds) and
the ratio pickled / tensors. A collective's latency on loopback TCP dominates the small commands.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from engine.model.batch import ForwardBatch, HostMeta
from engine.parallel.channel import CommandChannel
from engine.parallel.launch import run_ranks
from engine.runner import RankStep, SlotInit

ROUND = 20


def decode_step(batch: int, context: int, block_size: int = 16, with_state: bool = False) -> RankStep:
    blocks = -(-context // block_size)
    tables = torch.arange(batch * blocks, dtype=torch.int32).view(batch, blocks)  # [N, blocks]
    cu = list(range(batch + 1))
    fb = ForwardBatch(
        input_ids=torch.arange(batch), cu_seqlens=torch.tensor(cu), seq_lens=torch.full((batch,), context),
        block_tables=tables, slot_mapping=tables[:, -1].long() * block_size, state_indices=torch.arange(batch),
        logits_indices=torch.arange(batch), host=HostMeta(tuple(cu), (context,) * batch, slice(0, batch)))
    inits = []
    if with_state:  # one imported request: tiny-k3's KDA state (2 layers, 4 heads of 16)
        state = {"conv": torch.randn(2, 192, 3), "recurrent": torch.randn(2, 4, 16, 16)}
        inits = [SlotInit(dst=0, blocks=(1, 2), kv=torch.randn(1, 2, 16, 48), state=state)]
    return RankStep(zero_slots=[], inits=inits, batches=[fb])


def _rank(comm, rank, batches, context, repeats):
    from engine.parallel.executor import _shard_states

    channel = CommandChannel(comm)
    timings: dict[str, list[float]] = {}
    for batch in batches:
        for with_state in (False, True):
            step = decode_step(batch, context, with_state=with_state)
            for _ in range(repeats // ROUND):
                for method in ("pickled", "tensors"):
                    t0 = time.perf_counter()
                    for _ in range(ROUND):
                        if rank == 0 and method == "pickled":
                            comm.broadcast_object(("run_step", (step,)))
                        elif rank == 0:
                            channel.send(("run_step", _shard_states("run_step", (step,), comm.size)))
                        elif method == "pickled":
                            comm.broadcast_object(None)
                        else:
                            channel.receive()
                    key = f"{batch}/{'import' if with_state else 'decode'}/{method}"
                    timings.setdefault(key, []).append((time.perf_counter() - t0) / ROUND * 1e6)
    return {k: statistics.median(v) for k, v in timings.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    result = run_ranks(_rank, 2, (batches, args.context, args.repeats), timeout_s=1800.0)[0]
    print(f"| batch | command | pickled µs | tensors µs | pickled / tensors |  (context {args.context}, 2 gloo ranks)")
    print("|---|---|---|---|---|")
    for batch in batches:
        for kind in ("decode", "import"):
            p, t = result[f"{batch}/{kind}/pickled"], result[f"{batch}/{kind}/tensors"]
            print(f"| {batch} | {kind} | {p:.0f} | {t:.0f} | {p / t:.2f}× |")


if __name__ == "__main__":
    main()
