"""`ConstrainedRequests`: the engine's structured-output bookkeeping (which running requests carry a grammar).

Contract (the step thread calls everything):
- `backend()` builds the `GrammarBackend` on first use; a model without a tokenizer raises `InvalidRequestError`.
- `attach(req, carried)` gives a request with `params.structured` its matcher, advanced past `carried` output
  tokens (an imported request's); after the grammar ends only its stop tokens may follow, and they always finish
  the sequence (even with `ignore_eos`). A carried token outside the grammar raises `InvalidRequestError`.
- `fill_masks(reqs, max_model_len)` returns the bitmask rows of the requests about to be sampled, or None when none
  of them (or none at all running) has a grammar: then a step does no grammar work.
- `advance(req, token)` moves the matcher past a sampled token (False, logged, when the grammar rejects it);
  `release(req)` drops a finished request's matcher.
"""

from __future__ import annotations

import logging

import torch

from engine.errors import InvalidRequestError
from engine.structured.backend import GrammarBackend

logger = logging.getLogger(__name__)


class ConstrainedRequests:
    def __init__(self, tokenizer, vocab_size: int):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self._backend: GrammarBackend | None = None
        self.count = 0  # unfinished requests with a grammar

    def backend(self) -> GrammarBackend:
        if self._backend is None:
            if self.tokenizer is None:
                raise InvalidRequestError("structured output needs the model's tokenizer", param="response_format")
            self._backend = GrammarBackend(self.tokenizer, self.vocab_size)
        return self._backend

    def attach(self, req, carried: list[int] = ()) -> None:
        if req.params.structured is None:
            return
        state = self.backend().new_state(req.params.structured, sorted(req.output.stop_ids))
        for token in carried:
            if not state.accept(token):
                raise InvalidRequestError("the carried output does not follow the request's grammar",
                                          param="response_format")
        req.output.stop_ids |= set(state.stop_token_ids)
        req.grammar = state
        self.count += 1

    def fill_masks(self, reqs: list, max_model_len: int) -> torch.Tensor | None:
        if not self.count or all(r.grammar is None for r in reqs):
            return None
        left = [min(r.max_tokens - r.num_output_tokens, max_model_len - r.num_tokens) for r in reqs]
        return self.backend().fill([r.grammar for r in reqs], left)

    @staticmethod
    def advance(req, token: int) -> bool:
        if req.grammar is None or req.grammar.accept(token):
            return True
        logger.error("request %s: sampled token %d is outside its grammar; aborting it", req.request_id, token)
        return False

    def release(self, req) -> None:
        if req.grammar is not None:
            req.grammar = None
            self.count -= 1
