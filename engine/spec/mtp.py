"""The `mtp` drafter: K3's own multi-token-prediction layer, chained k times (engine/spec/drafter.py contract).

Contract (beyond the drafter contract):
- `taps = (FINAL_TAP,)`: the target's final hidden state before `model.norm`, as vLLM hands it to `kimi_k3_mtp`.
- Per request the drafter keeps the MTP layer's own latent cache: row t (position t) is computed from the target's
  `h_t` and the token at t + 1 (engine/spec/mtp_model.py), so it exists once token t + 1 is known; the hidden of
  the last observed position waits for the next token (the next `observe`, or the query's last token in
  `propose`). The hidden rows of the last `num_speculative_tokens + 1` observed positions are kept too, so a
  `rollback(n)` within them leaves exactly the state of a run that observed positions < n; a deeper one (e.g.
  preemption back to 0) forgets the request, which then drafts from what it observes next. Cache rows are a pure
  function of (h_t, token t+1), never of drafts.
- Storage (engine/spec/draft_cache.py): one preallocated slot per request, cache rows at `position - base`, the
  kept hidden rows in a ring of `k + 1` beside them (`position % (k + 1)`); buffers grow by doubling, never per step.
  `observe` only does host bookkeeping and queues a copy of its rows; a request's consecutive observes queue
  together (computed as one observe of their whole span), and the queued rows of every request are computed in one
  batched pass (`fuse_inputs` + `cache_rows` over all of them) before the next `propose`, inspection or rollback,
  when a request is observed out of sequence, or once `QUEUE_ROWS` of its positions wait
  (engine/spec/draft_cache.py).
- `propose`: the query's last token is at position p = `len(token_ids) - 1`; the drafter must have observed up to
  p - 1 (else it proposes nothing for that query). Step 1 reads (h_{p-1}, token p) at position p - 1; step j + 1
  reads (the MTP output of step j, draft j) at position p - 1 + j, each attending the cache plus the steps
  before it (their rows are temporary). Each step's logits give one draft (`draft_sample_method`). All queries
  run together: one forward of the layer per draft step over the batch, each row attending its own cache (a
  length mask over the longest); the host reads back only the `[B, k]` draft ids, once (`Draft.probs` stay on the
  device).
- Only checkpoints with exactly one MTP layer draft (the released layout); more are refused by name.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.compilation import CompilationConfig
from engine.spec.draft_cache import QUEUE_ROWS, SlotDrafter, SlotRows
from engine.spec.draft_graphs import MIN_LENGTH, DraftGraphs
from engine.spec.draft_sample import DraftSampler
from engine.spec.drafter import FINAL_TAP, Drafter, DraftQuery
from engine.spec.mtp_model import MTPError, MTPLayer, load_mtp_layers


@dataclass
class _Request:
    slot: int
    base: int  # position of cache row 0
    num_rows: int = 0  # cache rows of positions base .. base + num_rows - 1
    end: int = 0  # one past the last observed position
    held_from: int = 0  # the ring holds the hidden of positions held_from .. end - 1 (at most k + 1 of them)

    @property
    def waiting(self) -> bool:
        """The hidden of position end - 1 waits for token `end` (its cache row is not computed yet)."""
        return self.end > self.held_from and self.base + self.num_rows == self.end - 1


@dataclass
class _Queued:
    """A request's observes since its last flush (contiguous positions), computed at the next flush as one."""
    slot: int
    base: int  # the request's position of cache row 0
    start: int  # position of the first observed token
    waiting: bool  # the request's held hidden (position start - 1) pairs with the first token
    ids: list[int] = field(default_factory=list)  # the observed tokens
    chunks: list[torch.Tensor] = field(default_factory=list)  # their hidden rows [n, D], copies

    def plan(self, ring_size: int) -> dict[str, list[int]]:
        """Row lists of the whole span as one observe: `sources` (rows of the span's hidden feeding cache rows,
        after the held one's), `next_ids` (token t + 1 of each cache row), `positions` (t), `index` (t - base),
        `ring` (rows kept in the ring: the last k + 1) and `ring_positions`."""
        n, start = len(self.ids), self.start
        first = start - 1 if self.waiting else start
        positions = list(range(first, start + n - 1))
        kept = min(n, ring_size)
        return {"sources": list(range(n - 1)), "next_ids": self.ids if self.waiting else self.ids[1:],
                "positions": positions, "index": [t - self.base for t in positions],
                "ring": list(range(n - kept, n)), "ring_positions": list(range(start + n - kept, start + n))}


