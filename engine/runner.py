"""The model runner: owns the cache tensors and turns a `SchedulerOutput` into one model step.

Contract:
- `execute(out)` first applies `out.state_inits` (zero a fresh request's running slot, or copy a snapshot into it),
  then builds packed `ForwardBatch`es (chunks in `out.chunks` order; block tables, slot mapping from each
  request's `block_ids`, its running slot) and runs `KimiForCausalLM.forward` on them. It returns fp32 logits
  `[L, vocab]`, one row per chunk that `needs_logits`, in chunk order. It does not change any request.
  `execute_with_prompt_rows` also returns, per chunk, the logits at its first `prompt_rows` positions (prompt
  logprobs, a per-request opt-in computed in the same forward; chunks that ask none add no rows).
- A step of more than `max_forward_tokens` tokens runs as several forwards, in order, of at most that many tokens:
  whole chunks while they fit, and a longer chunk as consecutive pieces (chunked prefill within the step: a piece
  continues from the KV and state its predecessor wrote). Sequences never interact, so this changes results only
  by rounding. `max_forward_tokens=None`: `CPU_FORWARD_TOKENS` on CPU (every activation of a forward then stays
  below glibc's 32 MiB mmap threshold and is reused from the heap; larger ones are mapped and page-faulted afresh in
  every forward: ~1 s of system time per 4096-token CPU step of `small-linear`), no limit on other devices.
- `execute` is `run_step(plan_step(out, running_slots))`: `plan_step` turns the scheduler's output into a `RankStep`
  (plain data: slot inits in the TP-independent layout and the packed `ForwardBatch`es) and `run_step` applies it.
  Under tensor parallelism every rank runs `run_step` with the same `RankStep` (rank 0 plans it and, in phase 2,
  broadcasts it); each rank writes its slice of a loaded state. The model's forward is a collective.
- The cache holds this rank's KDA heads (`model.num_local_kda_heads`); MLA blocks are replicated, or under
  decode-context parallelism (`plan.decode_context_parallel_size` N > 1, engine/parallel/context.py) each rank's
  blocks hold its block_size / N tokens of every block, and `read_blocks` (a collective then) / `write_blocks`
  gather / scatter them so blocks leave and enter in the DCP-independent layout. DCP steps run eager.
- Images (`media`, an `engine.vision.feed.MediaFeeder`, None for a text-only model): `plan_step` encodes the step's
  new images in one call before the first forward, and every forward's batch carries the image rows its pieces
  cover (`mm_embeds` / `mm_positions`).
- Speculative verification (engine/spec/): a chunk with `draft` tokens computes the request's last token and the
  drafts as one piece; every position gets a logits row (`1 + len(draft)` rows, in order), the piece is never cut
  across forwards, and the KDA state after each position goes to the chunk's `out_slots` (the scratch slots of the
  request's group; `ForwardBatch.state_out_slots`). Other pieces of such a forward keep their state in their own
  slot (out-slot -1 for every token but the last). Forwards without a verification are built as before.
- Drafter taps (`taps`, set by the engine from `Drafter.taps`): each forward also captures the tapped hidden rows
  of all its tokens (engine/spec/capture.py); `take_tapped()` returns those of the latest step `[T, len(taps) * D]`
  (chunk order, every token of every piece) and forgets them.
- Pipeline parallelism (`ctx.stage`): each forward's pieces are further split into up to `num_stages` micro-batches
  of whole pieces (`micro_batches`; row order unchanged) that the stages run overlapped
  (`KimiForCausalLM.forward_micro_batches`); only this stage's layers have a cache, and `read_*` / `write_*` keep
  the whole-model layout (rank 0 gathers the stages' parts; a write keeps the stage's layers).
- `copy_slots(pairs)` copies KDA state slots (snapshots after a step).
- `read_blocks` / `write_blocks` / `read_state` / `write_state` move cache contents in and out as tensors
  (`engine.transfer` serialises them): blocks as `[num_mla_layers, n, block_size, cache_dim]` in MLA layer order,
  a state as `conv [num_kda_layers, 3*H*D, W-1]` (cache dtype) and `recurrent [num_kda_layers, H, D, D]` (fp32),
  all heads whatever the TP size (engine/parallel/state.py): under TP `read_state` is a collective (an all-gather)
  and `write_state` keeps this rank's heads of the full state it is given.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from engine.compilation import CompilationConfig
from engine.config import CachePlan
from engine.decode_graphs import DecodeGraphs, DecodeRows
from engine.model.batch import CacheTensors, ForwardBatch, HostMeta
from engine.model.model import KimiForCausalLM
from engine.parallel.pipeline import StageParts
from engine.parallel.state import all_gather_state, scatter_state
from engine.request import Request
from engine.scheduler import SchedulerOutput
from kernels.indexing import slot_range

if TYPE_CHECKING:
    from engine.vision.feed import MediaFeeder

CPU_FORWARD_TOKENS = 2048


@dataclass(frozen=True)
class Piece:
    """Tokens `[start, start + num_tokens)` of a request, computed in one forward."""

    req: Request
    start: int
    num_tokens: int
    slot: int  # the request's running KDA slot
    needs_logits: bool
    prompt_rows: int = 0  # logits also at the first `prompt_rows` positions (prompt logprobs), before the last's
    draft: tuple[int, ...] = ()  # speculative verification: draft tokens after the request's known tokens
    out_slots: tuple[int, ...] = ()  # verification: the KDA slot receiving the state after each position

    @property
    def num_logits(self) -> int:
        """Sampling rows: one for the last position, or one per position of a verification."""
        return 1 + len(self.draft) if self.draft else int(self.needs_logits)


@dataclass(frozen=True)
class SlotInit:
    """One running slot's init before a step: copy snapshot `src`, or load `state` (+ `kv` into `blocks`), or zero."""

    dst: int
    src: int | None = None
    blocks: tuple[int, ...] = ()
    kv: torch.Tensor | None = None  # [num_mla_layers, n, block_size, cache_dim]
    state: dict[str, torch.Tensor] | None = None  # the TP-independent layout (or this rank's heads: state_is_local)
    state_is_local: bool = False  # `state` is already this rank's slice (the rank group sent each rank its heads)


