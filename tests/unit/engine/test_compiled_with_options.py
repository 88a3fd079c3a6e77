"""engine/compilation.py `compiled_with_options`: `freezing: true` really freezes a module's weights into the
compiled graph (Dynamo traces with it set, not only inductor's compile): a weight computed on once, then written in
place, is not seen by a frozen graph and is by one compiled without freezing (the negative control)."""

from __future__ import annotations

import torch
from torch import nn

from engine.compilation import compiled_with_options


class Doubled(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, 8), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ (self.weight * 2).t()  # `weight * 2` folds into a constant when the weight is frozen


def _after_write(freezing: bool) -> bool:
    """Whether the compiled module sees an in-place write to its weight after its first call."""
    torch._dynamo.reset()
    module = Doubled().eval()
    step = compiled_with_options(module, "inductor", {"freezing": freezing}, dynamic=False)
    x = torch.randn(2, 8)
    with torch.no_grad():
        before = step(x)
        module.weight.add_(1.0)
        return not torch.equal(step(x), before)


def test_freezing_freezes_the_weights_and_without_it_they_stay_inputs():
    assert not _after_write(freezing=True)
    assert _after_write(freezing=False)
    assert not torch._inductor.config.freezing  # the global setting is only patched around calls
