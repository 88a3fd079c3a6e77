"""`GuardSkipping`: run a compiled step without evaluating Dynamo's guards once its graph is known to be the one
the guards would pick — what vLLM's compile wrapper does by calling its compiled code directly.

Contract:
- A compiled callable's calls are grouped into *variants* (for the decode step: a bucket and a table-width regime).
  `call(variant, width, fn)` runs `fn` with every guard evaluated until the variant is *settled*, and then under
  `torch.compiler.set_stance(skip_guard_eval_unsafe=True)`, where Dynamo checks only the guards that tell its cached
  graphs apart (at batch 1 on demo-k3 the full check cost 0.9 of a 7 ms step; after: 0.2).
- A variant settles after a call that compiled nothing and a *probe* (`probe(variant, width)`: the same variant at
  another width, the caller's padding step) that compiled nothing either: the graph is shared across widths, not
  specialised on one. A probe that compiles marks the variant specialised: its guards are always evaluated (the
  step stays correct, only slower), logged once.
- A variant whose probe returns None (no other width exists in its regime) settles after one clean call.
- Should Dynamo still find no graph for a settled call (it raises before running anything), the call is run
  again with every guard evaluated and the variant unsettles.
- Compiles are counted by Dynamo's own counter (`torch._dynamo.utils.counters["stats"]["unique_graphs"]`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable

import torch

logger = logging.getLogger(__name__)


def compiled_graphs() -> int:
    """Graphs Dynamo has compiled in this process so far."""
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


class GuardSkipping:
    def __init__(self, probe: Callable[[Hashable, int], int | None]):
        self.probe = probe
        self.settled: set[Hashable] = set()
        self.specialised: set[Hashable] = set()
        self.skipped_calls = 0  # calls run without the full guard check (tests read it)

    def call(self, variant: Hashable, width: int, fn: Callable):
        if variant in self.settled:
            try:
                with torch.compiler.set_stance(skip_guard_eval_unsafe=True):
                    out = fn()
                self.skipped_calls += 1
                return out
            except RuntimeError as e:  # raised before the frame runs: nothing was computed
                if "skip_guard_eval_unsafe" not in str(e):
                    raise
                self.settled.discard(variant)
                logger.warning("decode graphs: variant %s needed a recompile; its guards are checked again", variant)
        before = compiled_graphs()
        out = fn()
        if variant not in self.specialised and compiled_graphs() == before:
            self._settle(variant, width)
        return out

    def _settle(self, variant: Hashable, width: int) -> None:
        before = compiled_graphs()
        other = self.probe(variant, width)
        if compiled_graphs() == before:
            self.settled.add(variant)
            return
        self.specialised.add(variant)
        logger.warning("decode graphs: variant %s compiled again at width %s (specialised on the table width): "
                       "its guards stay on", variant, other)
