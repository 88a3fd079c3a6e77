"""The `dspark` drafter (engine/spec/drafter.py contract) and its checkpoint folder I/O.

Contract (beyond the drafter contract; the model and folder format are engine/spec/dspark_model.py's):
- `taps` = the drafter config's `target_layer_ids`: the layer-output streams of those target layers
  (engine/model/model.py states the capture rule).
- Per request the drafter keeps each DSpark layer's latent context cache, one row per observed position; a row is
  a function of that position's tapped target rows alone, so `rollback(n)` truncates to positions < n and equals
  a run that observed only those (rollback to or before the first observed position forgets the request).
- Storage (engine/spec/draft_cache.py): one preallocated slot per request, every layer's row of position t at
  `t - base`; buffers grow by doubling, never per step. `observe` only does host bookkeeping and queues a copy of
  its hidden rows; a request's consecutive observes queue together, and the queued rows of every request go
  through `context_keys` in one batched pass before the next `propose`, inspection or rollback, when a request is
  observed out of sequence, or once `QUEUE_ROWS` of its positions wait (engine/spec/draft_cache.py).
- `propose`: the anchor is the query's last token at p = `len(token_ids) - 1`; the block `[anchor, mask, …]` of
  the drafter's trained `block_size` tokens (`num_speculative_tokens` where that is more; vLLM runs k tokens,
  which for k below the trained width changes every position's attention in the non-causal block) runs in one
  non-causal pass over the context observed before p (positions the drafter never observed are simply absent),
  then k drafts are picked left to right with the Markov bias of the previous pick (`draft_sample_method`); the
  first `num_tokens` are proposed. A request
  whose observed positions reach p or beyond (inconsistent with its tokens) gets no drafts. All queries run
  together: one pass of the layers over `[B, N]` blocks, each attending its own request's rows (a length mask over
  the longest), one Markov pick per draft position over the batch; the host reads back only the `[B, k]` draft
  ids, once (`Draft.probs` stay on the device).
- `load_dspark(folder, target)` checks the folder against the target (hidden sizes, layer ids, vocabulary) and
  loads it in the target's dtype/device: one `ConfigError`/`CheckpointError` names each problem.
  `write_dspark_checkpoint(raw, out_dir, seed)` writes a folder with seeded weights (per tensor name).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from engine.compilation import CompilationConfig
from engine.model.config import ConfigError
from engine.model.fused import attach_compact_weights, lay_out_for_gemv
from engine.model.init import sample_tensor
from engine.model.loader import CheckpointError, checkpoint_files
from engine.spec.draft_cache import QUEUE_ROWS, SlotDrafter, SlotRows
from engine.spec.draft_graphs import MIN_LENGTH, DraftGraphs
from engine.spec.draft_sample import DraftSampler
from engine.spec.drafter import Drafter, DraftQuery
from engine.spec.dspark_model import IGNORED_PREFIXES, DSparkConfig, DSparkModel, load_dspark_config

logger = logging.getLogger(__name__)


@dataclass
class _Request:
    slot: int
    base: int  # position of row 0
    end: int  # one past the last observed position: rows of positions base .. end - 1


@dataclass
class _Queued:
    """A request's observes since its last flush (contiguous positions), computed at the next flush as one."""
    slot: int
    first: int  # position of the first row
    index: int  # its row index (first - base)
    chunks: list[torch.Tensor] = field(default_factory=list)  # the rows' tapped streams [n, len(taps) * Dt], copies

    @property
    def num_rows(self) -> int:
        return sum(c.shape[0] for c in self.chunks)


