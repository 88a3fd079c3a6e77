"""Reusable scratch buffers for large intermediates that an op writes and reads before it returns.

Why: on CPU, glibc hands every allocation above its mmap threshold out as fresh pages and returns them on free, so
an op that gathers 25 MB of rows (a 2,048-token MoE chunk) pays a page fault per 4 KiB on every call: the gather ran
27-35 ms into a fresh tensor and 4 ms into a buffer touched before (bench/bench_engine.py, small-linear prefill).

Contract:
- `scratch(name, shape, dtype, device) -> Tensor`: a tensor of that shape (uninitialised), reused by later calls with
  the same `name` on the same thread. The caller must be done with it before it calls `scratch` with that name
  again, and must never return it (or a view of it) to its own caller: the next call overwrites it.
- `gathered(x, index, name)`: `x.index_select(0, index)`, into the scratch buffer `name` when autograd is off (with
  autograd on it allocates, as an `out=` gather cannot be differentiated).
- One buffer per (thread, name, dtype, device, inference mode: inference tensors cannot be written outside it); it
  grows to the largest size asked for and never shrinks, so a name costs at most its largest request. Threads never
  share buffers (engines stepping in different threads are safe).
"""

from __future__ import annotations

import math
import threading

import torch

_local = threading.local()


def scratch(name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    buffers: dict = _local.__dict__.setdefault("buffers", {})
    key = (name, dtype, torch.device(device), torch.is_inference_mode_enabled())
    numel = math.prod(shape)
    buffer = buffers.get(key)
    if buffer is None or buffer.numel() < numel:
        buffer = torch.empty(numel, dtype=dtype, device=device)
        buffers[key] = buffer
    return buffer[:numel].view(shape)


def gathered(x: torch.Tensor, index: torch.Tensor, name: str) -> torch.Tensor:
    """Rows `index` of `x` ([N, *] -> [len(index), *]), in scratch `name` unless autograd is recording."""
    if torch.is_grad_enabled():
        return x.index_select(0, index)
    out = scratch(name, (index.numel(), *x.shape[1:]), x.dtype, x.device)
    return torch.index_select(x, 0, index, out=out)
