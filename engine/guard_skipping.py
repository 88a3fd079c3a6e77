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
- A call on which Dynamo tried to convert the frame and made no bytecode of it (it ran eagerly: its recompile
  limit, or a failed trace) marks the variant specialised: a direct call would run some other variant's graph.
- Should Dynamo still find no graph for a settled call (it raises before running anything), the call is run
  again with every guard evaluated and the variant unsettles.
- Compiles are counted by Dynamo's own counter (`torch._dynamo.utils.counters["stats"]["unique_graphs"]`).
- Direct calls (what vLLM's compile wrapper does): given the compiled function's own code object (`code`, one per
  engine: Dynamo caches per code object) and `bind(new_code) -> callable`, the bytecode Dynamo makes from `code`
  is captured as it compiles (`torch._dynamo.convert_frame.register_bytecode_hook`), remembered for the variant
  whose call compiled it, and once that variant settles, its calls run that bytecode directly: no Dynamo frame
  hook, no guard at all (on demo-k3's batch-1 step 2.94 -> 2.54 ms a token; docs/benchmarks.md, wave 3 session
  11). A variant whose bytecode was not seen (its graph compiled under another variant) keeps the skip stance.
- `call(variant, width, fn)` runs `fn(direct)`: `direct` is the variant's direct callable, or None where the caller
  runs its compiled function (with guards, or under the skip stance).
"""

from __future__ import annotations

import logging
import types
import weakref
from collections.abc import Callable, Hashable

import torch

logger = logging.getLogger(__name__)


def compiled_graphs() -> int:
    """Graphs Dynamo has compiled in this process so far."""
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def converted_frames() -> int:
    """Frames Dynamo has tried to convert in this process so far (a cache miss: compiled, or run eagerly)."""
    return torch._dynamo.utils.counters["frames"]["total"]


_watched: "weakref.WeakValueDictionary[int, GuardSkipping]" = weakref.WeakValueDictionary()  # id(code) -> its own
_hooked = False


def _on_bytecode(old_code: types.CodeType, new_code: types.CodeType) -> None:
    watcher = _watched.get(id(old_code))
    if watcher is not None and watcher.code is old_code:
        watcher.new_codes.append(new_code)


def _watch(code: types.CodeType, watcher: "GuardSkipping") -> None:
    global _hooked
    if not _hooked:  # one process-wide hook, dispatching by code object
        torch._dynamo.convert_frame.register_bytecode_hook(_on_bytecode)
        _hooked = True
    _watched[id(code)] = watcher


class GuardSkipping:
    def __init__(self, probe: Callable[[Hashable, int], int | None], code: types.CodeType | None = None,
                 bind: Callable[[types.CodeType], Callable] | None = None):
        self.probe = probe
        self.settled: set[Hashable] = set()
        self.specialised: set[Hashable] = set()
        self.skipped_calls = 0  # calls run without the full guard check (tests read it)
        self.direct_calls = 0  # of them, calls of Dynamo's bytecode itself
        self.code, self.bind = code, bind
        self.new_codes: list[types.CodeType] = []  # what Dynamo made of `code`, in order
        self._code_of: dict[Hashable, types.CodeType] = {}
        self.direct: dict[Hashable, Callable] = {}
        if code is not None and bind is not None:
            _watch(code, self)

    def call(self, variant: Hashable, width: int, fn: Callable):
        if variant in self.direct:
            self.skipped_calls += 1
            self.direct_calls += 1
            return fn(self.direct[variant])
        if variant in self.settled:
            try:
                with torch.compiler.set_stance(skip_guard_eval_unsafe=True):
                    out = fn(None)
                self.skipped_calls += 1
                return out
            except RuntimeError as e:  # raised before the frame runs: nothing was computed
                if "skip_guard_eval_unsafe" not in str(e):
                    raise
                self.settled.discard(variant)
                logger.warning("decode graphs: variant %s needed a recompile; its guards are checked again", variant)
        before, seen, frames = compiled_graphs(), len(self.new_codes), converted_frames()
        out = fn(None)
        if compiled_graphs() != before and len(self.new_codes) > seen:
            self._code_of[variant] = self.new_codes[-1]  # this variant's graph, as Dynamo's bytecode runs it
        elif self.code is not None and converted_frames() != frames and len(self.new_codes) == seen:
            self._give_up(variant)  # Dynamo ran the call eagerly (e.g. its recompile limit): nothing to call directly
        if variant not in self.specialised and compiled_graphs() == before:
            self._settle(variant, width)
        return out

    def _give_up(self, variant: Hashable) -> None:
        if variant not in self.specialised:
            self.specialised.add(variant)
            self._code_of.pop(variant, None)
            logger.warning("compiled step: variant %s ran without a graph of its own (Dynamo fell back to eager): "
                           "its guards stay on", variant)

    def _settle(self, variant: Hashable, width: int) -> None:
        before = compiled_graphs()
        other = self.probe(variant, width)
        if compiled_graphs() == before:
            self.settled.add(variant)
            if variant in self._code_of:
                self.direct[variant] = self.bind(self._code_of[variant])
            return
        self.specialised.add(variant)
        logger.warning("decode graphs: variant %s compiled again at width %s (specialised on the table width): "
                       "its guards stay on", variant, other)
