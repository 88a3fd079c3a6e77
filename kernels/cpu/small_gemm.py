"""Small-batch fp32 products on CPU with AVX-512 or AVX2+FMA: 1..`MAX_ROWS` rows times an input-major weight, read once.

Contract:
- `runs(x, weight)`: whether `linear(x, weight)` can take this kernel — a CPU with AVX-512F, or AVX2 and FMA,
  where the C source (kernels/cpu/small_gemm.c) built, fp32 `x` with 1..`MAX_ROWS` rows, a 2-D fp32 or bf16
  weight (bf16: widened exactly to fp32 as the kernel loads it) `[out, in]` stored input-major (`weight.t()`
  contiguous: the layout the loader gives decode's weights, see `lay_out_for_gemv` in engine/model/fused.py) of
  at least `MIN_WEIGHT_ELEMS` elements, no autograd; one row always, 2..8 rows for a weight of at least
  `MIN_MULTI_ROW_ELEMS` (smaller ones MKL runs as fast). `takes` (the same size rule, fp32 only) is what the
  loader asks to store such weights input-major. The output columns
  are split over torch's threads (`at::parallel_for`, shares of at least 2^14 weight elements: a small product stays
  on the calling thread).
- `linear(x, weight)` -> `x @ weight^T` (`[..., in] x [out, in] -> [..., out]`), equal to `F.linear` within fp32
  rounding. A row's result does not depend on how many rows share the call (bitwise: each output is the same
  sequence of fused multiply-adds, in input order). It calls the operator `torch.ops.kdamesh_cpu.small_gemm`,
  eagerly and from a compiled step alike (opaque to inductor, shape-checked by its fake).
- `compact_copy(weight)` / `exact_bf16(tensor)`: a bf16 copy of an fp32 weight whose every value is a bf16 value
  (a bf16 checkpoint upcast), else None; the kernel's products with the copy are bitwise those with the weight, from
  half the bytes (engine/model/fused.py `attach_compact_weights` gives them to the model's products at load;
  `KDAMESH_COMPACT_WEIGHTS=0`: none).
- `available()`: built and loaded, once per process. kernels/cpu/small_gemm_op.cpp (which includes the C kernels
  and registers `torch.ops.kdamesh_cpu.small_gemm`, the routed experts' operators of kernels/cpu/expert_gemm.py and
  the KDA decode step of kernels/kda/cpu_step.py, kernels/cpu/kda_step.c)
  is compiled by `torch.utils.cpp_extension.load` at `-O3 -march=native -fopenmp` (~8 s, once) into torch's
  extension build root, under a name that hashes the sources, the flags and this CPU's model, so a build is reused
  only for the CPU it was made for (`load` itself locks the folder against concurrent workers and rebuilds when a
  source changed). No compiler, neither AVX-512F nor AVX2+FMA, a failed build or `KDAMESH_SMALL_GEMM=0` in the
  environment: not available, with one log line that says why, and every product stays on MKL/oneDNN.

How and why: the kernel reads the input-major weight a weight row at a time, multiplying each weight vector into
every row of x, so no output needs a horizontal sum, short rows (demo-k3's 64-256 inputs) cost nothing extra, and m
rows read the weight once (MKL runs a 2-8-row fp32 product at 1.5-3x its one-row time: it streams the weight once
per row). Two orders (kernels/cpu/small_gemm.c):
- narrow outputs (under 1,024 a row, all rows' at most 4,096 floats, `STREAM_MAX_FLOATS`: 16 KB in L1) computed
  whole by one thread: one weight row at a time, the weight read in memory order — one stream the hardware
  prefetcher follows. AMD EPYC, AVX-512, one thread, cold weights (`python -m bench.bench_gemv_layout`):
  `[1, 768] x [768, 256]` 45-52 us against MKL's 66, `[4, 768] x [768, 768]` 128-134 vs MKL's 239-253;
- the rest: register tiles of m rows x 1-4 vectors of outputs, eight weight rows a pass (sixteen at 7-8 rows; the
  tile loaded and stored once a pass): the tile's multiply-adds are independent chains, so the FMA latency hides
  (the eight-row axpys this replaced ran each row's multiply-adds as one dependent chain). AMD EPYC, AVX2 (wave 3,
  session 14):
  demo-k3's LM head `[5, 256] x [256, 8192]` 1.02 ms vs 1.59 in axpys (one row 0.54 vs 0.57), `[1, 256] x
  [256, 1104]` 90 us vs 126 streamed, `[4, 768] x [768, 4880]` 1.31 ms vs 1.79.
Both are the same multiply-adds in the same order (so a row's result never depends on its batch, and the two orders
give the same bits). With the streamed order every one-row product the kernel takes beat MKL's GEMV, at one thread
and at two, with AVX-512 or AVX2: the compiled batch-1 step of small-linear 12.97 -> 10.63 ms at one thread and
10.99 -> 9.28 at two, demo-k3 4.81 -> 3.15 and 3.90 -> 3.01 (AVX2 build; docs/benchmarks.md, wave 3 session 10).
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

SOURCES = tuple(Path(__file__).with_name(name) for name in ("small_gemm_op.cpp", "small_gemm.c", "kda_step.c"))
FLAGS = ("-O3", "-march=native", "-fopenmp")  # -fopenmp: at::parallel_for runs on torch's OpenMP threads
MAX_ROWS = 8
MIN_WEIGHT_ELEMS = 1 << 15  # smaller weights stay on MKL (demo-k3's [1, 64] x [64, 256], 2^14: 10.5 vs 6.9 us)
MIN_MULTI_ROW_ELEMS = 1 << 16  # 2..8 rows: smaller weights stay on MKL (demo-k3's 2^15 ones tie it at 4 and 8 rows)
DISABLE_ENV = "KDAMESH_SMALL_GEMM"
COMPACT_ENV = "KDAMESH_COMPACT_WEIGHTS"  # "0": no bf16 copies (`compact_copy`), every product reads the fp32 weight
WEIGHT_DTYPES = (torch.float32, torch.bfloat16)  # bf16 weights are widened exactly to fp32 as the kernel loads them


@cache
def _cpuinfo(field: str) -> str:
    """The first `field` line's value in /proc/cpuinfo ("" where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.split(":", 1)[0].strip() == field:
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def _cpu_model() -> str:
    return _cpuinfo("model name") or platform.processor() or platform.machine()


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
    return dtype == torch.float32 and device_type == "cpu" and out_features * in_features >= MIN_WEIGHT_ELEMS


