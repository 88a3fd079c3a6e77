"""The budget steering (engine/structured/budget.py) measures the way to the end by walking the sequence's own
matcher and rolling it back, not on forks (issue 27 point 3: a fork deep-copies the parse state, ~1 s per fork for
a 2,000-way `anyOf`, and the guard near the budget forked once per candidate token: seconds per token on the step
thread).

- Same decisions: along random walks through an `anyOf` schema (tiny-k3's tokenizer, max_tokens 64, so the guard
  and the steering act), every mask `GrammarBackend.fill` gives equals the one the fork-based measurement (the
  previous code, kept here as the reference) gives, and the matcher is left where it was. Negative control: a
  steering whose walk is not rolled back gives different masks (the test can tell).
- Cheaper: along a walk through a 300-way `anyOf` the steering forks nothing, where the fork-based reference forks
  at every measurement (the control that the count can fail); the CPU times are printed (~100x on a 2,000-way
  `anyOf`: 79 s -> 0.5 s for 56 tokens, docs/benchmarks.md).
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import xgrammar

from engine import LLM
from engine.structured import StructuredOutputParams
from engine.structured.budget import BudgetSteering

MAX_TOKENS = 64


def _any_of(n: int) -> StructuredOutputParams:
    schema = {"anyOf": [{"type": "object", "properties": {f"key{i}": {"type": "string"}}, "required": [f"key{i}"]}
                        for i in range(n)]}
    return StructuredOutputParams("json_schema", json_schema=schema, output_format="kimi_k3")


class _Forking(BudgetSteering):
    """The reference: the previous measurement, on forks of the matcher."""

    def _fits_after(self, state, token, budget):
        matcher = state.matcher.fork()
        return matcher.accept_token(token) and self._walk(matcher, budget) <= budget

    def _steered_length(self, matcher, limit):
        return self._walk(matcher.fork(), limit)

    def _walk(self, matcher, limit):
        bitmask = self._xgr.allocate_token_bitmask(1, self.vocab_size)
        count = 0
        while not matcher.is_completed():
            if count >= limit:
                return limit + 1
            matcher.fill_next_token_bitmask(bitmask, 0)
            if not matcher.accept_token(self._steer_token(bitmask[0])):
                return limit + 1
            count += 1
        return count + 1


class _NotRolledBack(BudgetSteering):
    """The negative control: the walk advances the sequence's matcher and leaves it there."""

    def _steered_length(self, matcher, limit):
        return _Forking._walk(self, matcher, limit)


@pytest.fixture(scope="module")
def backend(tiny_k3_dir):
    llm = LLM(tiny_k3_dir, kv_cache_memory=16 << 20, max_num_seqs=2, enable_prefix_caching=False)
    return llm.engine.constrained.backend(), tuple(llm.engine.eos_token_ids)


def _walk(backend, stops, params, steering_cls, seed: int) -> tuple[list[bytes], float]:
    """(each step's mask bytes, CPU seconds of the fills) along a walk of random allowed tokens."""
    backend._steering.__class__ = steering_cls
    try:
        rng = np.random.default_rng(seed)
        state = backend.new_state(params, stops)
        masks, spent = [], 0.0
        for i in range(MAX_TOKENS):
            start = time.process_time()
            mask = backend.fill([state], [MAX_TOKENS - i])
            spent += time.process_time() - start
            masks.append(mask[0].numpy().tobytes())
            allowed = backend._steering._allowed_ids(mask[0])
            if not len(allowed) or not state.accept(int(rng.choice(allowed))) or state.is_terminated:
                break
        return masks, spent
    finally:
        backend._steering.__class__ = BudgetSteering


def test_rollback_measures_what_forks_measured(backend):
    backend, stops = backend
    params = _any_of(40)
    for seed in range(4):
        rolled, _ = _walk(backend, stops, params, BudgetSteering, seed)
        forked, _ = _walk(backend, stops, params, _Forking, seed)
        assert rolled == forked, seed
        assert len(rolled) > 5
    assert any(_walk(backend, stops, params, _NotRolledBack, seed)[0] != _walk(backend, stops, params, _Forking,
                                                                                seed)[0] for seed in range(4))


def test_the_steering_never_forks_the_matcher(backend, monkeypatch):
    """The cost the issue measured was the forks (each a copy of the whole parse state, growing with the grammar):
    along the same walk through a 300-way `anyOf` the steering forks nothing now, where the reference forked at
    every measurement. The CPU times are printed (one run here: 0.06 s against 0.13-0.57 s; ~100x on the 2,000-way
    grammar, docs/benchmarks.md)."""
    backend, stops = backend
    forks = []
    fork = xgrammar.GrammarMatcher.fork
    monkeypatch.setattr(xgrammar.GrammarMatcher, "fork", lambda self: forks.append(1) or fork(self))
    params = _any_of(300)
    backend.compile(params)
    counted = {}
    for cls in (BudgetSteering, _Forking):
        forks.clear()
        masks, spent = _walk(backend, stops, params, cls, seed=0)
        counted[cls] = (len(forks), spent, len(masks))
    print(f"steering on a 300-way anyOf: rollback {counted[BudgetSteering][1]:.3f} s CPU, forks "
          f"{counted[_Forking][1]:.3f} s")
    assert counted[BudgetSteering][0] == 0 and counted[_Forking][0] > 10, counted
