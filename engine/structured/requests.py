"""`ConstrainedRequests`: the engine's structured-output bookkeeping (which running requests carry a grammar) and
its grammar compiles off the step thread.

Contract:
- `backend()` builds the `GrammarBackend` on first use (thread-safe: one build); a model without a tokenizer raises
  `InvalidRequestError`. `warm()` builds it now (what a worker does before it reports SERVING, so the first
  structured request neither imports xgrammar nor builds the vocabulary on the step thread).
- `compile_async(params)` -> a `concurrent.futures.Future` of the compiled grammar, compiled on one of
  `COMPILE_THREADS` compile threads at the lowest CPU priority (engine/background.py; the backend built there first
  when needed), so the step thread never compiles:
  `AsyncEngine` awaits it before the request reaches the engine (a request waits for its grammar, the others keep
  stepping). Requests for one grammar share one compile (by `StructuredOutputParams.key`) and the backend's LRU
  cache keeps the result; a grammar that cannot be built fails the future with `InvalidRequestError`. A compile
  cannot be interrupted: one past its caller's deadline finishes in the background and is cached.
  `close()` drops the compiles not started yet.
- The rest runs on the step thread. `attach(req, carried)` gives a request with `params.structured` its matcher,
  advanced past `carried` output tokens (an imported request's); after the grammar ends only its stop tokens may
  follow, and they always finish the sequence (even with `ignore_eos`). A carried token outside the grammar raises
  `InvalidRequestError`.
- `fill_masks(reqs, max_model_len)` returns the bitmask rows of the requests about to be sampled, or None when none
  of them (or none at all running) has a grammar: then a step does no grammar work.
- `advance(req, token)` moves the matcher past a sampled token (False, logged, when the grammar rejects it);
  `release(req)` drops a finished request's matcher.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading

import torch

from engine.background import background_executor
from engine.errors import InvalidRequestError
from engine.structured.backend import GrammarBackend
from engine.structured.params import StructuredOutputParams

logger = logging.getLogger(__name__)

COMPILE_THREADS = 2  # a slow grammar holds one; the other keeps serving cold ones


class ConstrainedRequests:
    def __init__(self, tokenizer, vocab_size: int):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self._backend: GrammarBackend | None = None
        self._build_lock = threading.Lock()
        self._lock = threading.Lock()
        self._compiling: dict[str, concurrent.futures.Future] = {}  # key -> the compile in progress
        self._executor = background_executor(COMPILE_THREADS, "kdamesh-grammar")  # lowest CPU priority
        self.count = 0  # unfinished requests with a grammar

    def backend(self) -> GrammarBackend:
        if self._backend is None:
            if self.tokenizer is None:
                raise InvalidRequestError("structured output needs the model's tokenizer", param="response_format")
            with self._build_lock:
                if self._backend is None:
                    self._backend = GrammarBackend(self.tokenizer, self.vocab_size)
        return self._backend

    def warm(self) -> None:
        """Builds the backend now when the model has a tokenizer (else nothing: structured output is refused)."""
        if self.tokenizer is not None:
            self.backend()

    def compile_async(self, params: StructuredOutputParams) -> concurrent.futures.Future:
        backend = self._backend
        if backend is not None and backend.is_cached(params):
            done: concurrent.futures.Future = concurrent.futures.Future()
            done.set_result(backend.compile(params))
            return done
        with self._lock:
            future = self._compiling.get(params.key)
            if future is None:
                future = self._executor.submit(lambda: self.backend().compile(params))
                self._compiling[params.key] = future
                started = True
            else:
                started = False
        if started:
            future.add_done_callback(lambda _: self._forget(params.key))
        return future

    def _forget(self, key: str) -> None:
        with self._lock:
            self._compiling.pop(key, None)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

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
