"""A host-synchronisation counter: what in a block of torch code would make the host wait for the device.

Contract:
- `with count_host_syncs(device) as syncs: ...` records, on this thread, every
  - scalar read: `aten._local_scalar_dense` and `aten.equal`, and (wrapped, since a dispatch mode does not see the
    scalar reads of inference tensors) `Tensor.item`, `int(t)`, `float(t)`, `bool(t)` / `if t:`, `t.__index__`;
  - op with a data-dependent output shape: `nonzero`, `masked_select`, the `unique` family, `repeat_interleave`
    without `output_size`, indexing (`index`, `index_put`) with a boolean mask;
  - copy to host: `Tensor.tolist`, `.numpy()`, `.cpu()` of a tensor on `device`, and `.to(<cpu>)` of a tensor
    that is not on the CPU. (On the CPU path a `.to("cpu")` of a CPU tensor is an upload of host-built data as often
    as a read, so it is not counted; `.cpu()`, `.tolist()` and `.numpy()` are.)
  Ops a wrapped call makes itself (a `.tolist()`'s own reads) count once, as the wrapped call.
- `syncs.events`: `SyncEvent(kind, where)` in order; `where` is a short stack summary, the innermost frames of the
  repository's own files ("engine/sampling.py:412 read_back <- engine/step_sampling.py:60 sample"); `file` the
  innermost of them. `syncs.report()` counts them by (kind, where), most frequent first.
- Modes are per thread: work in other threads or processes (tensor-parallel ranks) is not seen.
"""

from __future__ import annotations

import collections
import contextlib
import threading
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parent.parent
_HERE = Path(__file__).resolve()
_aten = torch.ops.aten
SCALAR_READS = {_aten._local_scalar_dense.default, _aten.equal.default}
DATA_DEPENDENT = {_aten.nonzero.default, _aten.masked_select.default, _aten._unique.default, _aten._unique2.default,
                  _aten.unique_dim.default, _aten.unique_consecutive.default, _aten.unique_dim_consecutive.default}
REPEAT_INTERLEAVE = {_aten.repeat_interleave.Tensor, _aten.repeat_interleave.self_Tensor}
SCALAR_METHODS = ("item", "__int__", "__float__", "__bool__", "__index__")
MASK_INDEXING = {_aten.index.Tensor, _aten.index_put.default, _aten.index_put_.default, _aten._index_put_impl_.default}


@dataclass(frozen=True)
class SyncEvent:
    kind: str
    where: str
    file: str


class HostSyncs(TorchDispatchMode):
    def __init__(self, device: torch.device | str = "cpu", depth: int = 3):
        super().__init__()
        self.device = torch.device(device)
        self.depth = depth
        self.events: list[SyncEvent] = []
        self._wrapped = 0  # > 0 inside a wrapped host copy: its own ops are not counted again

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self._wrapped:
            kind = _op_kind(func, args, kwargs)
            if kind is not None:
                self.record(kind)
        return func(*args, **kwargs)

    def record(self, kind: str) -> None:
        frames = [f for f in traceback.extract_stack()[:-1]
                  if f.filename.startswith(str(ROOT)) and "/.venv/" not in f.filename and Path(f.filename).resolve() != _HERE]
        inner = frames[-self.depth:][::-1]
        where = " <- ".join(f"{Path(f.filename).relative_to(ROOT)}:{f.lineno} {f.name}" for f in inner)
        file = str(Path(inner[0].filename).relative_to(ROOT)) if inner else "?"
        self.events.append(SyncEvent(kind, where or "?", file))

    def report(self) -> str:
        counts = collections.Counter((e.kind, e.where) for e in self.events)
        return "\n".join(f"{n:4d} x {kind}: {where}" for (kind, where), n in counts.most_common())


def _op_kind(func, args, kwargs) -> str | None:
    if func in SCALAR_READS:
        return "scalar read"
    if func in DATA_DEPENDENT:
        return f"data-dependent shape ({func.__name__})"
    if func in REPEAT_INTERLEAVE and kwargs.get("output_size") is None:
        return "data-dependent shape (repeat_interleave)"
    if func in MASK_INDEXING and len(args) > 1 and any(
            isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in (args[1] or ())):
        return f"data-dependent shape (boolean mask {func.__name__})"
    return None


_active: list[HostSyncs] = []
_lock = threading.Lock()
_originals: dict[str, object] = {}


def _copy_kind(name: str, tensor: torch.Tensor, args, kwargs) -> str | None:
    counter = _active[-1] if _active else None
    if counter is None or tensor.device.type == "meta":
        return None
    if name in SCALAR_METHODS:
        return "scalar read" if tensor.device == counter.device else None
    if name == "to":
        target = kwargs.get("device") or next((a for a in args if isinstance(a, (str, torch.device))), None)
        if target is None or torch.device(target).type != "cpu" or tensor.device.type == "cpu":
            return None
        return "copy to host (.to(cpu))"
    if tensor.device != counter.device:
        return None
    return f"copy to host (.{name}())"


def _wrap(name: str):
    original = getattr(torch.Tensor, name)

    def wrapped(self, *args, **kwargs):
        counter = _active[-1] if _active else None
        if counter is None or counter._wrapped:
            return original(self, *args, **kwargs)
        kind = _copy_kind(name, self, args, kwargs)
        if kind is not None:
            counter.record(kind)
        counter._wrapped += 1
        try:
            return original(self, *args, **kwargs)
        finally:
            counter._wrapped -= 1

    _originals[name] = original
    return wrapped


@contextlib.contextmanager
def count_host_syncs(device: torch.device | str = "cpu", depth: int = 3):
    """Counts the host syncs of the block on this thread (see the module docstring) -> `HostSyncs`."""
    counter = HostSyncs(device, depth)
    with _lock:
        if not _active:
            for name in ("tolist", "numpy", "cpu", "to", *SCALAR_METHODS):
                setattr(torch.Tensor, name, _wrap(name))
        _active.append(counter)
    try:
        with counter:
            yield counter
    finally:
        with _lock:
            _active.remove(counter)
            if not _active:
                for name, original in _originals.items():
                    setattr(torch.Tensor, name, original)
                _originals.clear()
