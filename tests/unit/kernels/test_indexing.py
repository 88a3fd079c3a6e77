"""kernels/indexing.py: `slot_range` recognises consecutive host slot lists only."""

from kernels.indexing import slot_range


def test_slot_range():
    assert slot_range([3, 4, 5, 6]) == slice(3, 7)
    assert slot_range((9,)) == slice(9, 10)
    assert slot_range([0, 1]) == slice(0, 2)
    assert slot_range([3, 5, 4, 6]) is None  # same ends, not consecutive
    assert slot_range([2, 1]) is None
    assert slot_range([]) is None
