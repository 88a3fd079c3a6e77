"""Dense projections `x @ W^T`: oneDNN with prepacked weights on CPU, column-sliced MKL as the fallback.

Contract: `linear(x, weight, compact=None) -> x @ weight^T` ([..., in] x [out, in] -> [..., out], no bias), equal
to `torch.nn.functional.linear(x, weight)` within the dtype's rounding (tests/unit/kernels/test_linear.py).
`compact`, where given, is `weight`'s bf16 copy, equal to it value for value (`small_gemm.compact_copy`): the
small-batch kernel reads it instead, bitwise the same result from half the bytes; every other path reads `weight`.

- First, eager or compiled: kernels/cpu/small_gemm.py where it `runs` (fp32, 1..8 rows, an input-major weight,
  an AVX-512 or AVX2+FMA CPU where its C source built; one row only at two or more threads and a large weight): it
  reads the weight once for all rows. The paths below are what every other product takes.

- oneDNN, prepacked: on CPU, bf16 at any row count (where the CPU has oneDNN's bf16 products: `onednn_bf16`),
  or fp32 at 2+ rows times a weight of at least `PACK_MIN_FP32` elements; a 2-D fp32/bf16 weight, no autograd,
  not inside a compiled step (inductor packs weights itself). The weight is reordered once into oneDNN's blocked
  layout (`torch.ops.mkldnn._reorder_linear_weight`) and cached per
  weight tensor (`packed_weight`): keyed by identity, checked against its data pointer and version counter at each
  call (a weight written in place or rebound is repacked), dropped when the weight dies; inference tensors (no
  version counter) are not packed. The packed copy costs the weight's bytes once more (`packed_bytes()`). On this
  path a row's result does not depend on how many rows share the call (bitwise, 1..2,048 rows, 1 or 2 threads;
  MKL's products do not hold that either).
  Why (AMD EPYC, AVX-512, one thread, cold caches): MKL's sgemm runs 2-8-row products at 2-5x a one-row product
  (`[4, 768] x [768, 3206]`: 1.7 ms vs 0.6 ms), oneDNN's prepacked kernel 0.66-0.83 ms; 32 rows 3.6 -> 2.0 ms,
  512 rows 42 -> 25 ms; bf16 one-row products 1.5-3.6x faster (demo-k3's LM head [1, 256] x [256, 8192]:
  378 -> 105 us). One fp32 row stays on MKL's GEMV, which streams an input-major weight faster (0.56-0.67 vs
  0.91 ms), and small fp32 products pay oneDNN's ~15 us per call, hence `PACK_MIN_FP32`.
- Inside a compiled step (`torch.compiler.is_compiling()`): `F.linear`, one product, whatever the row count —
  inductor picks its kernel (a compiled step of two or more rows prepacks its frozen weights:
  engine/decode_graphs.py).
- Otherwise `F.linear`, and on CPU 2..`SMALL_BATCH_MAX_ROWS` rows times a weight of at least `WIDE_MIN_COLUMNS`
  outputs as `SLICE_COLUMNS`-wide column slices (MKL, one thread: the LM head [32, 768] x [768, 8192] 17.4 -> 11.2
  ms; each output column is the same dot product either way, so the slicing is bitwise equal to `F.linear`).
"""

from __future__ import annotations

import threading
import weakref

from functools import cache

import torch
import torch.nn.functional as F

from kernels.cpu import small_gemm

SLICE_COLUMNS = 512
SMALL_BATCH_MAX_ROWS = 128
WIDE_MIN_COLUMNS = 2048
PACKED_DTYPES = (torch.float32, torch.bfloat16)
PACK_MIN_FP32 = 1 << 18  # fp32 weights from this many elements take oneDNN at 2+ rows (below: its ~15 us call costs)

_packed: dict[int, tuple[weakref.ref, int, int, torch.Tensor]] = {}  # id(weight) -> (ref, data_ptr, version, packed)
_lock = threading.Lock()


def linear(x: torch.Tensor, weight: torch.Tensor, compact: torch.Tensor | None = None) -> torch.Tensor:
    if compact is not None and small_gemm.runs(x, compact) and not (torch.is_grad_enabled() and weight.requires_grad):
        return small_gemm.linear(x, compact)  # the weight's exact bf16 copy: half the bytes
    if small_gemm.runs(x, weight):
        return small_gemm.linear(x, weight)
    if torch.compiler.is_compiling():  # one product: the compiler picks its kernel (and packs frozen weights)
        return F.linear(x, weight)
    rows = x.numel() // max(x.shape[-1], 1)
    if x.device.type == "cpu" and (x.dtype == torch.bfloat16 or (rows >= 2 and weight.numel() >= PACK_MIN_FP32)):
        packed = packed_weight(weight, x)
        if packed is not None:
            return _onednn_linear(x, packed)
    if (x.device.type != "cpu" or weight.shape[0] < WIDE_MIN_COLUMNS
            or not 2 <= rows <= SMALL_BATCH_MAX_ROWS):
        return F.linear(x, weight)
    return torch.cat([F.linear(x, part) for part in weight.split(SLICE_COLUMNS)], dim=-1)


def _onednn_linear(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [None], "")


@cache
def onednn_bf16() -> bool:
    """Whether this CPU runs oneDNN's bf16 products (AVX-512 BW/VL/DQ or AVX-NE-CONVERT; an AVX2-only CPU does
    not, and reordering a bf16 weight there raises)."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def packable(weight: torch.Tensor, x: torch.Tensor) -> bool:
    """Whether `linear(x, weight)` runs on oneDNN's prepacked path (see the module docstring)."""
    return (not torch.compiler.is_compiling()  # first: tracing cannot ask `is_inference`
            and weight.device.type == "cpu" and weight.dim() == 2 and weight.dtype in PACKED_DTYPES
            and (weight.dtype != torch.bfloat16 or onednn_bf16())
            and x.dtype == weight.dtype and weight.shape[0] > 0 and weight.shape[1] > 0 and not weight.is_inference()
            and torch.backends.mkldnn.is_available()
            and not (torch.is_grad_enabled() and (weight.requires_grad or x.requires_grad)))


def packed_weight(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor | None:
    """`weight` reordered for oneDNN (made once, reused while the weight is unchanged), or None when not packable."""
    if not packable(weight, x):
        return None
    key = id(weight)
    entry = _packed.get(key)
    ptr, version = weight.data_ptr(), weight._version
    if entry is not None and entry[0]() is weight and entry[1] == ptr and entry[2] == version:
        return entry[3]
    with torch.no_grad():
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach())
    with _lock:
        _packed[key] = (weakref.ref(weight, lambda _, key=key: _forget(key)), ptr, version, packed)
    return packed


def packed_bytes() -> int:
    """Bytes held by packed copies of live weights."""
    return sum(entry[3].numel() * entry[3].element_size() for entry in list(_packed.values()) if entry[0]() is not None)


def _forget(key: int) -> None:
    with _lock:
        entry = _packed.get(key)
        if entry is not None and entry[0]() is None:
            del _packed[key]
