"""Decode-only steps over persistent input buffers in batch-size buckets: compiled (`torch.compile`) and, on CUDA,
captured as CUDA graphs — the GPU-shaped decode step.

Contract:
- `DecodeGraphs(model, cache, config, max_num_seqs, max_blocks, scratch_slot, scratch_block)` owns device buffers
  for the largest bucket: token ids, `seq_lens`, `slot_mapping`, `state_indices` `[B]` and `block_tables`
  `[B, max_blocks]`. The scratch KDA slot and scratch MLA block (one of each, allocated beyond the pools the engine
  manages) absorb the writes of padding rows, so every row of a bucket computes and no op needs a mask or a host
  read.
- `runs(pieces, taps)`: whether a step can run here — every piece is one decode token that needs logits (no prompt
  rows, no drafts, no images) and there are at most as many as the largest bucket.
- `run(DecodeRows.of(pieces, block_size))` fills the buffers of the smallest bucket holding the step (one host
  tensor, one upload; padding rows: token 0, length 1, the scratch slot and block) and runs that bucket's step: compiled forwards on CPU (one graph
  per bucket; the block-table width is a dynamic dimension, trimmed to the longest row's blocks, so a growing
  context never recompiles), a captured CUDA graph on CUDA (captured on first use of a bucket, replayed after; the
  block tables are full width and the attention kernel reads `seq_lens` on the device). Returns the logits of the
  real rows `[n, V]` fp32 and, with taps, their tapped hidden rows `[n, len(taps) * D]`.
- The forward is `KimiForCausalLM`'s own layers with `ForwardBatch.traced=True`: the caches are reached through
  `kernels.graph_ops`' custom ops, so compiled and eager steps compute the same thing (tests compare their greedy
  tokens and logits).
- Nothing here reads a device value back to the host; the caller reads the sampled ids once per step.
"""

from __future__ import annotations

import logging
import types
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.compilation import CompilationConfig
from engine.model.batch import CacheTensors, ForwardBatch
from engine.model.model import KimiForCausalLM
from engine.errors import EngineConfigError
from engine.guard_skipping import GuardSkipping
from kernels import get_kernel, graph_ops
from kernels.attention.torch_paged import fits_one_tile

logger = logging.getLogger(__name__)

MIN_TABLE_WIDTH = 2  # a dynamic dimension of size 0 or 1 would be specialised by torch.compile