class MTPDrafter(SlotDrafter):
    taps = (FINAL_TAP,)

    def __init__(self, layer: MTPLayer, num_speculative_tokens: int, sample_method: str = "greedy",
                 max_num_seqs: int = 4, capacity: int = 256, compilation: CompilationConfig | None = None):
        self.layer, self.k = layer, int(num_speculative_tokens)
        self.ring_size = self.k + 1
        self.sampler = DraftSampler(sample_method)
        self.requests: dict[str, _Request] = {}
        self.queued: dict[str, _Queued] = {}
        p = next(layer.parameters())
        self.cache = SlotRows((layer.config.mla.cache_dim,), p.dtype, p.device, max_num_seqs, capacity,
                              side_shape=(self.ring_size, layer.config.hidden_size))
        self.graphs = DraftGraphs(self, MTPDrafter._greedy_chain, compilation, p.device, max_num_seqs,
                                  length_dims=(1, 1, None, None, None))

    # -- observe: host bookkeeping now, the rows at the next flush -------------------------------------------

    def observe(self, req_id: str, start: int, token_ids: Sequence[int], hidden: torch.Tensor | None) -> None:
        state = self.requests.get(req_id)
        queued = self.queued.get(req_id)
        if queued is not None and (state is None or start != state.end or not token_ids):
            self.flush()  # not a continuation of its queued rows: those first
            queued = None
        if state is not None and start < state.end:
            self.rollback(req_id, start)
            state = self.requests.get(req_id)
        if state is None or start != state.end:  # fresh, or after a gap: start over from here
            state = self.requests[req_id] = _Request(self.cache.acquire(req_id), base=start, end=start,
                                                     held_from=start)
        n = len(token_ids)
        if n == 0:
            return
        waiting = state.waiting  # the waiting hidden pairs with this call's first token
        if queued is None:
            queued = self.queued[req_id] = _Queued(state.slot, state.base, start, waiting)
        queued.ids.extend(int(t) for t in token_ids)
        queued.chunks.append(hidden.clone())  # kept past this step (a captured graph reuses its outputs)
        state.num_rows += n - 1 + waiting  # cache rows of positions (start - 1 if waiting else start) .. end - 2
        state.end = start + n
        state.held_from = max(state.held_from, state.end - self.ring_size)
        if len(queued.ids) >= QUEUE_ROWS:
            self.flush()

    @torch.inference_mode()
    def flush(self) -> None:
        """Computes every queued cache row in one batched pass and stores rows and ring entries."""
        if not self.queued:
            return
        queued, self.queued = list(self.queued.values()), {}
        plans = [q.plan(self.ring_size) for q in queued]
        chunks = [c for q in queued for c in q.chunks]
        hidden = (torch.cat(chunks) if len(chunks) > 1 else chunks[0]).to(self.cache.dtype)  # [N, D]
        offsets = list(itertools.accumulate((len(q.ids) for q in queued), initial=0))
        sources, waiting_rows, waiting_slots, waiting_ring = [], [], [], []
        for q, plan, at in zip(queued, plans, offsets):
            if q.waiting:
                waiting_rows.append(len(sources))
                waiting_slots.append(q.slot)
                waiting_ring.append((q.start - 1) % self.ring_size)
                sources.append(at)  # placeholder: replaced by the held hidden
            sources.extend(at + i for i in plan["sources"])
        row_hidden = hidden.index_select(0, self.ids(sources))  # [R, D]
        if waiting_rows:  # read before this flush's ring writes (k + 1 new rows wrap onto it)
            row_hidden[self.ids(waiting_rows)] = self.cache.side[self.ids(waiting_slots), self.ids(waiting_ring)]
        self._store_ring(queued, plans, hidden, offsets)
        if not sources:
            return
        positions = self.ids(t for plan in plans for t in plan["positions"])
        x = self.layer.fuse_inputs(row_hidden, self.ids(t for plan in plans for t in plan["next_ids"]), positions)
        index = [i for plan in plans for i in plan["index"]]
        self.cache.reserve(max(index) + 1)
        slots = self.ids(q.slot for q, plan in zip(queued, plans) for _ in plan["index"])
        self.cache.write(slots, self.ids(index), self.layer.cache_rows(x, positions))

    def _store_ring(self, queued: list[_Queued], plans: list[dict], hidden: torch.Tensor, offsets: list[int]) -> None:
        rows = self.ids(at + i for plan, at in zip(plans, offsets) for i in plan["ring"])
        slots = self.ids(q.slot for q, plan in zip(queued, plans) for _ in plan["ring"])
        ring = self.ids(t % self.ring_size for plan in plans for t in plan["ring_positions"])
        self.cache.side.index_put_((slots, ring), hidden.index_select(0, rows))

    # -- propose: all queries in one batched pass per draft step ---------------------------------------------

    def _can_draft(self, query: DraftQuery) -> bool:
        state = self.requests.get(query.req_id)
        p = len(query.token_ids) - 1
        return (state is not None and min(query.num_tokens, self.k) > 0 and p >= 1 and state.end == p
                and state.waiting)

    def _draft(self, queries: list[DraftQuery], steps: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        n = len(queries)
        states = [self.requests[q.req_id] for q in queries]
        lens = [s.num_rows for s in states]
        bucket = self.graphs.bucket(n)
        if not (self.sampler.deterministic and steps == self.k):
            bucket = None  # the compiled chain: greedy, all k drafts (fewer only near a request's max_tokens)
        pad = (bucket or n) - n  # padding rows: slot 0 with no cache rows, token 0 at position 0
        length = max(max(lens), MIN_LENGTH)
        slots = self.ids([s.slot for s in states] + [0] * pad)
        keys = self.cache.gather(slots, length)  # [B, L, C]; rows past a request's own: padding
        visible = torch.arange(length, device=self.device)[None, :] < self.ids(lens + [0] * pad)[:, None]  # [B, L]
        ring = self.ids([(s.end - 1) % self.ring_size for s in states] + [0] * pad)
        hidden = self.cache.side[slots, ring]  # [B, D]
        token = self.ids([int(q.token_ids[-1]) for q in queries] + [0] * pad)  # [B]
        position = self.ids([s.end - 1 for s in states] + [0] * pad)  # [B] position p - 1
        if bucket is not None:
            return self.graphs(keys, visible, hidden, token, position)[:n], None
        return self._chain(keys, visible, hidden, token, position, [q.req_id for q in queries], steps)

    def _greedy_chain(self, keys: torch.Tensor, visible: torch.Tensor, hidden: torch.Tensor, token: torch.Tensor,
                      position: torch.Tensor) -> torch.Tensor:
        """The compiled step (engine/spec/draft_graphs.py): all k greedy drafts -> ids [B, k]."""
        return self._chain(keys, visible, hidden, token, position, None, self.k)[0]

    def _chain(self, keys: torch.Tensor, visible: torch.Tensor, hidden: torch.Tensor, token: torch.Tensor,
               position: torch.Tensor, req_ids, steps: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`steps` chained draft steps: keys [B, L, C] (each row's cache), visible [B, L], hidden [B, D] (h at
        position p - 1), token [B] (token p), position [B] (p - 1) -> ids [B, steps], probabilities
        [B, steps, V] or None. Each step sees the cache and the steps before it (their rows appended)."""
        picked, probs = [], []
        for j in range(steps):
            x = self.layer.fuse_inputs(hidden, token, position + j)
            hidden, own = self.layer.step(x, position + j, keys, visible)  # [B, D], [B, C]
            keys = torch.cat([keys, own[:, None].to(keys.dtype)], dim=1)
            visible = torch.cat([visible, visible.new_ones(visible.shape[0], 1)], dim=1)
            token, prob = self.sampler.pick_rows(self.layer.logits(hidden), req_ids, position + j + 2)
            picked.append(token)
            probs.append(prob)
        return torch.stack(picked, 1), None if self.sampler.deterministic else torch.stack(probs, 1)

    # -- rollback, release, inspection -----------------------------------------------------------------------

    def rollback(self, req_id: str, num_tokens: int) -> None:
        state = self.requests.get(req_id)
        if state is None or num_tokens >= state.end:
            return
        if req_id in self.queued:
            self.flush()  # its queued rows as observed, then forgotten by the bookkeeping below
        if num_tokens <= state.base or num_tokens <= state.held_from:
            self.release(req_id)  # nothing usable stays: the next observe starts afresh
            return
        state.num_rows = min(state.num_rows, max(0, num_tokens - 1 - state.base))  # row t needs token t + 1
        state.end = num_tokens

    def cached_rows(self, req_id: str) -> torch.Tensor:
        """The request's cache rows [num_rows, C] (a copy; for tests and tools)."""
        self.flush()
        state = self.requests[req_id]
        return self.cache.buffer[state.slot, : state.num_rows].clone()

    def held_hidden(self, req_id: str) -> torch.Tensor:
        """The kept hidden rows [m, D] of positions end - m .. end - 1 (a copy; for tests and tools)."""
        self.flush()
        state = self.requests[req_id]
        ring = [t % self.ring_size for t in range(state.held_from, state.end)]
        return self.cache.side[state.slot, self.ids(ring)].clone()


def build_mtp_drafter(target_model, target_dir: Path, spec_config, max_num_seqs: int = 4,
                      compilation: CompilationConfig | None = None) -> MTPDrafter:
    """The `mtp` drafter of a loaded target (`KimiForCausalLM`) from its own checkpoint folder; its greedy chain
    is compiled where `compilation` compiles (engine/spec/draft_graphs.py)."""
    if spec_config.model not in (None, "", str(target_dir)):
        raise MTPError(f"method 'mtp' reads the MTP layers of the served checkpoint; speculative_config.model "
                       f"{spec_config.model!r} must be unset (or the served model's folder)")
    layers = load_mtp_layers(target_model, target_dir)
    if len(layers) != 1:
        raise MTPError(f"{target_dir} has {len(layers)} MTP layers (num_nextn_predict_layers); the mtp drafter "
                       "drafts with exactly one")
    return MTPDrafter(layers[0], spec_config.num_speculative_tokens, spec_config.draft_sample_method, max_num_seqs,
                      compilation=compilation)


def build(config, target) -> Drafter:
    """The speculative core's factory form (`DRAFTER_FACTORIES`): `config` a `SpeculativeConfig`, `target` a
    `DraftTarget` (its `model` and `model_dir`)."""
    return build_mtp_drafter(target.model, Path(target.model_dir), config, target.max_num_seqs, target.compilation)
