"""Decode-only steps over persistent input buffers in batch-size buckets: compiled (`torch.compile`) and, on CUDA,
captured as CUDA graphs — the GPU-shaped decode step.

Contract:
- `DecodeGraphs(model, cache, config, max_num_seqs, max_blocks, scratch_slot, scratch_block)` owns device buffers
  for the largest bucket (`StepInputs`): token ids, `seq_lens`, `slot_mapping`, `state_indices` `[B]` and
  `block_tables` `[B, max_blocks]`. The scratch KDA slot and scratch MLA block (one of each, allocated beyond the pools the engine
  manages) absorb the writes of padding rows, so every row of a bucket computes and no op needs a mask or a host
  read.
- `runs(pieces, taps)`: whether a step can run here — at most as many pieces as the largest bucket, each needing
  logits (no prompt rows, no images), and either every piece one decode token, or (`verify_tokens` > 0: CPU,
  inductor, the inline cache ops, and a speculative engine) every piece a full verification of k =
  `verify_tokens` - 1 drafts whose MLA gather fits one tile (shorter ones, near a request's `max_tokens`, run eager:
  each shape would be one more build).
  A verification step is the same forward over Q = k + 1 tokens a row (its own buffers, `StepInputs`, and graphs
  per bucket): logits at every position, the KDA state after each token written to the piece's out-slot and the
  in-slot untouched (the eager verification's contract, engine/runner.py); mixed or longer verifications run eager.
- `run(DecodeRows.of(pieces, block_size))` fills the buffers of the smallest bucket holding the step (one host
  tensor, one upload; padding rows: token 0, length 1, the scratch slot and block) and runs that bucket's step: compiled forwards on CPU (one graph
  per bucket; the block-table width is a dynamic dimension, trimmed to the longest row's blocks, so a growing
  context never recompiles), a captured CUDA graph on CUDA (captured on first use of a bucket, replayed after; the
  block tables are full width and the attention kernel reads `seq_lens` on the device). Returns the logits of the
  real rows' tokens `[n*Q, V]` fp32 and, with taps, their tapped hidden rows `[n*Q, len(taps) * D]`.
- The forward is `KimiForCausalLM`'s own layers with `ForwardBatch.traced=True`: the caches are reached through
  `kernels.graph_ops`' custom ops, so compiled and eager steps compute the same thing (tests compare their greedy
  tokens and logits).
- Nothing here reads a device value back to the host; the caller reads the sampled ids once per step.
"""

from __future__ import annotations

import logging
import types
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from engine.compilation import CompilationConfig, checked_inductor_options, compiled_with_options
from engine.model.batch import CacheTensors, ForwardBatch
from engine.model.model import KimiForCausalLM
from engine.guard_skipping import GuardSkipping
from kernels import graph_ops, prepare_compiled_ops
from kernels.attention.torch_paged import fits_one_tile

logger = logging.getLogger(__name__)

MIN_TABLE_WIDTH = 2  # a dynamic dimension of size 0 or 1 would be specialised by torch.compile


