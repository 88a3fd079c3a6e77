"""Host-side helpers for the index tensors that ops take (`state_indices`, `cu_seqlens`).

Contract: `slot_range(indices) -> slice | None` is `slice(a, a + N)` when the host (CPU) tensor `indices` holds
a, a+1, …, a+N−1, else None (device tensors: None, so no host sync). Ops use it to work on a contiguous view of a
pool's rows in place instead of gathering and scattering copies.
"""

from __future__ import annotations

import torch


def slot_range(indices: torch.Tensor) -> slice | None:
    if indices.device.type != "cpu" or indices.numel() == 0:
        return None
    n = indices.numel()
    first, last = int(indices[0]), int(indices[-1])
    if last - first != n - 1:
        return None
    if n > 2 and not bool((indices[1:] - indices[:-1] == 1).all()):
        return None
    return slice(first, last + 1)
