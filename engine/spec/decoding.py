"""The engine side of speculative decoding: which requests draft, verifying their drafts, settling the caches.

Contract (one `SpecDecoding` per `EngineCore` with a `speculative_config`; every call from the step thread):
- `propose(running)` before the scheduler runs: every running request with one token left to compute (a decode)
  gets `req.draft` from the drafter, at most `num_speculative_tokens` tokens (with a
  `num_speculative_tokens_per_batch_size` schedule: the k of the running batch's size, 0 for none) and never
  more than its `max_tokens` and the context limit leave room for. Requests that cannot speculate run plain in the same batch: those with a
  grammar (structured output: the grammar's mask decides each token from the state after the previous one, so
  verifying k positions at once would need k matcher states; they are few, and correct first).
- The scheduler makes a verification of it (engine/scheduler.py), the runner computes it in one forward with logits
  at every position and the KDA state after each one in the group's scratch slots (engine/runner.py).
- Verification itself runs for all verifying rows of a step at once in engine/step_sampling.py (the sampler's own
  processing at every position, then engine/spec/accept.py); `record(num_drafts, accepted)` counts each one.
- `settle(req, start, kept)` after the engine appended `kept` of those tokens (fewer when one finished the
  request): `CacheManager.settle_verification` (the running slot becomes the kept position's, the blocks past it
  are freed) -> the states map for `CacheManager.commit`.
- `observe(chunks, hidden)` tells the drafter which positions were committed in the step (the accepted part of a
  verification, the whole of a prefill chunk or decode), with the tapped hidden rows when the drafter has taps.
  `preempted(reqs)` rolls the drafter back to 0, `finished(req)` releases it.
- Counters in vLLM's sense: `num_drafts` (verifications with at least one draft), `num_draft_tokens`,
  `num_accepted_tokens`, `accepted_per_pos[i]` (drafts accepted at position i); mean acceptance length =
  1 + accepted / drafts.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.request import Request
from engine.spec.config import SpeculativeConfig
from engine.spec.drafter import Draft, DraftQuery, Drafter


class SpecDecoding:
    def __init__(self, config: SpeculativeConfig, drafter: Drafter, manager, max_model_len: int):
        self.config = config
        self.drafter = drafter
        self.manager = manager
        self.max_model_len = max_model_len
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * config.num_speculative_tokens

    # -- before the step -------------------------------------------------------------------------------------

    def room(self, req: Request, k: int) -> int:
        """Drafts the request may verify now, at most `k` (0: it runs plain)."""
        if req.grammar is not None or req.num_tokens - req.num_computed_tokens != 1:
            return 0
        return max(0, min(k, req.max_tokens - req.num_output_tokens - 1, self.max_model_len - req.num_tokens))

    def propose(self, running: Sequence[Request]) -> None:
        k = self.config.tokens_for_batch(len(running))
        asked = [(req, n) for req in running if (n := self.room(req, k)) > 0]
        if not asked:
            return
        drafts = self.drafter.propose([DraftQuery(req.request_id, req.token_ids, n) for req, n in asked])
        for (req, n), draft in zip(asked, drafts):
            if draft.tokens:
                probs = draft.probs[:n] if draft.probs is not None else None
                req.draft = Draft(tuple(int(t) for t in draft.tokens[:n]), probs)

    # -- verification (engine/step_sampling.py verifies every row of a step at once) ----------------------------

    def record(self, num_drafts: int, accepted: int) -> None:
        """Counts one verification of `num_drafts` drafts of which the first `accepted` were accepted."""
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += accepted
        for i in range(accepted):
            self.accepted_per_pos[i] += 1

    # -- after the step --------------------------------------------------------------------------------------

    def settle(self, req: Request, start: int, kept: int) -> dict[int, int]:
        return self.manager.settle_verification(req, start, kept)

    def observe(self, chunks, hidden: torch.Tensor | None) -> None:
        """chunks: the step's `ScheduledChunk`s, `num_computed_tokens` already advanced; hidden: the runner's tapped
        rows of every token of the step, in chunk order."""
        at = 0
        for chunk in chunks:
            req = chunk.req
            n = req.num_computed_tokens - chunk.start
            if not req.status.finished and n > 0:
                rows = hidden[at: at + n] if hidden is not None else None
                self.drafter.observe(req.request_id, chunk.start, req.token_ids[chunk.start: chunk.start + n], rows)
            at += chunk.num_tokens

    def preempted(self, reqs: Sequence[Request]) -> None:
        for req in reqs:
            self.drafter.rollback(req.request_id, 0)

    def finished(self, req: Request) -> None:
        req.draft = None
        self.drafter.release(req.request_id)

    def clear(self, running: Sequence[Request]) -> None:
        """Drafts live for one step."""
        for req in running:
            req.draft = None

    @property
    def mean_acceptance_length(self) -> float:
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0
