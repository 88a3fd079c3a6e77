"""Target-side capture of the hidden streams a drafter reads (`Drafter.taps`, engine/spec/drafter.py).

Contract: `forward_with_taps(model, batch, cache, taps)` runs the target's step exactly as `model(batch, cache)`
(same cache writes, same logits) and also returns `hidden` `[T, len(taps) * D]` (model dtype): for every row of
the batch, the tapped streams concatenated in `taps` order. A layer id `i` (0-based) is the stream layer `i` hands
on (plain residual models: the residual stream after the layer; K3 attention residuals: the layer-output partial
sum of its block, `prefix_sum + ffn_out`, as vLLM's `aux_hidden_state_layers` capture with id `i + 1`);
`FINAL_TAP` is the final hidden state before `model.norm`. The rule itself lives in
`engine.model.model.KimiTextModel.forward`; this function checks the ids and names the bad one.
Empty `taps` runs the plain forward and returns `(logits, None)`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.model.batch import CacheTensors, ForwardBatch
from engine.spec.drafter import FINAL_TAP


class TapError(ValueError):
    """A tap id the target does not have."""


def check_taps(num_layers: int, taps: Sequence[int]) -> tuple[int, ...]:
    """`taps` as a tuple, each a layer id in `[0, num_layers)` or `FINAL_TAP`, no repeats."""
    taps = tuple(int(t) for t in taps)
    bad = [t for t in taps if t != FINAL_TAP and not 0 <= t < num_layers]
    if bad:
        raise TapError(f"tap ids {bad} are not layers of the target (0..{num_layers - 1}) nor FINAL_TAP "
                       f"({FINAL_TAP})")
    if len(set(taps)) != len(taps):
        raise TapError(f"tap ids {list(taps)} repeat a layer")
    return taps


def forward_with_taps(model, batch: ForwardBatch, cache: CacheTensors, taps: Sequence[int]
                      ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`(logits [L, V] fp32, hidden [T, len(taps) * D] or None)` of one target step (`model`: a `KimiForCausalLM`)."""
    taps = check_taps(model.config.num_hidden_layers, taps)
    if not taps:
        return model(batch, cache), None
    logits, hidden = model(batch, cache, taps=taps)
    return logits, hidden
