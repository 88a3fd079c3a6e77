"""`ngram`: prompt-lookup drafting (vLLM's `method: ngram`), no weights.

Contract: for a query whose tokens (prompt + output) end in an n-gram that occurred before, for the largest n in
[`prompt_lookup_min`, `prompt_lookup_max`] that has an earlier occurrence, the drafts are the tokens that followed
its earliest occurrence, at most `num_tokens` of them and never past the known tokens (vLLM's semantics:
`_find_longest_matched_ngram_and_propose_tokens`). No match, or fewer tokens than `prompt_lookup_min`: no drafts.
The drafter keeps no state (`taps` empty; observe / rollback / release do nothing). Host-side by nature (it reads
the token lists the engine holds); each query costs O(n_max · length) in numpy, no Python work per token.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from engine.spec.config import SpeculativeConfig
from engine.spec.drafter import Draft, DraftQuery, Drafter, DraftTarget


def lookup(tokens: Sequence[int], min_n: int, max_n: int, k: int) -> tuple[int, ...]:
    """The drafts prompt lookup proposes after `tokens` (see the module docstring). Per n, one vectorised scan
    (n array comparisons over the tokens), no Python loop over candidate positions."""
    total = len(tokens)
    if total < min_n or k <= 0:
        return ()
    arr = np.asarray(tokens, dtype=np.int64)
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        suffix = arr[total - n:]
        match = arr[: total - n] == suffix[0]  # candidate starts before the suffix itself
        for i in range(1, n):
            match &= arr[i: total - n + i] == suffix[i]
        if match.any():
            follow = int(match.argmax()) + n  # the earliest occurrence
            return tuple(int(t) for t in arr[follow: min(total, follow + k)])
    return ()


class NgramDrafter(Drafter):
    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n

    def propose(self, queries: Sequence[DraftQuery]) -> list[Draft]:
        return [Draft(lookup(q.token_ids, self.min_n, self.max_n, q.num_tokens)) for q in queries]


def build(config: SpeculativeConfig, target: DraftTarget) -> NgramDrafter:
    return NgramDrafter(config.prompt_lookup_min, config.prompt_lookup_max)