class DecodeGraphs:
    def __init__(self, model: KimiForCausalLM, cache: CacheTensors, config: CompilationConfig, max_num_seqs: int,
                 max_blocks: int, scratch_slot: int, scratch_block: int, taps: tuple[int, ...] = (),
                 verify_tokens: int = 0):
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
        # verification steps: the inline cache ops' verify forms only, and only full ones (k + 1 tokens a row):
        # each shape is a build, and the shorter ones near a request's max_tokens are rare
        self.verify_tokens = verify_tokens if self.inline_cache_ops else 0
        self._inputs: dict[int, StepInputs] = {}  # tokens per row -> its buffers (1: decode)
        self._inputs_for(1)
        self._step = self._compiled_forward() if self.compiled else self._forward
        self.guards = GuardSkipping(self._probe_width, self._forward_code, self._bind) if self.compiled else None
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, ...]]] = {}
        self.num_runs = 0  # steps run here (tests tell graph steps from eager ones by it)
        if self.compiled:
            prepare_compiled_ops(self.device)
            self._raise_recompile_limit()
        logger.info("decode graphs: buckets %s, %s%s", list(self.buckets),
                    f"torch.compile({config.backend})" if self.compiled else "eager",
                    ", CUDA graphs" if self.capture else "")

    def runs(self, pieces: Sequence, taps: tuple[int, ...]) -> bool:
        """A decode step (one token a row), or a full verification (`verify_tokens` tokens in every row) whose
        gather fits one tile."""
        if taps != self.taps or not pieces or len(pieces) > self.buckets[-1]:
            return False
        if not all(p.needs_logits and not p.prompt_rows and not getattr(p.req, "media", None) for p in pieces):
            return False
        drafts = {len(p.draft) for p in pieces}
        if drafts == {0}:
            return all(p.num_tokens == 1 for p in pieces)
        if drafts != {self.verify_tokens - 1} or not all(p.num_tokens == 1 + len(p.draft) for p in pieces):
            return False
        width = max([MIN_TABLE_WIDTH] + [-(-(p.start + p.num_tokens) // self.block_size) for p in pieces])
        return width <= self.max_blocks and self._one_tile(self.bucket(len(pieces)), width)

    def bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def run(self, rows: DecodeRows) -> tuple[torch.Tensor, torch.Tensor | None]:
        """logits [n*Q, V] fp32 (and tapped hidden [n*Q, len(taps) * D] or None) of a step of `rows` (Q tokens a
        row: 1 for a decode)."""
        n, b, q = rows.num_rows, self.bucket(rows.num_rows), rows.tokens_per_row
        self.num_runs += 1
        if self.capture:
            if b not in self._graphs:
                self._fill(DecodeRows.padding(), b)  # warm-up and capture touch only the scratch slot and block
                self._capture_bucket(b)
            self._fill(rows, b)
            graph, outputs = self._graphs[b]
            graph.replay()
        else:
            outputs = self._call(b, q, self._fill(rows, b))
        logits, hidden = outputs if self.taps else (outputs[0], None)
        return logits[: n * q], (hidden[: n * q] if hidden is not None else None)

    # -- buffers ---------------------------------------------------------------------------------------------

    def _inputs_for(self, tokens_per_row: int) -> "StepInputs":
        if tokens_per_row not in self._inputs:
            self._inputs[tokens_per_row] = StepInputs.allocate(self.buckets[-1], tokens_per_row, self.max_blocks,
                                                               self.scratch_slot, self.scratch_block,
                                                               self.block_size, self.device)
            self._raise_recompile_limit()
        return self._inputs[tokens_per_row]

    def _raise_recompile_limit(self) -> None:
        """Three graphs per bucket and tokens-per-row shape (two table-width regimes and a probe's spare)."""
        if self.compiled:
            wanted = 3 * len(self.buckets) * len(self._inputs)
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, wanted)

    def _fill(self, rows: DecodeRows, b: int, width: int | None = None) -> int:
        """Writes the step's rows (and padding up to `b`) into the buffers of its tokens per row with one upload;
        -> the table width (`width`: a wider table than the rows need, padded with the scratch block)."""
        bs, pad, q = self.block_size, b - rows.num_rows, rows.tokens_per_row
        if width is None:
            width = self.max_blocks if self.capture else max([MIN_TABLE_WIDTH] + [-(-s // bs) for s in rows.seq_lens])
        tables = []
        for blocks in rows.block_tables:
            tables.extend(blocks + [self.scratch_block] * (width - len(blocks)))
        tables.extend([self.scratch_block] * (width * pad))
        scratch_slot = self.scratch_block * bs
        values = (rows.ids + [0] * (pad * q) + rows.seq_lens + [q] * pad + rows.slot_mapping
                  + [scratch_slot] * (pad * q) + rows.state_slots + [self.scratch_slot] * pad)
        if q > 1:  # an unkept state (-1) goes to the scratch slot: the verify forms write every token's
            values += [s if s >= 0 else self.scratch_slot for s in rows.out_slots] + [self.scratch_slot] * (pad * q)
        self._inputs_for(q).upload(values + tables, b, width)
        return width

    # -- the step --------------------------------------------------------------------------------------------

    def _compiled_forward(self):
        options = checked_inductor_options(self.config, self.device.type) if self.config.backend == "inductor" else None
        return compiled_with_options(self._own_forward(), self.config.backend, options, dynamic=False)

    def _own_forward(self):
        """`_forward` bound to this instance over a copy of its code object: Dynamo caches graphs (and counts its
        recompile limit) per code object, so each engine in a process keeps its own graphs instead of every engine's
        piling onto one `_forward` until Dynamo falls back to eager for all of them."""
        self._forward_code = DecodeGraphs._forward.__code__.replace()  # equal, but a new object
        return self._bind(self._forward_code)

    def _bind(self, code: types.CodeType):
        """`code` (`_forward`'s, or the bytecode Dynamo made of it) as a method of this instance."""
        return types.MethodType(types.FunctionType(code, DecodeGraphs._forward.__globals__, "_forward"), self)

    def _call(self, b: int, q: int, width: int) -> tuple[torch.Tensor, ...]:
        if not self.compiled:
            return self._run_step(b, q, width)
        variant = (b, q, self._one_tile(b, width))
        return self.guards.call(variant, width, lambda direct: self._run_step(b, q, width, direct))

    def _run_step(self, b: int, q: int, width: int, direct=None) -> tuple[torch.Tensor, ...]:
        """One step of bucket `b`: the compiled function, or `direct` (Dynamo's bytecode for this variant, called
        without its frame hook: engine/guard_skipping.py)."""
        step = self._inputs_for(q)
        tables = step.block_tables[:b, :width]
        if self.compiled:
            # dynamic, and the graph may narrow it (the inline MLA decode guards on a one-tile width)
            torch._dynamo.maybe_mark_dynamic(tables, 1)
        out_slots = step.out_slots[: b * q] if step.out_slots is not None else None
        torch.set_flush_denormal(True)  # as KimiForCausalLM.forward (subnormal KDA states slow every matmul)
        try:
            with torch.inference_mode():
                return (direct or self._step)(step.ids[: b * q], step.cu_seqlens[: b + 1], step.seq_lens[:b], tables,
                                              step.slot_mapping[: b * q], step.state_indices[:b], out_slots)
        finally:
            torch.set_flush_denormal(False)

    def _one_tile(self, b: int, width: int) -> bool:
        """Which of the two table-width regimes a step is in (the inline MLA decode's guard, kernels/graph_ops.py)."""
        kv = next(iter(self.cache.kv.values()), None)  # every MLA layer's pool has the same shape
        return kv is not None and fits_one_tile(b, self._inputs_for(1).block_tables[:b, :width], kv)

    def _probe_width(self, variant: tuple[int, int, bool], width: int) -> int | None:
        """A padding step of `variant`'s bucket at another width of the same regime (None when it has only one):
        compiles nothing unless the graph specialised on the width. Touches only the scratch slot and block."""
        b, q, one_tile = variant
        for other in (width + 1, width - 1):
            if MIN_TABLE_WIDTH <= other <= self.max_blocks and self._one_tile(b, other) == one_tile:
                self._fill(DecodeRows.padding(q), b, width=other)
                self._run_step(b, q, other)
                return other
        return None

    def _forward(self, ids, cu_seqlens, seq_lens, block_tables, slot_mapping, state_indices, out_slots=None
                 ) -> tuple[torch.Tensor, ...]:
        batch = ForwardBatch(input_ids=ids, cu_seqlens=cu_seqlens, seq_lens=seq_lens, block_tables=block_tables,
                             slot_mapping=slot_mapping, state_indices=state_indices, state_out_slots=out_slots,
                             traced=True, inline_cache_ops=self.inline_cache_ops)
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
                self._call(b, 1, self.max_blocks)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outputs = self._call(b, 1, self.max_blocks)
        self._graphs[b] = (graph, outputs)
        logger.info("decode graphs: captured bucket %d", b)
        return graph, outputs


@dataclass(frozen=True)
class DecodeRows:
    """A decode or verification step as plain host data (what every tensor-parallel rank receives): per token its
    input id, flat cache slot of its latent and (a verification) the KDA slot keeping the state after it (-1: not
    kept); per row its context length after the step, KDA state slot and MLA blocks. Every row has
    `tokens_per_row` tokens (1: a decode)."""

    ids: list[int]
    seq_lens: list[int]
    slot_mapping: list[int]
    state_slots: list[int]
    block_tables: list[list[int]]
    out_slots: list[int] = field(default_factory=list)  # [n * tokens_per_row] when tokens_per_row > 1
    tokens_per_row: int = 1

    @property
    def num_rows(self) -> int:
        return len(self.seq_lens)

    @classmethod
    def of(cls, pieces: Sequence, block_size: int) -> "DecodeRows":
        """From runner pieces that `DecodeGraphs.runs` accepted: each one decode token, or each the request's last
        token and the same number of drafts (a verification, keeping the state after each in `out_slots`)."""
        bs, q = block_size, pieces[0].num_tokens
        ends = [p.start + p.num_tokens for p in pieces]
        return cls(ids=[t for p in pieces for t in (p.req.token_ids[p.start], *p.draft)], seq_lens=ends,
                   slot_mapping=[p.req.block_ids[t // bs] * bs + t % bs for p in pieces
                                 for t in range(p.start, p.start + p.num_tokens)],
                   state_slots=[p.slot for p in pieces],
                   block_tables=[list(p.req.block_ids[: -(-end // bs)]) for p, end in zip(pieces, ends)],
                   out_slots=[s for p in pieces for s in p.out_slots or [-1] * (q - 1) + [p.slot]] if q > 1 else [],
                   tokens_per_row=q)

    @classmethod
    def padding(cls, tokens_per_row: int = 1) -> "DecodeRows":
        return cls([], [], [], [], [], tokens_per_row=tokens_per_row)


@dataclass(frozen=True)
class StepInputs:
    """The persistent device buffers of one tokens-per-row shape Q, sized for the largest bucket B: ids,
    `slot_mapping` (and for Q > 1 `out_slots`) `[B*Q]`, `seq_lens`, `state_indices` `[B]`, `cu_seqlens` `[B+1]`
    (every row Q tokens) and `block_tables` `[B, max_blocks]`, plus a host staging tensor (pinned on CUDA)."""

    ids: torch.Tensor
    seq_lens: torch.Tensor
    slot_mapping: torch.Tensor
    state_indices: torch.Tensor
    out_slots: torch.Tensor | None
    block_tables: torch.Tensor
    cu_seqlens: torch.Tensor
    staging: torch.Tensor

    @classmethod
    def allocate(cls, top: int, q: int, max_blocks: int, scratch_slot: int, scratch_block: int, block_size: int,
                 device: torch.device) -> "StepInputs":
        def full(n, value, dtype=torch.int64):
            return torch.full((n,), value, dtype=dtype, device=device)

        tokens = top * q
        return cls(ids=full(tokens, 0), seq_lens=full(top, q), slot_mapping=full(tokens, scratch_block * block_size),
                   state_indices=full(top, scratch_slot), out_slots=full(tokens, scratch_slot) if q > 1 else None,
                   block_tables=torch.full((top, max_blocks), scratch_block, dtype=torch.int32, device=device),
                   cu_seqlens=torch.arange(0, tokens + 1, q, dtype=torch.int64, device=device),
                   staging=torch.empty(2 * top + (3 if q > 1 else 2) * tokens + top * max_blocks, dtype=torch.int64,
                                       pin_memory=device.type == "cuda"))

    def upload(self, values: list[int], b: int, width: int) -> None:
        """`values` (ids, seq_lens, slot_mapping, state_indices[, out_slots], tables, as `_fill` lays them out for
        `b` rows) into the buffers: one host tensor, one upload."""
        q = self.ids.shape[0] // self.seq_lens.shape[0]
        host = self.staging[: len(values)]
        host.copy_(torch.tensor(values, dtype=torch.int64))
        dev = host.to(self.ids.device, non_blocking=True)
        at = 0
        for buffer, n in ((self.ids, b * q), (self.seq_lens, b), (self.slot_mapping, b * q), (self.state_indices, b),
                          (self.out_slots, b * q if q > 1 else 0)):
            if n:
                buffer[:n].copy_(dev[at: at + n])
                at += n
        self.block_tables[:b, :width].copy_(dev[at:].view(b, width))
