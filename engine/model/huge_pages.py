"""A CPU model's weights on transparent huge pages: one anonymous mapping, advised `MADV_HUGEPAGE`, holds them all.

Contract:
- `place_on_huge_pages(model) -> int`: copies every CPU tensor storage the model reaches (parameters, buffers,
  fused groups' tensors, other tensor attributes of its modules) of at least `MIN_STORAGE_BYTES` into one private
  anonymous mapping advised `MADV_HUGEPAGE`, and re-points every tensor that viewed it (same shape, strides and
  offset, so views stay views of one another and fused groups stay bound); returns the bytes placed. Values are
  unchanged (copies); nothing placed is ever resized. Storages already in such a mapping stay where they are, so
  a second call places only what was added since (the loader's exact bf16 copies, engine/model/fused.py). Call
  before anything keeps a weight's address (compiled steps, prepacked kernels).
- Where huge pages cannot be had (not Linux, THP `never`, no `madvise`), or with `KDAMESH_HUGE_PAGES=0` in the
  environment, it places nothing and says so once; the model is untouched.

Why: a decode step on CPU streams every weight once per token, and with 4 KB pages a one-thread stream misses the
TLB every 4 KB: the small-batch kernel read small-linear's products at ~24 GB/s from 4 KB pages against ~28 from
2 MB pages on an AMD EPYC (a plain read 20 -> 31 GB/s); docs/benchmarks.md, wave 3 session 11. The kernel's default
is THP only where a program asks (`madvise`), and torch's allocator asks only under `THP_MEM_ALLOC_ENABLE=1`, read
once at its first allocation — too early for a library to set.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import sys
import weakref
from pathlib import Path

import torch
from torch import nn

logger = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
MIN_STORAGE_BYTES = 64 << 10  # smaller storages (norms, biases) stay where they are
ALIGN = 64  # each placed storage starts on a cache line
DISABLE_ENV = "KDAMESH_HUGE_PAGES"
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")
_ARENAS: set[int] = set()  # storage addresses of the live mappings made here (placed storages)


def huge_pages_unavailable() -> str | None:
    """Why huge pages cannot be had here, or None."""
    if os.environ.get(DISABLE_ENV, "1") == "0":
        return f"{DISABLE_ENV}=0"
    if not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_HUGEPAGE"):
        return "not Linux"
    try:
        setting = THP_SETTING.read_text()
    except OSError:
        return f"{THP_SETTING} unreadable"
    if "[never]" in setting:
        return "transparent huge pages are off ([never])"
    return None


def place_on_huge_pages(model: nn.Module) -> int:
    """See the module docstring."""
    from engine.model.fused import param_groups

    reason = huge_pages_unavailable()
    if reason is not None:
        logger.info("weights stay on the allocator's pages: %s", reason)
        return 0
    by_storage: dict[int, list] = {}  # storage address -> [(tensor, hold)] of every tensor viewing it
    for tensor, hold in _holders(model):
        if (tensor.device.type == "cpu" and tensor.untyped_storage().nbytes() >= MIN_STORAGE_BYTES
                and tensor.untyped_storage().data_ptr() not in _ARENAS):
            by_storage.setdefault(tensor.untyped_storage().data_ptr(), []).append((tensor, hold))
    if not by_storage:
        return 0
    sizes = {ptr: -(-views[0][0].untyped_storage().nbytes() // ALIGN) * ALIGN for ptr, views in by_storage.items()}
    total = sum(sizes.values())
    arena = _huge_page_bytes(total)  # [total] uint8 on huge pages, untouched
    offset = 0
    for ptr in list(by_storage):  # one storage at a time, its old copy freed before the next is made
        views = by_storage.pop(ptr)
        storage = views[0][0].untyped_storage()
        arena[offset: offset + storage.nbytes()].copy_(torch.empty(0, dtype=torch.uint8).set_(storage))
        for tensor, hold in views:
            hold(_same_view(tensor, arena, offset))
        offset += sizes[ptr]
        del views, storage, tensor, hold
        _return_freed_memory()
    for group in param_groups(model):
        group.note_addresses()  # its members moved with their fused tensor: still its views
    logger.info("%d MiB of weights on huge pages (%d storages)", total >> 20, len(sizes))
    return total


def _return_freed_memory() -> None:
    """Hands the heap's free pages back to the OS (glibc keeps freed chunks under its mmap threshold): the old
    copies must not stay resident next to the new."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: its allocator's business
        pass


def _huge_page_bytes(nbytes: int) -> torch.Tensor:
    """[nbytes] uint8 in a private anonymous mapping advised MADV_HUGEPAGE, starting on a huge-page boundary (the
    tensor keeps the mapping alive)."""
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mapping.madvise(mmap.MADV_HUGEPAGE)
    start = -ctypes.addressof(ctypes.c_char.from_buffer(mapping)) % HUGE_PAGE
    arena = torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes, offset=start)
    _ARENAS.add(arena.untyped_storage().data_ptr())
    weakref.finalize(arena.untyped_storage(), _ARENAS.discard, arena.untyped_storage().data_ptr())
    return arena


def _same_view(tensor: torch.Tensor, arena: torch.Tensor, offset: int) -> torch.Tensor:
    """A new tensor (not a view: no `_base` keeping the old storage alive) with `tensor`'s shape, strides and offset
    into the copy of its storage that starts at byte `offset` of `arena`."""
    element = tensor.element_size()
    start = (arena.data_ptr() - arena.untyped_storage().data_ptr() + offset) // element + tensor.storage_offset()
    return torch.empty(0, dtype=tensor.dtype).set_(arena.untyped_storage(), start, tensor.shape, tensor.stride())


def _holders(model: nn.Module):
    """(tensor, hold) for every tensor the model's modules hold — parameters, buffers, tensor attributes and fused
    groups' tensors and fused products' exact bf16 copies; `hold(new)` makes the holder hold `new` instead (a
    parameter keeps its identity)."""
    from engine.model.fused import fused_linears, param_groups

    for module in model.modules():
        for param in module._parameters.values():
            if param is not None:
                yield param, lambda new, param=param: setattr(param, "data", new)
        for name, buffer in module._buffers.items():
            if buffer is not None:
                yield buffer, lambda new, module=module, name=name: module._buffers.__setitem__(name, new)
        for name, value in vars(module).items():
            if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter):
                yield value, lambda new, module=module, name=name: setattr(module, name, new)
    for fused in fused_linears(model):  # a fused product's exact bf16 copy (engine/model/fused.py)
        if fused.compact is not None:
            yield fused.compact, lambda new, fused=fused: setattr(fused, "compact", new)
    for group in param_groups(model):
        if group._fused is not None:
            yield group._fused, lambda new, group=group: setattr(group, "_fused", new)
