"""Host-side helpers for the index tensors that ops take (`state_indices`, `cu_seqlens`).

Contract: `slot_range(slots) -> slice | None` is `slice(a, a + N)` when the HOST sequence of ints `slots` holds
a, a+1, …, a+N−1, else None. Callers that built the indices on the host (the runner) compute it there and pass it
to an op as a hint (`state_slots=`), so the op can work on a contiguous view of a pool's rows in place instead of
gathering and scattering copies — without ever reading an index tensor back from its device.
"""

from __future__ import annotations

from collections.abc import Sequence


def slot_range(slots: Sequence[int]) -> slice | None:
    n = len(slots)
    if n == 0:
        return None
    first = slots[0]
    if any(s != first + i for i, s in enumerate(slots)):
        return None
    return slice(first, first + n)
