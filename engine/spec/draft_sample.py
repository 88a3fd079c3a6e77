"""How a model drafter turns its logits into draft tokens (`draft_sample_method`, vLLM's names).

Contract: `DraftSampler(method)`; `method` is "greedy" (argmax; the proposal is deterministic, `Draft.probs` None)
or "probabilistic" (a sample from softmax(logits) at temperature 1, the raw draft distribution; `Draft.probs` holds
that distribution). A probabilistic draw for (request, position) comes from a generator seeded by
sha256(req_id, position) alone, so drafts do not depend on batch composition or call order.
`pick(logits [V] fp32, req_id, position) -> (token, probs [V] or None)`.
"""

from __future__ import annotations

import hashlib

import torch

DRAFT_SAMPLE_METHODS = ("greedy", "probabilistic")


class DraftSampler:
    def __init__(self, method: str):
        if method not in DRAFT_SAMPLE_METHODS:
            raise ValueError(f"draft_sample_method {method!r}: expected one of {DRAFT_SAMPLE_METHODS}")
        self.method = method

    @property
    def deterministic(self) -> bool:
        return self.method == "greedy"

    def pick(self, logits: torch.Tensor, req_id: str, position: int) -> tuple[int, torch.Tensor | None]:
        if self.deterministic:
            return int(logits.argmax()), None
        probs = logits.float().softmax(-1)  # [V]
        digest = hashlib.sha256(f"{req_id}:{position}".encode()).digest()
        gen = torch.Generator(device="cpu").manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))
        token = int(torch.multinomial(probs.cpu(), 1, generator=gen))
        return token, probs.cpu()
