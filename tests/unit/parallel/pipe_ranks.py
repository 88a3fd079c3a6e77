"""What each rank process runs in the pipeline-parallel tests (module level, so `spawn` can import it).

`pipe_generate(comm, rank, model_dir, tp, pp, ...)` builds global rank `rank`'s model of a TP x PP layout (stage
`rank // tp`, TP rank `rank % tp`, a TP sub-group per stage), prefills the prompts as one packed batch with every
row's logits and drafter taps, then decodes greedily (rank 0 picks the tokens and broadcasts them). Rank 0 returns
the logits, tokens and taps; every rank its cache's layers and bytes and its parameter names. `comm` None: the
one-process reference (tp = pp = 1). `swap`: the two stages' layer ranges exchanged (negative control; no taps).
"""

from __future__ import annotations

import torch

from engine.model.batch import CacheTensors
from engine.model.config import load_model_config
from engine.model.loader import LoadConfig, load_model
from engine.parallel.comm import RankContext, SingleProcess, TorchDistributed
from engine.parallel.config import ParallelConfig
from engine.parallel.pipeline import SINGLE_STAGE, Stage
from tests.model_driver import SequenceDriver

TAPS = (0, 2, -1)  # a layer of each stage of a 2-stage split of 4 layers, and the final hidden state


class _Tapped:
    """The model as `SequenceDriver` calls it, run with drafter taps (kept in `taps`)."""

    def __init__(self, model, taps: tuple[int, ...]):
        self.model, self.device, self.tap_ids, self.taps = model, model.device, taps, []

    def __call__(self, batch, cache):
        if not self.tap_ids:
            return self.model(batch, cache)
        logits, hidden = self.model(batch, cache, taps=self.tap_ids)
        self.taps.append(hidden)
        return logits


def _context(comm, rank: int, model_dir: str, tp: int, pp: int, swap: bool) -> RankContext:
    if comm is None:
        return RankContext(ParallelConfig(), SingleProcess(), stage=SINGLE_STAGE)
    import torch.distributed as dist

    groups = [dist.new_group(list(range(s * tp, (s + 1) * tp))) for s in range(pp)]
    tp_comm = TorchDistributed(groups[rank // tp]) if tp > 1 else SingleProcess()
    config = load_model_config(model_dir)
    stage = Stage.of(config.num_hidden_layers, pp, rank // tp, tp, rank % tp, config.tie_word_embeddings)
    if swap:  # stage 0 computes the later layers, stage 1 the earlier ones
        other = Stage.of(config.num_hidden_layers, pp, pp - 1 - stage.stage)
        stage = Stage(pp, stage.stage, other.start, other.stop, tp, rank % tp)
    return RankContext(ParallelConfig(tp, rank % tp), tp_comm, stage=stage)


def pipe_generate(comm, rank: int, model_dir: str, tp: int, pp: int, prompts: list[list[int]], decode_steps: int,
                  experts_format: str = "auto", swap: bool = False) -> dict:
    ctx = _context(comm, rank, model_dir, tp, pp, swap)
    model = load_model(model_dir, LoadConfig(experts_format=experts_format), ctx)
    driver = SequenceDriver(model, max_seqs=len(prompts), max_len=64, block_size=8)
    driver.cache = CacheTensors.allocate(model.config, num_blocks=len(prompts) * driver.blocks_per_seq,
                                         block_size=8, num_slots=len(prompts), dtype=model.dtype,
                                         kda_heads=model.num_local_kda_heads,
                                         layers=model.model.owned_layers(model.config, ctx))
    driver.model = tapped = _Tapped(model, () if swap else TAPS)  # swapped ranges: rank 0 cannot place taps
    prefill = driver.step(dict(enumerate(prompts)), all_logits=True)  # [T, V] on rank 0
    ends = torch.cumsum(torch.tensor([len(p) for p in prompts]), 0) - 1
    tokens, decode = [], []
    logits = prefill[ends] if rank == 0 else None
    for step in range(decode_steps + 1):
        picked = logits.argmax(-1) if rank == 0 else torch.zeros(len(prompts), dtype=torch.long)
        if comm is not None:
            torch.distributed.broadcast(picked, src=0)
        tokens.append(picked.tolist())
        if step < decode_steps:
            logits = driver.step({s: [tokens[-1][s]] for s in range(len(prompts))})  # [N, V]
            decode.append(logits)
    cache = driver.cache
    tensors = list(cache.kv.values()) + list(cache.conv.values()) + list(cache.recurrent.values())
    out = {"mla": sorted(cache.kv), "kda": sorted(cache.conv),
           "cache_bytes": sum(t.numel() * t.element_size() for t in tensors),
           "params": sorted(n for n, _ in model.named_parameters())}
    if rank == 0:
        out.update(prefill=prefill, decode=torch.stack(decode), tokens=tokens, taps=torch.cat(tapped.taps) if tapped.taps else None)
    return out
