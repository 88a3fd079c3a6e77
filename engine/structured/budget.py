"""Finishing within max_tokens: one sequence's grammar state and the steering that narrows its mask rows.

Contract (`finish_within_budget`, on by default):
- The *steered way* to the end takes, at each step, one allowed token: the first allowed of a fixed order — stop
  tokens, closing markers (`<|close|>`, `</think>`, `<|tool_call_end|>`, …), then inside free text (a row allowing
  more than half the vocabulary: a string, reasoning) the `"` that ends a JSON string, elsewhere `]`, `}`, `,`,
  `"`, `0`, `{`, `[`, then opening markers — or else the longest allowed token (the biggest step through a
  literal). Its length is measured by walking the sequence's own matcher and rolling it back (no fork: forking
  copies the whole parse state) whenever an upper bound on it (the last measurement plus `STEER_GROWTH` per token
  since) says the budget may be close.
- `BudgetSteering.fit(bitmask, row, state, tokens_left)`: at the first step where the tokens left
  (`min(max_tokens, max_model_len)` bound) are just enough, the sequence follows the steered way to the end
  (`GrammarState.steering` latches); a way longer than the tokens left is not taken (the model goes on, so a
  one-token prefill samples as usual). Near the end (`GUARD_WINDOW` spare tokens), a choice between a few
  different continuations — a tool name, a key, an enum value, `,` or `}` — keeps only the tokens after which the
  steered way still fits, so picking a long tool or an optional argument late cannot overrun the budget.
- Strings, numbers, arrays, optional arguments and extra calls are thus cut short and the output still parses and
  validates, even from a model that never ends them by itself (random weights), instead of stopping at the length
  limit mid-structure. The floor: a structure whose steered way from its start is longer than max_tokens cannot be
  promised — the output ends "length" (a K3 call takes at least ~35 tokens in the generated checkpoints' small
  vocabulary, which spells `response` in three tokens); at or above it every sampled
  output finishes valid (tests/unit/engine/test_structured_budget.py: 20 seeds at max_tokens 32 and 64). Decisions depend only on the matcher state and the tokens left (up to the growth bound), so
  an imported request continues as the original would have.
- `GrammarState` wraps one sequence's xgrammar matcher: `fill` before sampling, `accept` every sampled token; not
  thread-safe.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np

from engine.formats.markers import (K2_ARGUMENT_BEGIN, K2_CALL_BEGIN, K2_CALL_END, K2_SECTION_BEGIN,
                                    K2_SECTION_END, K2_THINK_CLOSE, K2_THINK_OPEN, K3_CLOSE, K3_OPEN, K3_SEP)

if TYPE_CHECKING:  # xgrammar (and the transformers it imports) loads only when a structured request arrives
    import torch

FREE_TEXT_FRACTION = 0.5  # a row allowing more than this share of the vocabulary is inside free text
STEER_GROWTH = 8  # assumed bound on how much one sampled token can lengthen the way to the end
STEER_SLACK = STEER_GROWTH  # steer once a free token could leave too few tokens for the way to the end
STEER_MAX_MEASURE = 4096  # the way to the end is measured up to this many tokens
GUARD_MAX_CANDIDATES = 32  # choices among at most this many tokens are checked one by one near the budget
GUARD_WINDOW = 256  # … when fewer than this many tokens would be spare after the steered way
# steering order of the markers: closing ones before opening ones
CLOSING_MARKERS = (K3_CLOSE, K3_SEP, K2_THINK_CLOSE, K2_CALL_END, K2_SECTION_END)
OPENING_MARKERS = (K3_OPEN, K2_ARGUMENT_BEGIN, K2_CALL_BEGIN, K2_SECTION_BEGIN, K2_THINK_OPEN)


class GrammarState:
    """One sequence's matcher. `fill` before sampling, `accept` every sampled token; not thread-safe."""

    def __init__(self, matcher, stop_token_ids: tuple[int, ...], finish_within_budget: bool):
        self.matcher = matcher
        self.stop_token_ids = stop_token_ids
        self.finish_within_budget = finish_within_budget
        self.steering = False  # latched once the tokens left are just enough to finish
        self.measured: tuple[int, int] | None = None  # (tokens left, steered way's length) when last measured

    def need_bound(self, tokens_left: int) -> float:
        """An upper bound on the steered way's length now (each sampled token adds at most STEER_GROWTH)."""
        if self.measured is None:
            return math.inf
        left, need = self.measured
        return need + (left - tokens_left) * STEER_GROWTH

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token_id: int) -> bool:
        """Advances past `token_id`; False (nothing changes) when the grammar does not allow it."""
        return self.matcher.accept_token(token_id)

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and a stop token has been accepted."""
        return self.matcher.is_terminated()

    @property
    def is_completed(self) -> bool:
        """The grammar is complete: only stop tokens may follow."""
        return self.matcher.is_completed()



class BudgetSteering:
    """The steering of one tokenizer's vocabulary (see the module docstring); `xgr` is the xgrammar module."""

    def __init__(self, xgr, vocab: Sequence[bytes], stop_ids: Sequence[int], marker_ids: Mapping[str, int],
                 text_ids: Mapping[str, int]):
        """`vocab`: each id's bytes as given to xgrammar; `text_ids`: the ids of the one-character tokens
        '"', ']', '}', ',', '0', '{', '[' the tokenizer has."""
        self._xgr = xgr
        self.vocab_size = len(vocab)
        # steering orders (ids): end the message, close blocks/strings/containers, then the shortest values
        closers = [marker_ids[m] for m in CLOSING_MARKERS if m in marker_ids]
        openers = [marker_ids[m] for m in OPENING_MARKERS if m in marker_ids]
        stops = list(stop_ids)
        self._free_text_order = stops + closers + [text_ids[c] for c in '"' if c in text_ids]
        self._structure_order = stops + closers + [text_ids[c] for c in ']},"0{[' if c in text_ids] + openers
        self._token_lengths = np.array([len(b) for b in vocab], dtype=np.int32)
        self._token_bytes = list(vocab)

    # -- finishing within max_tokens ---------------------------------------------------------------------------

    def fit(self, bitmask: torch.Tensor, row: int, state: GrammarState, left: int) -> None:
        """Narrows `bitmask[row]`: to the steering token once steering is latched; near the budget, at a choice
        between a few different continuations (a tool, a key, an enum value, `,` or `}`), to the ones after which
        the steered way still fits; otherwise leaves the row alone. The way is measured only when its bound
        (`need_bound`) says the budget may be close, so the steps where this acts do not depend on when measuring
        started (an imported request, which starts afresh, acts where the original would have)."""
        if state.steering:
            return self._keep(bitmask, row, [self._steer_token(bitmask[row])])
        ids = self._allowed_ids(bitmask[row])
        branching = len(ids) <= GUARD_MAX_CANDIDATES and not self._one_literal(ids)
        if left - state.need_bound(left) - STEER_SLACK > (GUARD_WINDOW if branching else 0):
            return None  # far from the end
        need = self._steered_length(state.matcher, limit=min(left, STEER_MAX_MEASURE))
        state.measured = (left, need)
        if need > left:  # it no longer fits (or, at prefill, max_tokens is 1): leave it to the model
            return None
        if left - need <= STEER_SLACK:
            state.steering = True
            return self._keep(bitmask, row, [self._steer_token(bitmask[row])])
        if branching and left - need - STEER_SLACK <= GUARD_WINDOW:
            fitting = [int(t) for t in ids if self._fits_after(state, int(t), left - 1)]
            if len(fitting) < len(ids):
                self._keep(bitmask, row, fitting)
        return None

    def _fits_after(self, state: GrammarState, token: int, budget: int) -> bool:
        matcher = state.matcher
        if not matcher.accept_token(token):
            return False
        try:
            return self._steered_length(matcher, budget) <= budget
        finally:
            matcher.rollback(1)

    def _steered_length(self, matcher, limit: int) -> int:
        """Tokens (the stop token included) the steered way from `matcher`'s state takes to the end; `limit` + 1
        when it is longer than `limit`. The walk is rolled back: `matcher` ends in the state it started in (not a
        fork: forking deep-copies the parse state, ~1 s for a 2,000-way `anyOf`, where a rollback pops)."""
        bitmask = self._xgr.allocate_token_bitmask(1, self.vocab_size)
        count = 0
        try:
            while not matcher.is_completed():
                if count >= limit:
                    return limit + 1
                matcher.fill_next_token_bitmask(bitmask, 0)
                if not matcher.accept_token(self._steer_token(bitmask[0])):
                    return limit + 1
                count += 1
            return count + 1
        finally:
            if count:
                matcher.rollback(count)

    def _allowed_ids(self, row: torch.Tensor) -> np.ndarray:
        """The ids a bitmask row [ceil(V/32)] int32 allows, ascending."""
        words = row.numpy()
        nonzero = np.flatnonzero(words)  # [n] words with an allowed token
        bits = np.unpackbits(words[nonzero].view(np.uint8), bitorder="little").reshape(len(nonzero), 32)
        ids = (nonzero[:, None] * 32 + np.arange(32))[bits.astype(bool)]
        return ids[ids < self.vocab_size]

    def _one_literal(self, ids: np.ndarray) -> bool:
        """All allowed tokens are prefixes of the longest one: a literal, not a choice."""
        texts = [self._token_bytes[t] for t in ids]
        longest = max(texts, key=len, default=b"")
        return all(longest.startswith(t) for t in texts)

    def _steer_token(self, row: torch.Tensor) -> int:
        """The first allowed token of the steering order, else the longest allowed token (a literal's biggest
        step); `row` is one bitmask row [ceil(V/32)] int32."""
        words = row.numpy()
        ids = self._allowed_ids(row)
        order = self._free_text_order if len(ids) > FREE_TEXT_FRACTION * self.vocab_size else self._structure_order
        for token in order:
            if int(words[token >> 5]) & (1 << (token & 31)):
                return token
        return int(ids[np.argmax(self._token_lengths[ids])])

    @staticmethod
    def _keep(bitmask: torch.Tensor, row: int, tokens: Sequence[int]) -> None:
        bitmask[row].zero_()
        for token in tokens:
            bitmask[row, token >> 5] |= _int32_bit(token & 31)



def _int32_bit(bit: int) -> int:
    """The int32 value with only `bit` set (bit 31 is the sign bit)."""
    return (1 << bit) - (1 << 32) if bit == 31 else 1 << bit