class DSparkDrafter(SlotDrafter):
    def __init__(self, model: DSparkModel, num_speculative_tokens: int, sample_method: str = "greedy",
                 max_num_seqs: int = 4, capacity: int = 256, compilation: CompilationConfig | None = None):
        self.model, self.k = model, int(num_speculative_tokens)
        self.width = max(self.k, model.config.block_size)  # the block runs at the width it was trained at
        self.taps = tuple(model.config.target_layer_ids)
        self.sampler = DraftSampler(sample_method)
        self.requests: dict[str, _Request] = {}
        self.queued: dict[str, _Queued] = {}
        weight = model.context_proj.weight
        self.cache = SlotRows((len(model.layers), model.config.mla.cache_dim), weight.dtype, weight.device,
                              max_num_seqs, capacity)
        self.graphs = DraftGraphs(self, DSparkDrafter._block_drafts, compilation, weight.device, max_num_seqs,
                                  length_dims=(1, None, None, None))
        self.context_graphs = DraftGraphs(self, DSparkDrafter._context_rows, compilation, weight.device,
                                          max_num_seqs, length_dims=(0, 0))  # the queued rows' count is dynamic

    def observe(self, req_id: str, start: int, token_ids: Sequence[int], hidden: torch.Tensor | None) -> None:
        state = self.requests.get(req_id)
        queued = self.queued.get(req_id)
        if queued is not None and (state is None or start != state.end or len(token_ids) == 0):
            self.flush()  # not a continuation of its queued rows: those first
            queued = None
        if state is not None and start < state.end:
            self.rollback(req_id, start)
            state = self.requests.get(req_id)
        if state is None or start != state.end:  # fresh, or after a gap: start over from here
            state = self.requests[req_id] = _Request(self.cache.acquire(req_id), base=start, end=start)
        if len(token_ids) == 0:
            return
        if queued is None:
            queued = self.queued[req_id] = _Queued(state.slot, start, start - state.base)
        queued.chunks.append(hidden.clone())  # kept past this step (a captured graph reuses its outputs)
        state.end = start + len(token_ids)
        if state.end - queued.first >= QUEUE_ROWS:
            self.flush()

    @torch.inference_mode()
    def flush(self) -> None:
        """Every queued row through `context_keys` in one batched pass, stored at its slot and index."""
        if not self.queued:
            return
        queued, self.queued = list(self.queued.values()), {}
        chunks = [c for q in queued for c in q.chunks]
        hidden = torch.cat(chunks) if len(chunks) > 1 else chunks[0]  # [N, n*Dt]
        spans = [range(q.num_rows) for q in queued]
        positions = self.ids(q.first + i for q, span in zip(queued, spans) for i in span)
        index = [q.index + i for q, span in zip(queued, spans) for i in span]
        self.cache.reserve(max(index) + 1)
        n = hidden.shape[0]
        if self.context_graphs.compiled:  # at least MIN_LENGTH rows: the last one repeated, its copies dropped
            extra = max(MIN_LENGTH - n, 0)
            rows = self.context_graphs(torch.cat([hidden, hidden[-1:].expand(extra, -1)]),
                                       torch.cat([positions, positions[-1:].expand(extra)]))[:n]
        else:
            rows = self._context_rows(hidden, positions)
        self.cache.write(self.ids(q.slot for q, span in zip(queued, spans) for _ in span), self.ids(index), rows)

    def _context_rows(self, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Tapped rows [N, len(taps) * Dt] at positions [N] -> every layer's cache row [N, layers, C] (compiled
        where the drafter's block is: engine/spec/draft_graphs.py)."""
        return torch.stack(self.model.context_keys(hidden, positions), dim=1)

    def _can_draft(self, query: DraftQuery) -> bool:
        state = self.requests.get(query.req_id)
        p = len(query.token_ids) - 1
        return min(query.num_tokens, self.k) > 0 and p >= 0 and (state is None or state.end <= p)

    def _draft(self, queries: list[DraftQuery], steps: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        n = len(queries)
        bucket = self.graphs.bucket(n)
        pad = (bucket or n) - n  # padding rows: slot 0 with no context rows, mask tokens anchored at 0
        states = [self.requests.get(q.req_id) for q in queries]
        lens = [0 if s is None else s.end - s.base for s in states] + [0] * pad  # never observed: no context
        slots = self.ids([0 if s is None else s.slot for s in states] + [0] * pad)
        ctx = self.cache.gather(slots, max(max(lens), MIN_LENGTH))  # [B, S, layers, C]; past a row's own: padding
        anchors = self.ids([len(q.token_ids) - 1 for q in queries] + [0] * pad)  # [B]
        mask = self.model.config.mask_token_id
        block = self.ids(v for q in queries for v in [int(q.token_ids[-1])] + [mask] * (self.width - 1))
        block = torch.cat([block.reshape(n, self.width), block.new_full((pad, self.width), mask)])  # [B, N]
        args = (ctx, self.ids(lens), anchors, block)
        out = self.graphs(*args) if bucket is not None else self._block_drafts(*args)
        if self.sampler.deterministic:
            return out[:n, :steps], None
        return self._picks(out[:n], block[:n, 0], anchors[:n], [q.req_id for q in queries], steps)

    def _block_drafts(self, ctx: torch.Tensor, ctx_lens: torch.Tensor, anchors: torch.Tensor,
                      block: torch.Tensor) -> torch.Tensor:
        """The compiled step (engine/spec/draft_graphs.py): ctx [B, S, layers, C], ctx_lens [B], anchors [B],
        block [B, N] -> greedy: the draft ids [B, N]; sampled: the base logits [B, N, V] (the draws stay eager)."""
        base = self.model.request_blocks(anchors, block, ctx, ctx_lens)  # [B, N, V]
        if not self.sampler.deterministic:
            return base
        return self._picks(base, block[:, 0], anchors, None, self.k)[0]

    def _picks(self, base: torch.Tensor, first: torch.Tensor, anchors: torch.Tensor, req_ids, steps: int
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Left-to-right picks, each with the Markov bias of the one before (the anchor's token `first` [B] for
        the first) -> ids [B, steps], probabilities [B, steps, V] or None."""
        prev, picked, probs = first, [], []
        for i in range(steps):
            prev, prob = self.sampler.pick_rows(base[:, i] + self.model.markov_head(prev), req_ids, anchors + 1 + i)
            picked.append(prev)
            probs.append(prob)
        return torch.stack(picked, 1), None if self.sampler.deterministic else torch.stack(probs, 1)

    def rollback(self, req_id: str, num_tokens: int) -> None:
        state = self.requests.get(req_id)
        if state is None or num_tokens >= state.end:
            return
        if req_id in self.queued:
            self.flush()  # its queued rows as observed; the rows past num_tokens are then out of range
        if num_tokens <= state.base:
            self.release(req_id)
            return
        state.end = num_tokens

    def context_rows(self, req_id: str) -> torch.Tensor:
        """The request's rows [end - base, layers, C] (a copy; for tests and tools)."""
        self.flush()
        state = self.requests[req_id]
        return self.cache.buffer[state.slot, : state.end - state.base].clone()


def check_against_target(config: DSparkConfig, target_config) -> None:
    """The drafter must read streams the target has and share its embedding / LM head."""
    problems = []
    if config.hidden_size != target_config.hidden_size:
        problems.append(f"hidden_size {config.hidden_size} != the target's {target_config.hidden_size} "
                        "(the embedding and LM head are shared)")
    if config.target_hidden_size != target_config.hidden_size:
        problems.append(f"target_hidden_size {config.target_hidden_size} != {target_config.hidden_size}")
    if config.vocab_size != target_config.vocab_size:
        problems.append(f"vocab_size {config.vocab_size} != the target's {target_config.vocab_size}")
    bad = [i for i in config.target_layer_ids if not 0 <= i < target_config.num_hidden_layers]
    if bad:
        problems.append(f"target_layer_ids {bad} are not layers of the target (0..{target_config.num_hidden_layers - 1})")
    if problems:
        raise ConfigError("DSpark drafter does not match the target: " + "; ".join(problems))


def load_dspark(folder: str | Path, target) -> DSparkModel:
    config = load_dspark_config(folder)
    check_against_target(config, target.config)
    model = DSparkModel(config, target.model.embed_tokens, target.lm_head)
    params = dict(model.named_parameters())
    header: dict[str, tuple[Path, tuple[int, ...]]] = {}
    for path in checkpoint_files(Path(folder)):
        with safe_open(str(path), framework="pt") as f:
            header.update({n: (path, tuple(f.get_slice(n).get_shape())) for n in f.keys()})
    used = {n: v for n, v in header.items() if not n.startswith(IGNORED_PREFIXES)}
    missing = sorted(set(params) - set(used))
    unexpected = sorted(set(used) - set(params))
    misshaped = sorted(f"{n}: checkpoint {list(s)}, model expects {list(params[n].shape)}"
                       for n, (_, s) in used.items() if n in params and tuple(params[n].shape) != s)
    if missing or unexpected or misshaped:
        raise CheckpointError(f"{folder}: DSpark checkpoint does not match its config: missing {missing}, "
                              f"unexpected {unexpected}, mis-shaped {misshaped}")
    with torch.no_grad():
        for name, (path, _) in used.items():
            with safe_open(str(path), framework="pt") as f:
                params[name].copy_(f.get_tensor(name))
    logger.info("loaded DSpark drafter from %s (%d layers, taps %s)", folder, config.num_layers, config.target_layer_ids)
    model = model.to(device=target.device, dtype=target.dtype).eval().requires_grad_(False)
    if torch.device(target.device).type == "cpu":
        lay_out_for_gemv(model)  # as the loader lays out a CPU target: input-major where one-row products stream
        attach_compact_weights(model)  # and exact bf16 copies where the checkpoint is bf16
    return model


def write_dspark_checkpoint(raw: dict, out_dir: str | Path, seed: int = 0, dtype: torch.dtype = torch.float32) -> Path:
    """A `k3_dspark` folder with seeded weights (each drawn by its name alone)."""
    config = DSparkConfig.from_dict(raw)
    shapes = {n: tuple(p.shape) for n, p in DSparkModel(config, torch.nn.Identity(), torch.nn.Identity())
              .named_parameters()}
    tensors = {n: sample_tensor(f"dspark:{n}", s, seed).to(dtype).contiguous() for n, s in shapes.items()}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def build_dspark_drafter(target_model, drafter_dir: Path, spec_config, max_num_seqs: int = 4,
                        compilation: CompilationConfig | None = None) -> DSparkDrafter:
    """The `dspark` drafter for a loaded target from its own folder (`speculative_config.model`); its step is
    compiled where `compilation` compiles (engine/spec/draft_graphs.py)."""
    return DSparkDrafter(load_dspark(drafter_dir, target_model), spec_config.num_speculative_tokens,
                         spec_config.draft_sample_method, max_num_seqs, compilation=compilation)


def build(config, target) -> Drafter:
    """The speculative core's factory form (`DRAFTER_FACTORIES`): `config` a `SpeculativeConfig`, `target` a
    `DraftTarget` (its `model` and `model_dir`)."""
    return build_dspark_drafter(target.model, Path(config.model), config, target.max_num_seqs, target.compilation)