@dataclass(frozen=True)
class RankStep:
    """Everything every rank needs for one step, as plain data (what rank 0 will broadcast in phase 2)."""

    zero_slots: list[int] = field(default_factory=list)
    inits: list[SlotInit] = field(default_factory=list)
    batches: list[ForwardBatch] = field(default_factory=list)
    taps: tuple[int, ...] = ()  # drafter taps to capture (engine/spec/capture.py)
    decode: DecodeRows | None = None  # a decode-only step for the decode graphs (then `batches` is empty)


@dataclass(frozen=True)
class GraphOptions:
    """Compiled / captured decode steps (engine/decode_graphs.py): the compilation config and the most rows a
    decode step can have, and the tokens a row of a full speculative verification (the one verification shape
    compiled). The engine passes None under `enforce_eager`."""

    compilation: CompilationConfig
    max_num_seqs: int
    verify_tokens: int = 0  # tokens a row of a full verification (k + 1 drafts' worth; 0: no speculation)

    @classmethod
    def of(cls, args) -> "GraphOptions":
        """From the engine's `EngineArgs`."""
        spec = args.speculative_config
        return cls(CompilationConfig.parse(args.compilation_config), args.max_num_seqs,
                   spec.num_speculative_tokens + 1 if spec else 0)


class ModelRunner:
    def __init__(self, model: KimiForCausalLM, plan: CachePlan, max_forward_tokens: int | None = None,
                 media: "MediaFeeder | None" = None, graphs: GraphOptions | None = None):
        self.model = model
        self.media = media
        self.config = model.config
        self.device = model.device
        if max_forward_tokens is None:
            max_forward_tokens = CPU_FORWARD_TOKENS if self.device.type == "cpu" else 1 << 62
        self.max_forward_tokens = max_forward_tokens
        self.block_size = plan.block_size
        self.ctx = model.ctx
        # One more block and slot than the engine manages: the scratch that padding rows of a decode bucket write.
        # Under pipeline parallelism only this stage's layers get a cache (the same block and slot ids everywhere).
        self.dcp = plan.decode_context_parallel_size  # > 1: this rank holds plan.rank_block_size rows of a block
        self.cache = CacheTensors.allocate(model.config, num_blocks=plan.num_blocks + 1, block_size=plan.rank_block_size,
                                           num_slots=plan.num_slots + 1, dtype=model.dtype, device=self.device,
                                           kda_heads=model.num_local_kda_heads, kv_cache_dtype=plan.kv_cache_dtype,
                                           layers=model.model.owned_layers(model.config, model.ctx))
        self.mla_layers = sorted(self.cache.kv)
        self.kda_layers = sorted(self.cache.recurrent)
        self.stages = StageParts(model.config, model.ctx.stage, plan.block_size, model.dtype, plan.kv_cache_dtype)
        self._taps: tuple[int, ...] = ()
        self._tapped: list[torch.Tensor] = []
        self.graphs = self._decode_graphs(plan, graphs)

    def _decode_graphs(self, plan: CachePlan, options: GraphOptions | None) -> DecodeGraphs | None:
        """The compiled / captured decode step, or None (enforce_eager, decode-context or pipeline parallelism, or
        nothing to compile or capture here)."""
        if plan.decode_context_parallel_size > 1 or self.ctx.stage.pipelined:  # eager: collectives inside attention,
            return None  # or streams exchanged between stages
        if options is None:
            return None
        kind = self.device.type
        if not (options.compilation.compiles(kind) or options.compilation.captures(kind)):
            return None
        max_blocks = -(-plan.max_model_len // plan.block_size)
        return DecodeGraphs(self.model, self.cache, options.compilation, options.max_num_seqs, max_blocks,
                            scratch_slot=plan.num_slots, scratch_block=plan.num_blocks,
                            verify_tokens=options.verify_tokens)

    @property
    def taps(self) -> tuple[int, ...]:
        return self._taps

    @taps.setter
    def taps(self, taps: tuple[int, ...]) -> None:
        self._taps = tuple(taps)
        if self.graphs is not None:
            self.graphs.taps = self._taps

    def execute(self, out: SchedulerOutput, running_slots: list[int]) -> torch.Tensor:
        """Runs the step; `running_slots[i]` is the KDA slot of `out.chunks[i].req`."""
        return self.run_step(self.plan_step(out, running_slots))

    def plan_step(self, out: SchedulerOutput, running_slots: list[int], prompt_rows: list[int] | None = None
                  ) -> RankStep:
        zero = [init.dst for init in out.state_inits if init.src is None and init.load is None]
        inits = [SlotInit(init.dst, src=init.src) if init.src is not None else
                 SlotInit(init.dst, blocks=tuple(init.load_blocks), kv=init.load.kv, state=init.load.state)
                 for init in out.state_inits if init.src is not None or init.load is not None]
        pieces = self._pieces(out, running_slots, prompt_rows)
        if self.graphs is not None and self.graphs.runs(pieces, self.taps):
            return RankStep(zero, inits, taps=self.taps, decode=DecodeRows.of(pieces, self.block_size))
        if self.media is not None:
            self.media.prepare(pieces)  # encodes the step's new images (one call) before any batch takes their rows
        groups = split_forwards(pieces, self.max_forward_tokens)
        if self.ctx.stage.pipelined:  # stages overlap on micro-batches of whole pieces (same row order)
            groups = [mb for group in groups for mb in micro_batches(group, self.ctx.stage.num_stages)]
        return RankStep(zero, inits, [self.build_batch(group) for group in groups], self.taps)

    @staticmethod
    def _pieces(out: SchedulerOutput, running_slots: list[int], prompt_rows: list[int] | None) -> list[Piece]:
        rows = prompt_rows or [0] * len(out.chunks)
        return [Piece(c.req, c.start, c.num_tokens, slot, c.needs_logits, n, c.draft, c.out_slots)
                for c, slot, n in zip(out.chunks, running_slots, rows)]

    def execute_with_prompt_rows(self, out: SchedulerOutput, running_slots: list[int], prompt_rows: list[int]
                                 ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """`execute`, plus for chunk i the fp32 logits `[prompt_rows[i], V]` at its first `prompt_rows[i]`
        positions (the prompt-logprob opt-in; all 0: exactly `execute`, nothing extra computed)."""
        if not any(prompt_rows):
            return self.execute(out, running_slots), self.no_prompt_rows(out)
        logits = self.run_step(self.plan_step(out, running_slots, prompt_rows))  # [rows of every forward, V]
        return self.split_prompt_rows(logits, out, running_slots, prompt_rows)

    def no_prompt_rows(self, out: SchedulerOutput) -> list[torch.Tensor]:
        return [torch.empty(0, self.config.vocab_size)] * len(out.chunks)

    def split_prompt_rows(self, logits: torch.Tensor, out: SchedulerOutput, running_slots: list[int],
                          prompt_rows: list[int]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """`run_step`'s logits of a step planned with `prompt_rows` -> (sampling rows `[L, V]`, per chunk its
        prompt rows `[prompt_rows[i], V]`)."""
        vocab = self.config.vocab_size
        sampled: list[torch.Tensor] = []
        extra: dict[int, list[torch.Tensor]] = {id(c.req): [] for c in out.chunks}
        at = 0
        for group in split_forwards(self._pieces(out, running_slots, prompt_rows), self.max_forward_tokens):
            for piece in group:  # build_batch's row order: a piece's prompt rows, then its sampling row
                extra[id(piece.req)].append(logits[at: at + piece.prompt_rows])  # [prompt_rows, V]
                at += piece.prompt_rows
                sampled.append(logits[at: at + piece.num_logits])
                at += piece.num_logits
        joined = [torch.cat(extra[id(c.req)]) if extra[id(c.req)] else torch.empty(0, vocab) for c in out.chunks]
        return (torch.cat(sampled) if sampled else torch.empty(0, vocab, device=self.device)), joined  # [L, V]

    def run_step(self, step: RankStep) -> torch.Tensor:
        """Applies the slot inits, then runs the forwards in order; fp32 logits `[L, V]`."""
        if step.zero_slots and self.kda_layers:
            self.cache.zero_slots(torch.tensor(step.zero_slots, dtype=torch.long, device=self.device))
        for init in step.inits:
            if init.src is not None:
                self.cache.copy_slot(init.src, init.dst)
            else:
                if init.blocks:  # a lean import at a block boundary carries no block
                    self.write_blocks(list(init.blocks), init.kv)
                self.write_state(init.dst, init.state, init.state_is_local)
        from engine.spec.capture import check_taps, forward_with_taps

        if step.decode is not None:
            rows, hidden = self.graphs.run(step.decode)  # [n, V], [n, len(taps) * D] or None
            self._tapped = [hidden] if hidden is not None else []
            return rows
        logits, self._tapped = [], []
        if self.ctx.stage.pipelined:
            outs = self.model.forward_micro_batches([b.to(self.device) for b in step.batches], self.cache,
                                                    check_taps(self.config.num_hidden_layers, step.taps))
            for rows, hidden in outs:
                logits.append(rows)
                if hidden is not None:
                    self._tapped.append(hidden)
            return torch.cat(logits)  # [L, V] (rank 0; [0, V] elsewhere)
        for batch in step.batches:
            rows, hidden = forward_with_taps(self.model, batch.to(self.device), self.cache, step.taps)
            logits.append(rows)
            if hidden is not None:
                self._tapped.append(hidden)
        return logits[0] if len(logits) == 1 else torch.cat(logits)  # [L, V]

    def take_tapped(self) -> torch.Tensor | None:
        """The latest step's tapped hidden rows `[T, len(taps) * D]` (None without taps); forgotten after."""
        tapped, self._tapped = self._tapped, []
        return torch.cat(tapped) if tapped else None

    def build_batch(self, pieces: list[Piece]) -> ForwardBatch:
        bs = self.block_size
        ids: list[int] = []
        cu, seq_lens, slot_mapping, logits_rows, out_slots = [0], [], [], [], []
        verifying = any(c.draft for c in pieces)
        max_blocks = max(-(-(c.start + c.num_tokens) // bs) for c in pieces)
        tables = torch.zeros(len(pieces), max_blocks, dtype=torch.int32)
        for n, chunk in enumerate(pieces):
            req, start, end = chunk.req, chunk.start, chunk.start + chunk.num_tokens
            ids.extend(req.token_ids[start:end - len(chunk.draft)])
            ids.extend(chunk.draft)
            cu.append(cu[-1] + chunk.num_tokens)
            seq_lens.append(end)
            blocks = req.block_ids[: -(-end // bs)]
            tables[n, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
            slot_mapping.extend(blocks[p // bs] * bs + p % bs for p in range(start, end))
            logits_rows.extend(range(cu[-2], cu[-2] + chunk.prompt_rows))  # prompt logprobs (opt-in)
            logits_rows.extend(range(cu[-1] - chunk.num_logits, cu[-1]))
            if verifying:  # verification pieces keep each position's state; the others only their own final one
                out_slots.extend(chunk.out_slots or [-1] * (chunk.num_tokens - 1) + [chunk.slot])
        mm_positions, mm_embeds = self.media.inputs(pieces) if self.media is not None else (None, None)
        state_slots = [c.slot for c in pieces]
        host = HostMeta(tuple(cu), tuple(seq_lens), slot_range(state_slots), tuple(out_slots) if verifying else None)
        return ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.long),
            cu_seqlens=torch.tensor(cu, dtype=torch.long),
            seq_lens=torch.tensor(seq_lens, dtype=torch.long),
            block_tables=tables,
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.long),
            state_indices=torch.tensor(state_slots, dtype=torch.long),
            logits_indices=torch.tensor(logits_rows, dtype=torch.long),
            mm_embeds=mm_embeds, mm_positions=mm_positions,  # [M, hidden], [M]
            state_out_slots=torch.tensor(out_slots, dtype=torch.long) if verifying else None,  # [T]
            host=host,
        )

    def copy_slots(self, pairs: list[tuple[int, int]]) -> None:
        for src, dst in pairs:
            self.cache.copy_slot(src, dst)

    # -- moving cache contents -------------------------------------------------------------------------------

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """[num_mla_layers, n, block_size, cache_dim] copies of the given blocks (every MLA layer of the model: under
        pipeline parallelism a collective of all stages, whose parts rank 0 gathers; other ranks get None)."""
        index = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        local = [self.cache.kv[i].index_select(0, index) for i in self.mla_layers]
        if self.dcp > 1 and local:  # [n, bs/N, row] per rank and layer -> [n, bs, row] (a DCP-group collective)
            from kernels.attention.context_parallel import gather_blocks

            gathered = self.ctx.dcp_comm.all_gather(torch.stack(local)[None], dim=0)  # [N, L, n, bs/N, row]
            local = list(gather_blocks(gathered.unbind(0)).unbind(0))
        if not self.ctx.stage.pipelined:
            return torch.stack(local).cpu()
        return self.stages.gather_blocks(local, len(block_ids), self.device)

    def write_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        """`data`: every MLA layer's blocks [L, n, block_size, row] in the DCP-independent layout; a stage keeps its
        own layers', a DCP rank its own rows."""
        index = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        if self.dcp > 1:
            from kernels.attention.context_parallel import scatter_blocks

            data = scatter_blocks(data, self.ctx.config.dcp_rank, self.dcp)
        for i in self.mla_layers:
            kv = self.cache.kv[i]
            kv.index_copy_(0, index, data[self.stages.mla_index[i]].to(kv.device, kv.dtype))

    def read_state(self, slot: int) -> dict[str, torch.Tensor]:
        """All heads of every KDA layer (under pipeline parallelism on rank 0 only, gathered from the stages)."""
        if not self.config.kda_layer_ids:
            return {}
        local = {}
        if self.kda_layers:
            local = {"conv": torch.stack([self.cache.conv[i][slot] for i in self.kda_layers]),
                     "recurrent": torch.stack([self.cache.recurrent[i][slot] for i in self.kda_layers])}
            local = all_gather_state(self.ctx, local)
        if self.ctx.stage.pipelined:
            return self.stages.gather_state(local, self.device)
        return {k: v.cpu() for k, v in local.items()}

    def write_state(self, slot: int, state: dict[str, torch.Tensor], local: bool = False) -> None:
        """`state`: the TP-independent layout of every KDA layer, or (`local`) this rank's heads already; a pipeline
        stage keeps its own layers'."""
        if self.ctx.size > 1 and state and not local:
            state = scatter_state(state, self.ctx.size, self.ctx.rank)
        for i in self.kda_layers:
            layer = self.stages.kda_index[i]
            self.cache.conv[i][slot].copy_(state["conv"][layer])
            self.cache.recurrent[i][slot].copy_(state["recurrent"][layer])

    def state_shapes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Expected shapes and dtypes of `read_state`'s tensors."""
        return self.stages.state_shapes()

    def block_shape(self) -> tuple[tuple[int, ...], torch.dtype]:
        """Shape and dtype of one block's data across MLA layers: [num_mla_layers, block_size, cache_dim]."""
        return self.stages.block_shape()


def micro_batches(pieces: list[Piece], n: int) -> list[list[Piece]]:
    """Up to `n` consecutive groups of whole pieces with about equal tokens (pipeline micro-batches), in order: a
    piece starts the next group when its middle lies past the current group's share."""
    total = sum(p.num_tokens for p in pieces)
    groups: list[list[Piece]] = [[]]
    done = 0
    for piece in pieces:
        if groups[-1] and len(groups) < n and done + piece.num_tokens / 2 > total * len(groups) / n:
            groups.append([])
        groups[-1].append(piece)
        done += piece.num_tokens
    return groups


def split_forwards(pieces: list[Piece], limit: int) -> list[list[Piece]]:
    """Groups of at most `limit` tokens, in order; a piece longer than what is left of a group is cut (only its
    last part keeps `needs_logits`), except a verification, which starts the next group instead."""
    groups: list[list[Piece]] = [[]]
    room = limit
    for piece in pieces:
        if piece.draft and piece.num_tokens > room:
            groups.append([])
            room = limit
        while piece.num_tokens > room:
            if room > 0:
                head_rows = min(piece.prompt_rows, room)
                groups[-1].append(Piece(piece.req, piece.start, room, piece.slot, False, head_rows))
                piece = Piece(piece.req, piece.start + room, piece.num_tokens - room, piece.slot, piece.needs_logits,
                              piece.prompt_rows - head_rows)
            groups.append([])
            room = limit
        groups[-1].append(piece)
        room -= piece.num_tokens
    return [g for g in groups if g]
