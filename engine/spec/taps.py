"""Capturing the target hidden rows a drafter taps (`Drafter.taps`, engine/spec/drafter.py) in the target's forward.

Contract: `forward_with_taps(model, batch, cache, taps)` runs `model(batch, cache)` and returns `(logits, hidden)`:
the logits as `KimiForCausalLM.forward` returns them and, for non-empty `taps`, the tapped streams of every token of
the batch `[T, len(taps) * hidden_size]` in `taps` order (None for empty `taps`: the forward is the plain one).
The model-side capture (`KimiForCausalLM.forward(..., taps=...)`) belongs to the MTP / DSpark drafters' change;
until it is there, a drafter with taps is refused here with a message naming it.
"""

from __future__ import annotations

import torch


def forward_with_taps(model, batch, cache, taps: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
    if not taps:
        return model(batch, cache), None
    raise NotImplementedError(f"drafter taps {taps}: the target's hidden-state capture is not built in this tree")
