"""Stop strings on a growing output text: where one ends the output, and how much of a stream to hold back.

Contract:
- `StopMatcher(stop, include_stop)` serves one output (one choice / one sequence). Its owner appends detokenised
  text and calls `cut(text, old_len)` after each append: when a stop string occurs in `text` and ends past `old_len`
  (the length before the append; earlier text was already searched), it returns the text cut at the earliest such
  occurrence — just before the stop string, or just after it with `include_stop` — and that stop string; otherwise
  `(text, None)`. Of stop strings found at the same place the shortest wins.
- `visible_end(text_len, emitted, finished)` is how much of the text may be handed out: all of it once the output
  finished, else everything but the last `holdback` characters (`max(len(stop)) - 1`: a stop string being written
  is never emitted), and never less than what was already emitted.
- Pure and stateless apart from its configuration: the engine (`engine.request.OutputState`) and the gateway
  (`gateway.text.ChoiceText`) apply the same rule with it.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopMatcher:
    def __init__(self, stop: Sequence[str], include_stop: bool = False):
        self.stop = tuple(stop)
        self.include_stop = include_stop
        self.holdback = max((len(s) for s in self.stop), default=1) - 1

    def __bool__(self) -> bool:
        """Whether there is any stop string to look for."""
        return bool(self.stop)

    def cut(self, text: str, old_len: int) -> tuple[str, str | None]:
        """`text` cut at the first stop string that a step from `old_len` characters completed, and that string."""
        start = max(0, old_len - self.holdback)
        hits = [(i, s) for i, s in ((text.find(s, start), s) for s in self.stop) if i >= 0]
        if not hits:
            return text, None
        i, s = min(hits)
        return (text[: i + len(s)] if self.include_stop else text[:i]), s

    def visible_end(self, text_len: int, emitted: int, finished: bool) -> int:
        """The end of the text that may be handed out now (see the module docstring)."""
        return text_len if finished else max(emitted, text_len - self.holdback)