def input_major(weight: torch.Tensor) -> bool:
    """Whether a 2-D weight `[out, in]` is stored input-major (its transpose contiguous): the layout the kernel
    reads."""
    return weight.t().is_contiguous()


def runs(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `linear(x, weight)` takes this kernel (see the module docstring)."""
    if not (x.device.type == "cpu" and x.dtype == torch.float32 and weight.dim() == 2 and input_major(weight)
            and weight.dtype in WEIGHT_DTYPES and weight.device.type == "cpu" and weight.numel() >= MIN_WEIGHT_ELEMS
            and x.shape[-1] == weight.shape[1]):
        return False
    rows = x.numel() // weight.shape[1]
    if not 1 <= rows <= MAX_ROWS:
        return False
    if rows > 1 and weight.numel() < MIN_MULTI_ROW_ELEMS:
        return False
    if torch.is_grad_enabled() and (weight.requires_grad or x.requires_grad):
        return False
    return available()


_LIBRARY = torch.library.Library("kdamesh_cpu", "DEF")  # the schema here; the CPU kernel comes with the build
_LIBRARY.define("small_gemm(Tensor x, Tensor w) -> Tensor")
_LIBRARY.define("expert_gemm(Tensor x, Tensor w, Tensor ids) -> Tensor")  # kernels/cpu/expert_gemm.py
_LIBRARY.define("expert_gemm_sum(Tensor h, Tensor w, Tensor ids) -> Tensor")
_LIBRARY.define("kda_decode_(Tensor(a!) pool, Tensor idx, Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, "
                "float scale) -> Tensor")  # kernels/kda/cpu_step.py
_LIBRARY.define("kda_verify_(Tensor(a!) pool, Tensor in_idx, Tensor out_slots, Tensor q, Tensor k, Tensor v, "
                "Tensor g, Tensor beta, float scale) -> Tensor")


def compact_copy(weight: torch.Tensor) -> torch.Tensor | None:
    """An input-major bf16 copy of an fp32 weight the kernel takes, where every value is exactly a bf16 value (a
    bf16 checkpoint upcast to fp32): the kernel widens it back as it loads, so products with the copy are bitwise
    those with the weight, from half the bytes. None where the weight is not such a weight or the kernel is not
    available, or with `KDAMESH_COMPACT_WEIGHTS=0` in the environment."""
    if not (weight.dim() == 2 and input_major(weight)
            and takes(weight.shape[0], weight.shape[1], weight.dtype, weight.device.type)):
        return None
    return exact_bf16(weight)


def exact_bf16(tensor: torch.Tensor) -> torch.Tensor | None:
    """A bf16 copy of an fp32 CPU tensor with its shape and strides, where every value is exactly a bf16 value and
    the kernel is available (and `KDAMESH_COMPACT_WEIGHTS` is not "0"), else None (see `compact_copy`)."""
    if (os.environ.get(COMPACT_ENV, "1") == "0" or tensor.dtype != torch.float32 or tensor.device.type != "cpu"
            or not available()):
        return None
    copy = torch.empty_strided(tensor.shape, tensor.stride(), dtype=torch.bfloat16).copy_(tensor.detach())
    return copy if torch.equal(copy.float(), tensor) else None


@torch.library.register_fake("kdamesh_cpu::small_gemm")
def _(x2d: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x2d.new_empty(x2d.shape[0], weight.shape[0])


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`x @ weight^T` through the kernel; the caller checked `runs(x, weight)`."""
    out = torch.ops.kdamesh_cpu.small_gemm(x.reshape(-1, weight.shape[1]), weight)  # [rows, out]
    return out.reshape(*x.shape[:-1], weight.shape[0])
