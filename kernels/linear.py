"""Dense projections `x @ W^T`, column-sliced for small CPU batches.

Contract: `linear(x, weight) -> x @ weight^T` ([..., in] x [out, in] -> [..., out], no bias), bitwise equal to
`torch.nn.functional.linear(x, weight)` (tests/unit/kernels/test_linear.py checks it: each output column is the same
dot product either way, so batched still equals sequential).

Why: on CPU (MKL, AVX2, one thread) a product with 2-128 rows and a wide weight ran 1.1-1.55x faster as
`SLICE_COLUMNS`-wide column slices than in one call — the LM head ([32, 768] x [768, 8192]) 17.4 -> 11.2 ms, KDA's
fused projection ([32, 768] x [768, 2576]) 1.2x — while one row (a GEMV) and prefill-sized batches ran slower sliced
(0.7-0.9x). So only 2..`SMALL_BATCH_MAX_ROWS` rows times a weight of at least `WIDE_MIN_COLUMNS` outputs are sliced.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

SLICE_COLUMNS = 512
SMALL_BATCH_MAX_ROWS = 128
WIDE_MIN_COLUMNS = 2048


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    rows = x.numel() // max(x.shape[-1], 1)
    if (x.device.type != "cpu" or weight.shape[0] < WIDE_MIN_COLUMNS
            or not 2 <= rows <= SMALL_BATCH_MAX_ROWS):
        return F.linear(x, weight)
    return torch.cat([F.linear(x, part) for part in weight.split(SLICE_COLUMNS)], dim=-1)
