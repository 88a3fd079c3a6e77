"""The grammar backend of one engine: xgrammar compiler and cache, per-sequence matchers, logits masks.

Contract:
- `GrammarBackend(tokenizer, vocab_size)` (one per engine, built on first use or by a worker before it serves —
  xgrammar is imported only then) compiles grammars (engine/structured/grammar.py) for one tokenizer with an LRU
  cache of `GRAMMAR_CACHE_SIZE` keyed by `StructuredOutputParams.key` (the canonical JSON of the schema or tools and
  the options), shared by all requests; a grammar that cannot be built raises `InvalidRequestError`. `compile` is
  thread-safe (engine/structured/requests.py runs it on compile threads); `is_cached(params)` says whether it would
  return at once. `new_state(params, stop_token_ids)` makes one `GrammarState` (matcher) per sequence: after the
  grammar completes only those stop tokens are allowed.
- `fill(states, tokens_left) -> bitmask` [len(states), ceil(V/32)] int32 (CPU): row i allows what `states[i]`
  allows (all when None), narrowed by `BudgetSteering.fit` so the sequence still ends within `tokens_left[i]`
  (engine/structured/budget.py). `apply(logits, bitmask, rows)` sets the disallowed entries of `logits[rows]` to
  -inf, in place, on the logits' device.
- Special tokens: the control markers of the families (`<|open|>`, `<|close|>`, `<|sep|>`; the K2 tool-call markers
  and `<think>`/`</think>`) can only be produced as their special ids, and only where the grammar puts a marker;
  every other special id is never allowed except the stop tokens once the grammar is complete. (In the vocabulary
  given to xgrammar a marker is a backslash, a NUL byte and its name — text that no JSON string, regex or literal
  of these grammars can hold — and grammars match it by id; other specials are empty, which xgrammar never
  matches.)
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from engine.errors import InvalidRequestError
from engine.structured.budget import BudgetSteering, GrammarState
from engine.structured.grammar import FAMILY_MARKERS, GrammarBuilder
from engine.structured.params import StructuredOutputParams

if TYPE_CHECKING:
    import torch

GRAMMAR_CACHE_SIZE = 256
MARKER_PREFIX = b"\\\x00"  # a backslash then NUL: impossible inside JSON, regexes and our literals


class GrammarBackend:
    """Compiles `StructuredOutputParams` for one tokenizer and masks logits (see the module docstring)."""

    def __init__(self, tokenizer, vocab_size: int, max_threads: int | None = None):
        import xgrammar as xgr

        self._xgr = xgr
        self.vocab_size = vocab_size
        vocab, self.marker_ids = _xgrammar_vocab(tokenizer, vocab_size)
        self.eos_token_ids = tuple(tokenizer.stop_token_ids)
        info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=vocab_size,
                                 stop_token_ids=list(self.eos_token_ids) or None)
        self._compiler = xgr.GrammarCompiler(info, max_threads=max_threads or min(8, os.cpu_count() or 1),
                                             cache_enabled=False)
        self._cache: OrderedDict[str, Any] = OrderedDict()
        self._lock = threading.Lock()
        text = {c: tokenizer.token_to_id(c) for c in '"]},0{['}
        self._steering = BudgetSteering(xgr, vocab, self.eos_token_ids, self.marker_ids,
                                        {c: t for c, t in text.items() if t is not None})

    def is_cached(self, params: StructuredOutputParams) -> bool:
        with self._lock:
            return params.key in self._cache

    def compile(self, params: StructuredOutputParams):
        """The compiled grammar (cached by `params.key`); InvalidRequestError when it cannot be built."""
        with self._lock:
            compiled = self._cache.get(params.key)
            if compiled is not None:
                self._cache.move_to_end(params.key)
                return compiled
        tag = GrammarBuilder(params, self.marker_ids).build()
        try:
            compiled = self._compiler.compile_structural_tag(tag)
        except Exception as exc:
            message = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
            raise InvalidRequestError(f"structured output: the grammar cannot be built: {message}",
                                      param="tools" if params.kind == "tool_call" else "response_format") from None
        with self._lock:
            self._cache[params.key] = compiled
            while len(self._cache) > GRAMMAR_CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def new_state(self, params: StructuredOutputParams, stop_token_ids: Sequence[int]) -> GrammarState:
        """A fresh matcher; after the grammar completes only `stop_token_ids` are allowed."""
        stops = tuple(sorted(set(stop_token_ids))) or self.eos_token_ids
        if not stops:
            raise InvalidRequestError("structured output needs a stop token (the model declares none)",
                                      param="stop_token_ids")
        matcher = self._xgr.GrammarMatcher(self.compile(params), override_stop_tokens=list(stops))
        return GrammarState(matcher, stops, params.finish_within_budget)

    def fill(self, states: Sequence[GrammarState | None], tokens_left: Sequence[int]) -> torch.Tensor:
        """A bitmask [len(states), ceil(V/32)] int32 (CPU); see the module docstring."""
        bitmask = self._xgr.allocate_token_bitmask(len(states), self.vocab_size)
        for row, state in enumerate(states):
            if state is None:
                continue
            state.fill(bitmask, row)
            if state.finish_within_budget and not state.is_completed:
                self._steering.fit(bitmask, row, state, tokens_left[row])
        return bitmask

    def apply(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int]) -> None:
        """Sets disallowed entries of `logits[rows]` ([L, V] fp32) to -inf, in place."""
        self._xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True),
                                              vocab_size=self.vocab_size, indices=list(rows))


def _xgrammar_vocab(tokenizer, vocab_size: int) -> tuple[list[bytes], dict[str, int]]:
    """-> (each id's bytes as xgrammar sees them, the family markers' ids); see the module docstring."""
    vocab: list[bytes] = []
    marker_ids: dict[str, int] = {}
    markers = {m for family in FAMILY_MARKERS.values() for m in family}
    for token_id in range(vocab_size):
        if token_id >= tokenizer.vocab_size:
            vocab.append(b"")  # padding rows of the model's vocabulary: never allowed
        elif tokenizer.is_special(token_id):
            content = tokenizer.id_to_bytes(token_id)
            name = content.decode("utf-8", errors="replace")
            if name in markers:
                marker_ids[name] = token_id
                vocab.append(MARKER_PREFIX + content)
            else:
                vocab.append(b"")  # xgrammar treats empty tokens as special: never allowed
        else:
            vocab.append(tokenizer.id_to_bytes(token_id))
    return vocab, marker_ids
