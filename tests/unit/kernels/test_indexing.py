"""kernels/indexing.py: `slot_range` recognises consecutive host index tensors only."""

import torch

from kernels.indexing import slot_range


def test_slot_range():
    assert slot_range(torch.tensor([3, 4, 5, 6])) == slice(3, 7)
    assert slot_range(torch.tensor([9])) == slice(9, 10)
    assert slot_range(torch.tensor([0, 1])) == slice(0, 2)
    assert slot_range(torch.tensor([3, 5, 4, 6])) is None  # same ends, not consecutive
    assert slot_range(torch.tensor([2, 1])) is None
    assert slot_range(torch.tensor([], dtype=torch.long)) is None
