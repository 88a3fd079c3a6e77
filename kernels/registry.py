"""Kernel backend registry: one place that decides which implementation of an op runs.

Contract:
- Every op has a `torch` implementation (runs anywhere). Faster backends (`triton`, `flashinfer`) register the ops
  they have; an op a backend lacks falls back to the next backend in the preference list with one warning.
- Preference by device: CUDA → flashinfer, triton, torch; ROCm → triton, torch; CPU → torch (Triton runs on CPU
  only in interpreter mode, `TRITON_INTERPRET=1`, which is for tests, so it is never picked implicitly).
- Platforms (`platform(device_type)`): `cpu`, `cuda` (an NVIDIA build of torch) or `rocm` (a HIP build: torch
  still calls the device "cuda"). FlashInfer does not exist on ROCm and is never tried there (forcing it falls
  back per op, with the warning); Triton is tried where the `triton` package imports (ROCm ships its own).
  `platform_summary(device_type)` is the start-up line — the platform, each op's chosen backend, what is not
  available here and why — which `log_platform` logs once per device type (engine/model/loader.py calls it when
  a model loads).
- `KDAMESH_KERNEL_BACKEND=torch|triton|flashinfer` forces a backend first in the list (falling back per op when the
  forced backend lacks that op or cannot run here, with a warning).
- The choice is logged once per (op, device type).
- Implementations are registered as import paths and imported lazily, so importing the registry never imports
  triton or flashinfer.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
from collections.abc import Callable
from functools import cache

import torch

logger = logging.getLogger(__name__)

BACKENDS = ("torch", "triton", "flashinfer")
ENV_FORCE = "KDAMESH_KERNEL_BACKEND"

# op name -> backend -> "module:function"
_IMPLS: dict[str, dict[str, str]] = {
    "kda_prefill": {
        "torch": "kernels.kda.chunked:kda_prefill_pooled",
        "triton": "kernels.kda.triton_chunked:kda_prefill_pooled",
    },
    "kda_decode": {
        "torch": "kernels.kda.recurrent:kda_decode_pooled",
        "triton": "kernels.kda.triton_recurrent:kda_decode_pooled",
    },
    "conv_prefill": {
        "torch": "kernels.conv.torch_ops:causal_conv1d_prefill",
        "triton": "kernels.conv.triton_ops:causal_conv1d_prefill",
    },
    "conv_decode": {
        "torch": "kernels.conv.torch_ops:causal_conv1d_decode",
        "triton": "kernels.conv.triton_ops:causal_conv1d_decode",
    },
    "kda_verify": {"torch": "kernels.kda.recurrent:kda_verify_pooled"},
    "conv_verify": {"torch": "kernels.conv.torch_ops:causal_conv1d_verify"},
    "mla_attention": {
        "torch": "kernels.attention.torch_paged:mla_paged_attention",
        "triton": "kernels.attention.triton_paged:mla_paged_attention",
        "flashinfer": "kernels.attention.flashinfer_mla:mla_paged_attention",
    },
    "mla_prefill": {  # the non-absorbed form for long prompts, per sequence (kernels/attention/mla_prefill.py)
        "torch": "kernels.attention.mla_prefill:mla_prefill_attention",
    },
    "mla_decode_graph": {  # one query per sequence, capturable in a CUDA graph (no host reads, no per-step plan)
        "torch": "kernels.attention.torch_paged:mla_paged_attention",
        "triton": "kernels.attention.triton_paged:mla_paged_attention",
    },
    "moe_experts": {
        "torch": "kernels.moe.grouped:moe_experts_grouped",
        "triton": "kernels.moe.triton_fused:moe_experts_dense",
    },
    "moe_experts_mxfp4": {
        "torch": "kernels.moe.mxfp4:moe_experts_mxfp4",
        "triton": "kernels.moe.triton_fused:moe_experts_mxfp4",
    },
    "vision_attention": {"torch": "kernels.vision.torch_sdpa:varlen_attention"},
}


def register(op: str, backend: str, target: str) -> None:
    """Registers `target` ("module:function") as `backend`'s implementation of `op`."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown kernel backend {backend!r}; expected one of {BACKENDS}")
    _IMPLS.setdefault(op, {})[backend] = target


def backend_available(backend: str, device_type: str) -> bool:
    """Whether `backend` can run on a device of `device_type` here (import and device checks only)."""
    if backend == "torch":
        return True
    if backend == "triton":
        if importlib.util.find_spec("triton") is None:
            return False
        return device_type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
    if backend == "flashinfer":
        return platform(device_type) == "cuda" and torch.version.cuda is not None and _flashinfer_importable()
    return False


@cache
def _flashinfer_importable() -> bool:
    try:
        importlib.import_module("flashinfer")
    except Exception:  # noqa: BLE001 - any import failure means "not here"
        return False
    return True


