"""Keeps large allocations in the malloc heap, so MiB-sized payload buffers are not page-fault bound.

Why: glibc serves every allocation above its mmap threshold (128 KiB at first, adapting up to 32 MiB) with a fresh
`mmap` and returns it with `munmap` on free. A process that allocates and frees MiB buffers all day (a payload read
from a socket, a `bytes` copied out of an arena) then pays a page fault per 4 KiB for every buffer: ~1 GB/s, where a
copy into memory already touched runs ~7 GB/s. Raising the mmap threshold above the payload sizes and the trim
threshold well above it keeps those blocks in the heap, reused across requests.

Contract:
- `tune_malloc(config)` calls glibc's `mallopt(M_MMAP_THRESHOLD, ...)` and `mallopt(M_TRIM_THRESHOLD, ...)` through
  ctypes for the calling process (children started later do not inherit it; the equivalent environment variables
  `MALLOC_MMAP_THRESHOLD_` / `MALLOC_TRIM_THRESHOLD_` do). It returns what it applied; it never raises.
- Off glibc (musl, macOS, Windows) it does nothing and says so. A glibc that refuses a threshold (older versions cap
  the mmap threshold at 32 MiB on 64-bit) gets the 32 MiB cap instead.
- Cost: freed large blocks stay in the process (up to the trim threshold) instead of returning to the kernel at once.
- Call it once, early, in a process's entry point (the cache service's `main`, the workers' and the benchmark's);
  importing this module changes nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import platform
from dataclasses import dataclass

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1  # glibc <malloc.h>
M_MMAP_THRESHOLD = -3
GLIBC_MMAP_THRESHOLD_CAP = 32 << 20  # DEFAULT_MMAP_THRESHOLD_MAX on 64-bit: always accepted


@dataclass(frozen=True)
class MallocTuning:
    # Allocations at or above this size get their own mmap (bytes); below it they come from the heap.
    mmap_threshold_bytes: int = 256 << 20
    # Free memory at the top of the heap beyond this is returned to the kernel (bytes).
    trim_threshold_bytes: int = 1 << 30


@dataclass(frozen=True)
class MallocTuningResult:
    applied: bool  # False: not glibc, or mallopt refused both settings
    mmap_threshold_bytes: int = 0  # what was set (0: unchanged)
    trim_threshold_bytes: int = 0
    note: str = ""


def tune_malloc(config: MallocTuning = MallocTuning()) -> MallocTuningResult:
    """Applies `config` to this process's glibc malloc (see the module docstring)."""
    mallopt = _glibc_mallopt()
    if mallopt is None:
        return MallocTuningResult(False, note=f"not glibc ({platform.libc_ver()[0] or platform.system()}): unchanged")
    mmap_set = next((v for v in (config.mmap_threshold_bytes, GLIBC_MMAP_THRESHOLD_CAP)
                     if mallopt(M_MMAP_THRESHOLD, v) == 1), 0)
    trim_set = config.trim_threshold_bytes if mallopt(M_TRIM_THRESHOLD, config.trim_threshold_bytes) == 1 else 0
    result = MallocTuningResult(bool(mmap_set or trim_set), mmap_set, trim_set)
    log.debug("malloc tuning: %s", result)
    return result


def _glibc_mallopt():
    """glibc's `int mallopt(int, int)`, or None off glibc."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return None
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return lambda param, value: mallopt(param, min(value, 2**31 - 1))
