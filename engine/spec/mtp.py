"""The `mtp` drafter: K3's own multi-token-prediction layer, chained k times (engine/spec/drafter.py contract).

Contract (beyond the drafter contract):
- `taps = (FINAL_TAP,)`: the target's final hidden state before `model.norm`, as vLLM hands it to `kimi_k3_mtp`.
- Per request the drafter keeps the MTP layer's own latent cache: row t (position t) is computed from the target's
  `h_t` and the token at t + 1 (engine/spec/mtp_model.py), so it exists once token t + 1 is known; the hidden of
  the last observed position waits for the next token (the next `observe`, or the query's last token in
  `propose`). The hidden rows of the last `num_speculative_tokens + 1` observed positions are kept too, so a
  `rollback(n)` within them leaves exactly the state of a run that observed positions < n; a deeper one (e.g.
  preemption back to 0) forgets the request, which then drafts from what it observes next. Cache rows are a pure function of (h_t, token t+1), never of drafts.
- `propose`: the query's last token is at position p = `len(token_ids) - 1`; the drafter must have observed up to
  p - 1 (else it proposes nothing for that query). Step 1 reads (h_{p-1}, token p) at position p - 1; step j + 1
  reads (the MTP output of step j, draft j) at position p - 1 + j, each attending the cache plus the steps
  before it (their rows are temporary). Each step's logits give one draft (`draft_sample_method`).
- Only checkpoints with exactly one MTP layer draft (the released layout); more are refused by name.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.spec.draft_sample import DraftSampler
from engine.spec.drafter import FINAL_TAP, Draft, Drafter, DraftQuery
from engine.spec.mtp_model import MTPError, MTPLayer, load_mtp_layers


@dataclass
class _Request:
    base: int  # position of cache row 0
    rows: torch.Tensor  # [n, C] cache rows of positions base .. base + n - 1
    tail: torch.Tensor  # [m, D] target hidden of positions end - m .. end - 1
    end: int  # one past the last observed position

    @property
    def waiting(self) -> bool:
        """The hidden of position end - 1 waits for token `end` (its cache row is not computed yet)."""
        return self.tail.shape[0] > 0 and self.base + self.rows.shape[0] == self.end - 1


class MTPDrafter(Drafter):
    taps = (FINAL_TAP,)

    def __init__(self, layer: MTPLayer, num_speculative_tokens: int, sample_method: str = "greedy"):
        self.layer, self.k = layer, int(num_speculative_tokens)
        self.sampler = DraftSampler(sample_method)
        self.requests: dict[str, _Request] = {}

    def _empty(self, start: int) -> _Request:
        p = next(self.layer.parameters())
        return _Request(base=start, rows=p.new_zeros(0, self.layer.config.mla.cache_dim),
                        tail=p.new_zeros(0, self.layer.config.hidden_size), end=start)

    @torch.inference_mode()
    def observe(self, req_id: str, start: int, token_ids: Sequence[int], hidden: torch.Tensor | None) -> None:
        state = self.requests.get(req_id)
        if state is not None and start < state.end:
            self.rollback(req_id, start)
            state = self.requests.get(req_id)
        if state is None or start != state.end:  # fresh, or after a gap: start over from here
            state = self.requests[req_id] = self._empty(start)
        n = len(token_ids)
        if n == 0:
            return
        ids = torch.tensor(list(token_ids), dtype=torch.int64, device=state.rows.device)
        hidden = hidden.to(state.tail.dtype)  # [n, D]
        if state.waiting:  # the waiting hidden pairs with this call's first token
            row_hidden, next_ids, first = torch.cat([state.tail[-1:], hidden[:-1]]), ids, start - 1
        else:
            row_hidden, next_ids, first = hidden[:-1], ids[1:], start
        if next_ids.numel():
            positions = torch.arange(first, first + next_ids.numel(), device=ids.device)
            x = self.layer.fuse_inputs(row_hidden, next_ids, positions)
            state.rows = torch.cat([state.rows, self.layer.cache_rows(x, positions)])
        state.tail = torch.cat([state.tail, hidden])[-(self.k + 1):]
        state.end = start + n

    @torch.inference_mode()
    def propose(self, queries: Sequence[DraftQuery]) -> list[Draft]:
        return [self._propose_one(q) for q in queries]

    def _propose_one(self, query: DraftQuery) -> Draft:
        state = self.requests.get(query.req_id)
        p = len(query.token_ids) - 1
        num = min(query.num_tokens, self.k)
        if state is None or num <= 0 or state.end != p or not state.waiting or p < 1:
            return Draft(tokens=())
        hidden, token, rows = state.tail[-1:], int(query.token_ids[-1]), state.rows
        tokens, probs = [], []
        for j in range(num):
            position = torch.tensor([p - 1 + j], device=rows.device)
            x = self.layer.fuse_inputs(hidden, torch.tensor([token], device=rows.device), position)
            hidden = self.layer.block(x, position, rows)  # [1, D], pre-norm: the next step's hidden
            rows = torch.cat([rows, self.layer.cache_rows(x, position)])
            token, prob = self.sampler.pick(self.layer.logits(hidden)[0], query.req_id, p + 1 + j)
            tokens.append(token)
            probs.append(prob)
        return Draft(tokens=tuple(tokens), probs=None if self.sampler.deterministic else torch.stack(probs))

    def rollback(self, req_id: str, num_tokens: int) -> None:
        state = self.requests.get(req_id)
        if state is None or num_tokens >= state.end:
            return
        keep_tail = num_tokens - (state.end - state.tail.shape[0])  # tail rows at positions < num_tokens
        if num_tokens <= state.base or keep_tail <= 0:
            self.requests.pop(req_id)  # nothing usable stays: the next observe starts afresh
            return
        state.rows = state.rows[: max(0, num_tokens - 1 - state.base)]  # row t needs token t + 1 < num_tokens
        state.tail = state.tail[:keep_tail]
        state.end = num_tokens

    def release(self, req_id: str) -> None:
        self.requests.pop(req_id, None)


def build_mtp_drafter(target_model, target_dir: Path, spec_config) -> MTPDrafter:
    """The `mtp` drafter of a loaded target (`KimiForCausalLM`) from its own checkpoint folder."""
    if spec_config.model not in (None, "", str(target_dir)):
        raise MTPError(f"method 'mtp' reads the MTP layers of the served checkpoint; speculative_config.model "
                       f"{spec_config.model!r} must be unset (or the served model's folder)")
    layers = load_mtp_layers(target_model, target_dir)
    if len(layers) != 1:
        raise MTPError(f"{target_dir} has {len(layers)} MTP layers (num_nextn_predict_layers); the mtp drafter "
                       "drafts with exactly one")
    return MTPDrafter(layers[0], spec_config.num_speculative_tokens, spec_config.draft_sample_method)


def build(config, target) -> Drafter:
    """The speculative core's factory form (`DRAFTER_FACTORIES`): `config` a `SpeculativeConfig`, `target` a
    `DraftTarget` (its `model` and `model_dir`)."""
    return build_mtp_drafter(target.model, Path(target.model_dir), config)