def preference(device_type: str) -> list[str]:
    """Backends to try, best first, for a device type (after the environment override)."""
    if platform(device_type) == "cuda":
        order = ["flashinfer", "triton", "torch"]
    elif platform(device_type) == "rocm":  # no FlashInfer on ROCm
        order = ["triton", "torch"]
    else:
        order = ["torch"]
    forced = os.environ.get(ENV_FORCE, "").strip().lower()
    if forced:
        if forced not in BACKENDS:
            raise ValueError(f"{ENV_FORCE}={forced!r} is not one of {BACKENDS}")
        order = [forced] + [b for b in order if b != forced]
        if "torch" not in order:
            order.append("torch")
    return order


def platform(device_type: str) -> str:
    """`cpu`, `rocm` (a HIP build of torch; its devices are type "cuda") or `cuda`."""
    if device_type != "cuda":
        return "cpu" if device_type == "cpu" else device_type
    return "rocm" if torch.version.hip is not None else "cuda"


def platform_summary(device_type: str) -> str:
    """One line: the platform, each op's backend here, and the backends that cannot run here (with why)."""
    name = platform(device_type)
    version = {"rocm": f" (HIP {torch.version.hip})", "cuda": f" (CUDA {torch.version.cuda})"}.get(name, "")
    chosen: dict[str, list[str]] = {}
    for op in sorted(_IMPLS):
        chosen.setdefault(_choose(op, device_type)[0], []).append(op)
    missing = [b for b in preference(device_type) if not backend_available(b, device_type)]
    why = {"flashinfer": "does not exist on ROCm" if name == "rocm" else "not installed or not a CUDA device",
           "triton": "not installed" if device_type != "cpu" else "CPU (interpreter only)"}
    ops = "; ".join(f"{backend}: {', '.join(names)}" for backend, names in sorted(chosen.items()))
    gone = "; ".join(f"{b} {why.get(b, 'unavailable')}" for b in missing)
    return f"kernel platform {name}{version}: {ops}" + (f"; unavailable: {gone}" if gone else "")


@cache
def log_platform(device_type: str) -> str:
    line = platform_summary(device_type)
    logger.info("%s", line)
    return line


def get_kernel(op: str, device: torch.device | str = "cpu") -> Callable:
    """Returns the implementation of `op` for `device`, choosing the backend per the module contract. Inside a
    compiled step (which cannot trace imports or the environment) it returns the choice made last outside one."""
    device_type = torch.device(device).type
    if torch.compiler.is_compiling():
        return _latest[(op, device_type)]
    impl = _resolve(op, device_type, os.environ.get(ENV_FORCE, ""), os.environ.get("TRITON_INTERPRET", ""))
    _latest[(op, device_type)] = impl
    return impl


_latest: dict[tuple[str, str], Callable] = {}  # (op, device type) -> the implementation get_kernel returned last

COMPILED_STEP_OPS = ("moe_experts", "moe_experts_mxfp4", "conv_decode", "kda_decode")  # what traced layers look up


def prepare_compiled_ops(device: torch.device | str) -> None:
    """Resolves every op a compiled step reaches through the registry, before it is traced (tracing can only read
    the choice made last outside a compiled step)."""
    for op in COMPILED_STEP_OPS:
        get_kernel(op, device)


def chosen_backend(op: str, device: torch.device | str = "cpu") -> str:
    """Name of the backend `get_kernel` picks for `op` on `device`."""
    device_type = torch.device(device).type
    return _choose(op, device_type)[0]


def _choose(op: str, device_type: str) -> tuple[str, list[str]]:
    if op not in _IMPLS:
        raise KeyError(f"no kernel op named {op!r}; known ops: {sorted(_IMPLS)}")
    impls = _IMPLS[op]
    skipped = []
    for backend in preference(device_type):
        if backend in impls and backend_available(backend, device_type):
            return backend, skipped
        skipped.append(backend)
    raise RuntimeError(f"no backend can run {op!r} on {device_type}")  # unreachable: torch always registered


@cache
def _resolve(op: str, device_type: str, _forced: str, _interp: str) -> Callable:
    backend, skipped = _choose(op, device_type)
    wanted = preference(device_type)[0]
    if skipped and wanted != "torch" and skipped[0] == wanted:
        logger.warning("kernel %s: backend %s unavailable or lacks this op on %s; falling back to %s",
                       op, wanted, device_type, backend)
    logger.info("kernel %s on %s: using %s backend", op, device_type, backend)
    module_name, func_name = _IMPLS[op][backend].split(":")
    return getattr(importlib.import_module(module_name), func_name)


def clear_cache() -> None:
    """Forgets resolved choices (tests flip the environment between calls)."""
    _resolve.cache_clear()
    log_platform.cache_clear()
