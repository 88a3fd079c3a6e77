"""`cast(x, dtype)`: `x.to(dtype)` without the dispatch when `x` already has that dtype.

Why: a decode step of a small model is bound by per-op overhead, and `x.float()` on an fp32 tensor still goes
through the dispatcher (a few microseconds); the decode path casts hundreds of times per step.
"""

from __future__ import annotations

import torch


def cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return x if x.dtype == dtype else x.to(dtype)


def fp32(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype == torch.float32 else x.to(torch.float32)
