"""The prefix hit rule, in one place and torch-free: the engine's cache manager, the workers' prefix lookups and the
gateway's per-worker prefix index (KV-event routing) all decide with it how much of a prompt a cache serves.

Contract: `resumable_blocks(num_tokens, block_size, blocks, snapshots)` is the number of leading full blocks a
request of `num_tokens` tokens resumes from: the longest prefix whose every block is present, that ends at a block
with a KDA snapshot (when `snapshots` is given: the model has KDA layers; None: any block boundary qualifies), and
leaves at least one token to compute (for logits).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable


def resumable_blocks(num_tokens: int, block_size: int, blocks: Iterable[bool], snapshots: Iterable[bool] | None) -> int:
    """The prefix hit rule, in blocks: all of `blocks` (presence of the full blocks, in order) up to the prefix
    present, a snapshot at its last block (when `snapshots` is given: the model has KDA layers), and at least one
    of `num_tokens` tokens left to compute. The iterables are read in step, up to the first absent block."""
    best = 0
    for i, (present, snapshot) in enumerate(zip(blocks, itertools.repeat(True) if snapshots is None else snapshots)):
        if not present or (i + 1) * block_size >= num_tokens:
            break
        if snapshot:
            best = i + 1
    return best
