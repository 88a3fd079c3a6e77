"""What each rank process runs in the tensor/expert-parallel tests (module level, so `spawn` can import it).

`run_variants(comm, rank, model_dir, variants, prompts, decode_steps)` loads the model once per variant
(`Variant`: expert parallelism, experts format, a deliberately swapped shard) for this rank, prefills the prompts as
one packed batch, then decodes greedily, and returns per variant: prefill logits `[T, V]`, per-step decode logits,
the greedy tokens, this rank's KDA state slices after the prompt, and its parameter bytes by name (with whether
each parameter is split across ranks). `runner_steps` drives `ModelRunner.run_step` the way phase 2 will: rank 0
plans each `RankStep` and broadcasts it, every rank runs it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.config import CachePlan
from engine.model.batch import CacheTensors, ForwardBatch
from engine.model.loader import LoadConfig, load_model, shard_dims
from engine.parallel.comm import RankContext, SingleProcess
from engine.parallel.config import ParallelConfig
from engine.runner import ModelRunner, RankStep, SlotInit
from tests.model_driver import SequenceDriver


@dataclass(frozen=True)
class Variant:
    expert_parallel: bool = False
    experts_format: str = "auto"
    swap: str | None = None  # a parameter whose two ranks' slices are exchanged after loading (negative control)


def rank_driver(model, max_seqs: int) -> SequenceDriver:
    driver = SequenceDriver(model, max_seqs=max_seqs, max_len=64)
    driver.cache = CacheTensors.allocate(model.config, num_blocks=max_seqs * driver.blocks_per_seq,
                                         block_size=driver.block_size, num_slots=max_seqs, dtype=model.dtype,
                                         kda_heads=model.num_local_kda_heads)
    return driver


def param_bytes(model) -> dict[str, tuple[int, bool]]:
    """Parameter name -> (bytes on this rank, split across ranks)."""
    dims = shard_dims(model)
    split_experts = {n for n, _ in model.named_parameters() if ".experts.w" in n and model.ctx.size > 1}
    return {n: (p.numel() * p.element_size(), n in dims or n in split_experts) for n, p in model.named_parameters()}


def _swap_slices(model, ctx: RankContext, name: str) -> None:
    param = dict(model.named_parameters())[name]
    dim = shard_dims(model)[name]
    full = ctx.all_gather(param.data, dim)
    other = full.chunk(ctx.size, dim)[(ctx.rank + 1) % ctx.size]
    param.data.copy_(other)


def generate(model, prompts: list[list[int]], decode_steps: int) -> dict:
    driver = rank_driver(model, len(prompts))
    prefill = driver.step(dict(enumerate(prompts)), all_logits=True)  # [T, V]
    state = {"conv": torch.stack([driver.cache.conv[i][: len(prompts)] for i in sorted(driver.cache.conv)]),
             "recurrent": torch.stack([driver.cache.recurrent[i][: len(prompts)]
                                       for i in sorted(driver.cache.recurrent)])} if driver.cache.conv else {}
    ends = torch.cumsum(torch.tensor([len(p) for p in prompts]), 0) - 1
    tokens = [prefill[ends].argmax(-1).tolist()]
    decode = []
    for _ in range(decode_steps):
        logits = driver.step({s: [tokens[-1][s]] for s in range(len(prompts))})  # [N, V]
        decode.append(logits)
        tokens.append(logits.argmax(-1).tolist())
    return {"prefill": prefill, "decode": torch.stack(decode), "tokens": tokens, "state": state,
            "bytes": param_bytes(model)}


def run_variants(comm, rank: int, model_dir: str, variants: list[Variant], prompts: list[list[int]],
                 decode_steps: int) -> list[dict]:
    results = []
    for v in variants:
        ctx = RankContext(ParallelConfig(comm.size, rank, v.expert_parallel), comm)
        model = load_model(model_dir, LoadConfig(experts_format=v.experts_format), ctx)
        if v.swap:
            _swap_slices(model, ctx, v.swap)
        results.append(generate(model, prompts, decode_steps))
    return results


def run_single(model_dir: str, variant: Variant, prompts: list[list[int]], decode_steps: int) -> dict:
    """The TP=1 reference, in this process."""
    ctx = RankContext(ParallelConfig(1, 0, variant.expert_parallel), SingleProcess())
    return generate(load_model(model_dir, LoadConfig(experts_format=variant.experts_format), ctx), prompts,
                    decode_steps)


def load_both_formats(comm, rank: int, model_dir: str, expert_parallel: bool) -> list[dict[str, torch.Tensor]]:
    """This rank's parameters loaded through safetensors slices and through fastsafetensors (a collective)."""
    ctx = RankContext(ParallelConfig(comm.size, rank, expert_parallel), comm)
    out = []
    for fmt in ("safetensors", "fastsafetensors"):
        model = load_model(model_dir, LoadConfig(load_format=fmt), ctx)
        out.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return out


def _batch(chunks: list[tuple[list[int], int, list[int], int]], block_size: int) -> ForwardBatch:
    """chunks: (new tokens, start position, block ids, state slot) per sequence -> a packed `ForwardBatch`."""
    ids, cu, seq_lens, slots = [], [0], [], []
    for tokens, start, blocks, _ in chunks:
        ids.extend(tokens)
        cu.append(cu[-1] + len(tokens))
        seq_lens.append(start + len(tokens))
        slots.extend(blocks[p // block_size] * block_size + p % block_size for p in range(start, seq_lens[-1]))
    width = max(len(c[2]) for c in chunks)
    tables = torch.tensor([c[2] + [0] * (width - len(c[2])) for c in chunks], dtype=torch.int32)
    return ForwardBatch(torch.tensor(ids), torch.tensor(cu), torch.tensor(seq_lens), tables, torch.tensor(slots),
                        torch.tensor([c[3] for c in chunks]))


def runner_steps(comm, rank: int, model_dir: str) -> dict:
    """Two `ModelRunner.run_step`s that rank 0 plans and broadcasts: prefill two prompts, then load sequence 0's
    state (TP-independent layout, via `read_state`) and blocks into slot 1 / new blocks and decode both."""
    ctx = RankContext(ParallelConfig(comm.size, rank), comm)
    model = load_model(model_dir, LoadConfig(), ctx)
    plan = CachePlan(block_size=4, num_blocks=16, slots_per_request=1, num_running_slots=2, num_snapshot_slots=0,
                     snapshot_interval=0, max_model_len=64, bytes_per_token=1, bytes_per_state=1)
    runner = ModelRunner(model, plan)
    a, b = [(7 * i + 3) % 7900 for i in range(10)], [(11 * i + 1) % 7900 for i in range(6)]
    first = RankStep(zero_slots=[0, 1], batches=[_batch([(a, 0, [0, 1, 2], 0), (b, 0, [3, 4], 1)], 4)])
    prefill = runner.run_step(comm.broadcast_object(first if rank == 0 else None))
    state, kv = runner.read_state(0), runner.read_blocks([0, 1, 2])  # collectives on every rank
    second = RankStep(inits=[SlotInit(dst=1, blocks=(5, 6, 7), kv=kv, state=state)],
                      batches=[_batch([([42], 10, [0, 1, 2], 0), ([42], 10, [5, 6, 7], 1)], 4)])
    decode = runner.run_step(comm.broadcast_object(second if rank == 0 else None))
    return {"prefill": prefill, "decode": decode, "state": runner.read_state(1)}