class DecodeGraphs:
    def __init__(self, model: KimiForCausalLM, cache: CacheTensors, config: CompilationConfig, max_num_seqs: int,
                 max_blocks: int, scratch_slot: int, scratch_block: int, taps: tuple[int, ...] = ()):
        self.model, self.cache, self.config, self.taps = model, cache, config, taps
        cache.graph_key = graph_ops.register_cache(cache)
        self.device = model.device
        self.buckets = config.bucket_sizes(max_num_seqs)
        self.scratch_slot, self.scratch_block = scratch_slot, scratch_block
        self.block_size = cache.block_size
        self.max_blocks = max(max_blocks, MIN_TABLE_WIDTH)
        self.capture = config.captures(self.device.type)
        self.compiled = config.compiles(self.device.type)
        # inductor on CPU writes the KDA pools in place from plain traced ops (kernels/graph_ops.py)
        self.inline_cache_ops = self.compiled and self.device.type == "cpu" and config.backend == "inductor"
        top, dev = self.buckets[-1], self.device
        self.ids = torch.zeros(top, dtype=torch.int64, device=dev)
        self.seq_lens = torch.ones(top, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.full((top,), scratch_block * self.block_size, dtype=torch.int64, device=dev)
        self.state_indices = torch.full((top,), scratch_slot, dtype=torch.int64, device=dev)
        self.block_tables = torch.full((top, self.max_blocks), scratch_block, dtype=torch.int32, device=dev)
        self.cu_seqlens = torch.arange(top + 1, dtype=torch.int64, device=dev)
        self._staging = torch.empty(4 * top + top * self.max_blocks, dtype=torch.int64,
                                    pin_memory=dev.type == "cuda")
        self._step = self._compiled_forward() if self.compiled else self._forward
        self.guards = GuardSkipping(self._probe_width) if self.compiled else None
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, ...]]] = {}
        self.num_runs = 0  # steps run here (tests tell graph steps from eager ones by it)
        if self.compiled:
            # the ops a traced step reaches through the registry
            for op in ("moe_experts", "moe_experts_mxfp4", "conv_decode", "kda_decode"):
                get_kernel(op, self.device)
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 3 * len(self.buckets))
        logger.info("decode graphs: buckets %s, %s%s", list(self.buckets),
                    f"torch.compile({config.backend})" if self.compiled else "eager",
                    ", CUDA graphs" if self.capture else "")

    def runs(self, pieces: Sequence, taps: tuple[int, ...]) -> bool:
        if taps != self.taps or not pieces or len(pieces) > self.buckets[-1]:
            return False
        return all(p.num_tokens == 1 and p.needs_logits and not p.prompt_rows and not p.draft
                   and not getattr(p.req, "media", None) for p in pieces)

    def bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def run(self, rows: DecodeRows) -> tuple[torch.Tensor, torch.Tensor | None]:
        """logits [n, V] fp32 (and tapped hidden [n, len(taps) * D] or None) of a decode step of `rows`."""
        n, b = len(rows.ids), self.bucket(len(rows.ids))
        self.num_runs += 1
        if self.capture:
            if b not in self._graphs:
                self._fill(DecodeRows.padding(), b)  # warm-up and capture touch only the scratch slot and block
                self._capture_bucket(b)
            self._fill(rows, b)
            graph, outputs = self._graphs[b]
            graph.replay()
        else:
            outputs = self._call(b, self._fill(rows, b))
        logits, hidden = outputs if self.taps else (outputs[0], None)
        return logits[:n], (hidden[:n] if hidden is not None else None)

    # -- buffers ---------------------------------------------------------------------------------------------

    def _fill(self, rows: DecodeRows, b: int, width: int | None = None) -> int:
        """Writes the step's rows (and padding up to `b`) into the buffers with one upload; -> the table width
        (`width`: a wider table than the rows need, padded with the scratch block)."""
        bs, pad = self.block_size, b - len(rows.ids)
        if width is None:
            width = self.max_blocks if self.capture else max([MIN_TABLE_WIDTH] + [-(-s // bs) for s in rows.seq_lens])
        tables = []
        for blocks in rows.block_tables:
            tables.extend(blocks + [self.scratch_block] * (width - len(blocks)))
        tables.extend([self.scratch_block] * (width * pad))
        values = (rows.ids + [0] * pad + rows.seq_lens + [1] * pad + rows.slot_mapping
                  + [self.scratch_block * bs] * pad + rows.state_slots + [self.scratch_slot] * pad + tables)
        host = self._staging[: 4 * b + b * width]
        host.copy_(torch.tensor(values, dtype=torch.int64))
        dev = host.to(self.device, non_blocking=True)
        self.ids[:b].copy_(dev[:b])
        self.seq_lens[:b].copy_(dev[b: 2 * b])
        self.slot_mapping[:b].copy_(dev[2 * b: 3 * b])
        self.state_indices[:b].copy_(dev[3 * b: 4 * b])
        self.block_tables[:b, :width].copy_(dev[4 * b:].view(b, width))
        return width

    # -- the step --------------------------------------------------------------------------------------------

    def _compiled_forward(self):
        options = None
        if self.config.backend == "inductor":
            options = self.config.inductor_options(self.device.type)
            known = torch._inductor.config.get_config_copy()
            unknown = sorted(k for k in options if k not in known)
            if unknown:
                raise EngineConfigError(f"compilation_config.inductor_compile_config: unknown inductor option "
                                        f"{unknown[0]!r}")
        return torch.compile(self._own_forward(), dynamic=False, backend=self.config.backend, options=options)

    def _own_forward(self):
        """`_forward` bound to this instance over a copy of its code object: Dynamo caches graphs (and counts its
        recompile limit) per code object, so each engine in a process keeps its own graphs instead of every engine's
        piling onto one `_forward` until Dynamo falls back to eager for all of them."""
        code = DecodeGraphs._forward.__code__.replace()  # equal, but a new object
        return types.MethodType(types.FunctionType(code, DecodeGraphs._forward.__globals__, "_forward"), self)

    def _call(self, b: int, width: int) -> tuple[torch.Tensor, ...]:
        if not self.compiled:
            return self._run_step(b, width)
        variant = (b, self._one_tile(b, width))
        return self.guards.call(variant, width, lambda: self._run_step(b, width))

    def _run_step(self, b: int, width: int) -> tuple[torch.Tensor, ...]:
        tables = self.block_tables[:b, :width]
        if self.compiled:
            # dynamic, and the graph may narrow it (the inline MLA decode guards on a one-tile width)
            torch._dynamo.maybe_mark_dynamic(tables, 1)
        torch.set_flush_denormal(True)  # as KimiForCausalLM.forward (subnormal KDA states slow every matmul)
        try:
            with torch.inference_mode():
                return self._step(self.ids[:b], self.cu_seqlens[: b + 1], self.seq_lens[:b], tables,
                                  self.slot_mapping[:b], self.state_indices[:b])
        finally:
            torch.set_flush_denormal(False)

    def _one_tile(self, b: int, width: int) -> bool:
        """Which of the two table-width regimes a step is in (the inline MLA decode's guard, kernels/graph_ops.py)."""
        kv = next(iter(self.cache.kv.values()), None)  # every MLA layer's pool has the same shape
        return kv is not None and fits_one_tile(b, self.block_tables[:b, :width], kv)

    def _probe_width(self, variant: tuple[int, bool], width: int) -> int | None:
        """A padding step of `variant`'s bucket at another width of the same regime (None when it has only one):
        compiles nothing unless the graph specialised on the width. Touches only the scratch slot and block."""
        b, one_tile = variant
        for other in (width + 1, width - 1):
            if MIN_TABLE_WIDTH <= other <= self.max_blocks and self._one_tile(b, other) == one_tile:
                self._fill(DecodeRows.padding(), b, width=other)
                self._run_step(b, other)
                return other
        return None

    def _forward(self, ids, cu_seqlens, seq_lens, block_tables, slot_mapping, state_indices
                 ) -> tuple[torch.Tensor, ...]:
        batch = ForwardBatch(input_ids=ids, cu_seqlens=cu_seqlens, seq_lens=seq_lens, block_tables=block_tables,
                             slot_mapping=slot_mapping, state_indices=state_indices, traced=True,
                             inline_cache_ops=self.inline_cache_ops)
        model = self.model
        if self.taps:
            hidden, tapped = model.model(batch, self.cache, self.taps)  # [B, D], [B, len(taps) * D]
        else:
            hidden, tapped = model.model(batch, self.cache), None
        logits = model.ctx.all_gather(model.lm_head(hidden).float(), dim=-1)  # [B, V]
        return (logits,) if tapped is None else (logits, tapped)

    def _capture_bucket(self, b: int) -> tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, ...]]:
        """Captures bucket `b`'s step as a CUDA graph over the persistent buffers (warm-up runs first)."""
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                self._call(b, self.max_blocks)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outputs = self._call(b, self.max_blocks)
        self._graphs[b] = (graph, outputs)
        logger.info("decode graphs: captured bucket %d", b)
        return graph, outputs


@dataclass(frozen=True)
class DecodeRows:
    """A decode-only step as plain host data (what every tensor-parallel rank receives): per row its input token,
    context length after the step, flat cache slot of the new latent, KDA state slot and MLA blocks."""

    ids: list[int]
    seq_lens: list[int]
    slot_mapping: list[int]
    state_slots: list[int]
    block_tables: list[list[int]]

    @classmethod
    def of(cls, pieces: Sequence, block_size: int) -> "DecodeRows":
        """From runner pieces that each compute one decode token (`DecodeGraphs.runs`)."""
        bs = block_size
        return cls(ids=[p.req.token_ids[p.start] for p in pieces], seq_lens=[p.start + 1 for p in pieces],
                   slot_mapping=[p.req.block_ids[p.start // bs] * bs + p.start % bs for p in pieces],
                   state_slots=[p.slot for p in pieces],
                   block_tables=[list(p.req.block_ids[: p.start // bs + 1]) for p in pieces])

    @classmethod
    def padding(cls) -> "DecodeRows":
        return cls([], [], [], [], [])
