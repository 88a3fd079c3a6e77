"""Decode-context parallelism (DCP, `--decode-context-parallel-size N`): the MLA latent cache split by token across
groups of N tensor-parallel ranks, and the attention that merges their partial results.

Contract:
- Layout: kernels/attention/context_parallel.py (token interleave 1: logical slot s lives on DCP rank s % N at
  local slot s // N; each rank's blocks hold block_size / N rows; per-rank latent bytes exactly 1/N). The engine's
  block manager, block tables and slot mapping stay logical (rank 0 plans them as at DCP=1); each rank translates
  slots on the device. The groups are N consecutive ranks of the TP group (`ParallelConfig.dcp_groups`); the ranks
  of different groups with the same DCP rank hold the same tokens.
- `open_dcp_comm(config, tp_group, stages, stage)`: every rank of the whole group calls it once, in the same order
  (`new_group` is collective), and gets its own group's communicator (None at N = 1; the TP communicator's group at
  N = TP). Under pipeline parallelism (`stages` > 1; global rank = stage * TP + TP rank) each stage's TP ranks form
  their own DCP groups: every rank creates every stage's groups, in stage order.
- `dcp_attention(ctx, q [T, h, Dk], latent [T, Dk], kv_cache, batch, scale, v_dim, scratch_slot)` is the MLA
  attention of this rank's h heads over the whole context: (1) this rank writes only the latents of the new tokens
  it owns (the others go to `scratch_slot`); (2) the queries are all-gathered over the group (every rank needs all
  N*h heads of its group against its own keys); (3) each rank computes partial outputs and their log-sum-exp over
  its keys (`context_parallel.partial_attention`); (4) the log-sum-exps are all-gathered, each rank weighs its
  partial by `exp(lse_rank - logsumexp_ranks(lse))` and the weighted outputs are summed over the group (an
  all-reduce; a reduce-scatter would move 1/N of it, but gloo has none); (5) each rank keeps its own h heads.
  Returns [T, h, v_dim] fp32. No host read on the decode path. Prefill over cached context is the same call
  (the queries' causal limit is in global positions).
- At N = 1 nothing here runs (the mixer keeps its replicated-cache path), and a model without MLA layers has no
  latent cache: the option is accepted and changes nothing for KDA layers, whose state is split by head by TP.
"""

from __future__ import annotations

from typing import Any

import torch

from engine.parallel.comm import RankContext, TorchDistributed
from engine.parallel.config import ParallelConfig
from kernels.attention.context_parallel import local_write_slots, partial_attention
from kernels.attention.torch_paged import write_kv_cache


def open_dcp_comm(config: ParallelConfig, tp_group: Any = None, stages: int = 1,
                  stage: int = 0) -> TorchDistributed | None:
    """This rank's DCP group communicator (see the module docstring); `tp_group` is used when N equals the TP size.
    `config.rank` is the rank within its stage's TP group."""
    import torch.distributed as dist

    if config.dcp_size == 1:
        return None
    if config.dcp_size == config.tensor_parallel_size:
        return TorchDistributed(tp_group)
    tp, mine = config.tensor_parallel_size, None
    for s in range(stages):
        for ranks in config.dcp_groups():
            group = dist.new_group([s * tp + r for r in ranks])  # every rank creates every group, in order
            if s == stage and config.rank in ranks:
                mine = group
    return TorchDistributed(mine)


def lse_weights(lse: torch.Tensor, lse_all: torch.Tensor) -> torch.Tensor:
    """This rank's share of each row's softmax: lse [T, H], lse_all [N, T, H] -> exp(lse - logsumexp(lse_all))
    [T, H] (0 where this rank saw no key or no rank did)."""
    top = lse_all.amax(0)
    safe = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    total = torch.exp(lse_all - safe).sum(0)  # [T, H]
    return torch.where(total > 0, torch.exp(lse - safe) / torch.where(total > 0, total, 1.0), 0.0)


def dcp_attention(ctx: RankContext, q: torch.Tensor, latent: torch.Tensor, kv_cache: torch.Tensor, batch,
                  scale: float, v_dim: int, scratch_slot: int) -> torch.Tensor:
    """See the module docstring: q [T, h, Dk] (this rank's heads) -> [T, h, v_dim] fp32."""
    comm, size, rank = ctx.dcp_comm, ctx.config.dcp_size, ctx.config.dcp_rank
    write_kv_cache(kv_cache, local_write_slots(batch.slot_mapping, rank, size, scratch_slot), latent)
    h = q.shape[1]
    q_all = comm.all_gather(q, dim=1)  # [T, N*h, Dk]: the group's heads, in DCP-rank order
    host = (batch.host.cu_seqlens, batch.host.seq_lens) if batch.host else None
    o, lse = partial_attention(q_all, kv_cache, batch.block_tables, batch.cu_seqlens, batch.seq_lens, scale,
                               v_dim, rank, size, host)  # [T, N*h, v], [T, N*h]
    lse_all = comm.all_gather(lse[None], dim=0)  # [N, T, N*h]
    merged = comm.all_reduce(o * lse_weights(lse, lse_all)[..., None])  # [T, N*h, v]
    return merged[:, rank * h: (rank + 1) * h]
