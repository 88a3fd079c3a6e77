"""What each rank runs in the decode-context-parallel group test (module level, so `spawn` can import it)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from engine.parallel.comm import RankContext
from engine.parallel.config import ParallelConfig
from engine.parallel.context import dcp_attention, open_dcp_comm

HEADS, DK, V, BS, NUM_BLOCKS = 8, 24, 16, 8, 12


def problem(seed: int = 0) -> dict:
    """Two sequences: a 21-token prompt then a 10-token chunk over it, and a 13-token prompt
    then a decode; then one decode each (the batched decode path)."""
    g = torch.Generator().manual_seed(seed)
    lat = torch.randn(NUM_BLOCKS * BS, DK, generator=g)  # latent of flat logical slot s
    tables = torch.tensor([[3, 7, 1, 9], [0, 5, 0, 0]], dtype=torch.int32)
    steps = [([21, 13], [21, 13]), ([10, 1], [31, 14]), ([1, 1], [32, 15])]  # (new tokens, seq_lens) per step
    qs = [torch.randn(sum(new), HEADS, DK, generator=g) for new, _ in steps]
    return {"lat": lat, "tables": tables, "steps": steps, "qs": qs}


def _batch(p: dict, new: list[int], lens: list[int]) -> SimpleNamespace:
    cu = [0]
    slots = []
    for n, (k, L) in enumerate(zip(new, lens)):
        cu.append(cu[-1] + k)
        slots += [int(p["tables"][n, pos // BS]) * BS + pos % BS for pos in range(L - k, L)]
    return SimpleNamespace(slot_mapping=torch.tensor(slots), block_tables=p["tables"], cu_seqlens=torch.tensor(cu),
                           seq_lens=torch.tensor(lens), host=SimpleNamespace(cu_seqlens=cu, seq_lens=lens))


def run_dcp(comm, rank: int, tp: int, dcp: int) -> list[torch.Tensor]:
    """This rank's heads' outputs [T, HEADS/tp, V] of each step, and its local cache."""
    config = ParallelConfig(tp, rank, False, dcp)
    ctx = RankContext(config, comm, open_dcp_comm(config, getattr(comm, "group", None)))
    p = problem()
    h = HEADS // tp
    cache = torch.zeros(NUM_BLOCKS + 1, BS // dcp, DK)
    outs = []
    for (new, lens), q in zip(p["steps"], p["qs"]):
        batch = _batch(p, new, lens)
        latent = p["lat"][batch.slot_mapping]  # [T, DK]
        outs.append(dcp_attention(ctx, q[:, rank * h: (rank + 1) * h], latent, cache, batch, 0.3, V,
                                  NUM_BLOCKS * (BS // dcp)))
    return outs + [cache[:NUM_BLOCKS]]


def dcp_members(comm, rank: int, tp: int, dcp: int, stages: int) -> list[int]:
    """The global ranks of this rank's DCP group (an all-gather over it), with `stages` pipeline stages of TP ranks."""
    config = ParallelConfig(tp, rank % tp, False, dcp)
    dcp_comm = open_dcp_comm(config, None, stages, rank // tp)
    return dcp_comm.all_gather(torch.tensor([rank]), dim=0).tolist()
