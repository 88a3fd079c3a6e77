"""Small-batch fp32 products on CPU with AVX-512: 1..`MAX_ROWS` rows times a row-major weight, read once.

Contract:
- `runs(x, weight)`: whether `linear(x, weight)` can take this kernel — a CPU with AVX-512F where the C source
  (kernels/cpu/small_gemm.c) built, fp32 `x` with 1..`MAX_ROWS` rows, a 2-D fp32 row-major contiguous weight
  `[out, in]` it `takes` (fp32 on CPU, `in` ≥ `MIN_IN_FEATURES`, at least `MIN_WEIGHT_ELEMS` elements), no
  autograd. `takes` is also what the loader asks to keep such weights row-major (engine/model/fused.py). The output rows are split over torch's threads
  (`at::parallel_for`, blocks of at least 512 KB of weight: a small product stays on the calling thread), so a
  one-row product uses every thread, which MKL's one-row GEMV does not.
- `linear(x, weight)` -> `x @ weight^T` (`[..., in] x [out, in] -> [..., out]`), equal to `F.linear` within fp32
  rounding. A row's result does not depend on how many rows share the call (bitwise: each output is the same
  sequence of fused multiply-adds). It calls the operator `torch.ops.kdamesh_cpu.small_gemm`, eagerly and from a
  compiled step alike (opaque to inductor, shape-checked by its fake).
- `available()`: built and loaded, once per process. kernels/cpu/small_gemm_op.cpp (which includes the C kernel
  and registers `torch.ops.kdamesh_cpu.small_gemm`) is compiled by `torch.utils.cpp_extension.load` at
  `-O3 -march=native -fopenmp` (~8 s, once) into torch's extension build root, under a name that hashes the sources, the
  flags and this CPU's model, so a build is reused only for the CPU it was made for (`load` itself locks the folder
  against concurrent workers and rebuilds when a source changed). No compiler, no AVX-512F, a failed build or
  `KDAMESH_SMALL_GEMM=0` in the environment: not available, with one log line that says why, and every product
  stays on MKL/oneDNN.

Why (Intel Xeon, AMX/AVX-512, one thread, weights streamed from memory, `python -m bench.bench_gemv_layout --rows
1,4`): MKL runs a 4-row product at 1.7-1.9x its one-row time (it streams the weight once per row); this kernel
reads four adjacent weight rows once and multiplies them into all rows of x: `[4, 768] x [768, 4880]` 1.18 ms
against MKL's 1.65, `[4, 1536] x [1536, 768]` 0.33 against 0.51; one row is 0-10% faster on wide products
(`[1, 768] x [768, 8192]` 1.43 vs 1.57 ms). With 128-256-long rows (demo-k3) or under ~1 MB of weight it is
slower than MKL (its 16 horizontal sums per four outputs and x rows dominate): `takes` leaves those to MKL.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
from functools import cache
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCES = (Path(__file__).with_name("small_gemm_op.cpp"), Path(__file__).with_name("small_gemm.c"))
FLAGS = ("-O3", "-march=native", "-fopenmp")  # -fopenmp: at::parallel_for runs on torch's OpenMP threads
MAX_ROWS = 8
MIN_IN_FEATURES = 512  # shorter rows: the per-output reductions dominate and MKL is faster (bench below)
MIN_WEIGHT_ELEMS = 1 << 18  # smaller weights: MKL is as fast or faster, at 1 and at 4 rows
DISABLE_ENV = "KDAMESH_SMALL_GEMM"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def build_name() -> str:
    """The extension's name: its sources, flags and this CPU's model, hashed (see the module docstring)."""
    key = hashlib.sha256(b"\0".join([*(p.read_bytes() for p in SOURCES), " ".join(FLAGS).encode(),
                                      _cpu_model().encode()])).hexdigest()[:16]
    return f"kdamesh_small_gemm_{key}"


@cache
def _loaded() -> bool:
    if os.environ.get(DISABLE_ENV, "1") == "0":
        log.info("small_gemm: off (%s=0); CPU products stay on MKL/oneDNN", DISABLE_ENV)
        return False
    try:
        from torch.utils.cpp_extension import load

        load(name=build_name(), sources=[str(SOURCES[0])], extra_cflags=list(FLAGS), is_python_module=False,
             extra_include_paths=[str(SOURCES[0].parent)])
    except Exception as exc:  # noqa: BLE001 - any failed build or load: the products stay on MKL, said once
        message = str(exc).strip().splitlines()[-1] if str(exc).strip() else "no message"
        log.warning("small_gemm: not built (%s: %s); CPU products stay on MKL/oneDNN", type(exc).__name__, message)
        return False
    return True


@torch.compiler.assume_constant_result  # traced code asks once, at trace time, and keeps the answer
def available() -> bool:
    return _loaded()


def takes(out_features: int, in_features: int, dtype: torch.dtype, device_type: str) -> bool:
    """Whether a product with a weight `[out, in]` of this dtype and device is one the kernel runs faster than MKL
    (the shape rule of the module docstring; built or not is `available`'s business)."""
    return (dtype == torch.float32 and device_type == "cpu" and in_features >= MIN_IN_FEATURES
            and out_features * in_features >= MIN_WEIGHT_ELEMS)


def runs(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `linear(x, weight)` takes this kernel (see the module docstring)."""
    if not (x.device.type == "cpu" and x.dtype == torch.float32 and weight.dim() == 2 and weight.is_contiguous()
            and takes(weight.shape[0], weight.shape[1], weight.dtype, weight.device.type)
            and x.shape[-1] == weight.shape[1]):
        return False
    rows = x.numel() // weight.shape[1]
    if not 1 <= rows <= MAX_ROWS:
        return False
    if torch.is_grad_enabled() and (weight.requires_grad or x.requires_grad):
        return False
    return available()


_LIBRARY = torch.library.Library("kdamesh_cpu", "DEF")  # the schema here; the CPU kernel comes with the build
_LIBRARY.define("small_gemm(Tensor x, Tensor w) -> Tensor")


@torch.library.register_fake("kdamesh_cpu::small_gemm")
def _(x2d: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x2d.new_empty(x2d.shape[0], weight.shape[0])


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`x @ weight^T` through the kernel; the caller checked `runs(x, weight)`."""
    out = torch.ops.kdamesh_cpu.small_gemm(x.reshape(-1, weight.shape[1]), weight)  # [rows, out]
    return out.reshape(*x.shape[:-1], weight.shape[0])
