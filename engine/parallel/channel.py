"""Rank 0's commands to the other ranks of a group as tensor payloads: no tensor is ever pickled.

Contract:
- `split_tensors(obj) -> (skeleton, tensors, sharded)` walks dataclasses, lists, tuples and dicts and replaces every
  `torch.Tensor` with a `TensorRef`; `join_tensors(skeleton, tensors, parts)` is the inverse. A `Sharded(parts)` is
  a value every rank gets only its own part of: `parts[r]` for rank r (the same shape and dtype on every rank).
- `CommandChannel(comm, device)`: `send(obj)` on rank 0 returns what rank 0 itself uses (its own parts of the
  `Sharded` values); `receive()` on the other ranks returns the same object with theirs. On the wire, in order:
  1. a fixed header of INLINE_BYTES (uint8): three int64 lengths (the skeleton, the broadcast payload, one rank's
     scattered bytes), then the skeleton and the payload when they fit — the skeleton is the object with its
     tensors replaced plus each tensor's dtype and shape, pickled by `SkeletonPickler`, which refuses a tensor
     (`TensorPickleError`): host metadata travels as a few hundred bytes, tensors never through pickle;
  2. the skeleton, then every broadcast tensor's bytes (one uint8 buffer, each tensor 16-byte aligned), each only
     when it did not fit in the header; then every rank's sharded parts in one uint8 `scatter`.
  So a decode step's command is one collective (two at long contexts); tensors arrive on `device` as views of
  the received bytes (no copies).
- Every rank must call `send` / `receive` in the same order (they are collectives of the group).
"""

from __future__ import annotations

import dataclasses
import io
import pickle
from dataclasses import dataclass
from collections.abc import Callable
from typing import Any

import torch



class TensorPickleError(TypeError):
    """A tensor reached the skeleton pickler: it must travel as a tensor payload."""


@dataclass(frozen=True)
class TensorRef:
    index: int  # into the flat tensor list; negative: -(k + 1) is the k-th sharded part


@dataclass(frozen=True)
class Sharded:
    """A value each rank receives only its own part of (`parts[rank]`); built on rank 0."""

    parts: tuple[torch.Tensor, ...]


class SkeletonPickler(pickle.Pickler):
    def persistent_id(self, obj: Any) -> None:
        if isinstance(obj, torch.Tensor):
            raise TensorPickleError(f"a tensor {tuple(obj.shape)} {obj.dtype} reached the command pickler")
        return None


def _dumps(obj: Any) -> bytes:
    buffer = io.BytesIO()
    SkeletonPickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buffer.getvalue()


_RECURSE = object()  # a `_rebuild` leaf function's answer: not a leaf, look inside


def _rebuild(x: Any, leaf: Callable[[Any], Any]) -> Any:
    """`x` rebuilt through dataclasses, lists, tuples and dicts, each value replaced by `leaf(value)` unless that
    is `_RECURSE`; values of other types stay as they are."""
    out = leaf(x)
    if out is not _RECURSE:
        return out
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return dataclasses.replace(x, **{f.name: _rebuild(getattr(x, f.name), leaf) for f in dataclasses.fields(x)
                                         if f.init})
    if isinstance(x, (list, tuple)):
        items = [_rebuild(v, leaf) for v in x]
        return items if isinstance(x, list) else tuple(items)
    if isinstance(x, dict):
        return {k: _rebuild(v, leaf) for k, v in x.items()}
    return x


def split_tensors(obj: Any) -> tuple[Any, list[torch.Tensor], list[Sharded]]:
    """(skeleton, broadcast tensors, sharded values): tensors replaced with `TensorRef`s, in walk order."""
    tensors: list[torch.Tensor] = []
    sharded: list[Sharded] = []

    def leaf(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            tensors.append(x)
            return TensorRef(len(tensors) - 1)
        if isinstance(x, Sharded):
            sharded.append(x)
            return TensorRef(-len(sharded))
        return _RECURSE

    return _rebuild(obj, leaf), tensors, sharded


def join_tensors(skeleton: Any, tensors: list[torch.Tensor], parts: list[torch.Tensor]) -> Any:
    """The inverse of `split_tensors` (`parts[k]`: this rank's part of the k-th sharded value)."""
    def leaf(x: Any) -> Any:
        if isinstance(x, TensorRef):
            return tensors[x.index] if x.index >= 0 else parts[-x.index - 1]
        return _RECURSE

    return _rebuild(skeleton, leaf)


ALIGN = 16  # each tensor's bytes start at a multiple of this in the payload, so views need no copy


def _padded(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def _to_bytes(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The tensors' bytes, each padded to ALIGN, concatenated: uint8 [sum of padded nbytes] on `device`."""
    flat = torch.zeros(sum(_padded(t.numel() * t.element_size()) for t in tensors), dtype=torch.uint8, device=device)
    at = 0
    for t in tensors:
        n = t.numel() * t.element_size()
        flat[at:at + n] = t.detach().contiguous().reshape(-1).view(torch.uint8)
        at += _padded(n)
    return flat


def _from_bytes(flat: torch.Tensor, specs: list[tuple[torch.dtype, tuple[int, ...]]]) -> list[torch.Tensor]:
    """Views of `flat` (no copies) as the tensors `_to_bytes` packed."""
    out, at = [], 0
    for dtype, shape in specs:
        n = dtype.itemsize
        for d in shape:
            n *= d
        out.append(flat[at:at + n].view(dtype).view(shape))
        at += _padded(n)
    return out


def _spec(t: torch.Tensor) -> tuple[torch.dtype, tuple[int, ...]]:
    return t.dtype, tuple(t.shape)


INLINE_BYTES = 16384  # the fixed first broadcast: lengths, the skeleton and a small payload when they fit
LENGTHS = 24  # three int64 at the header's start: skeleton, payload and one rank's scattered bytes


def _layout(body_len: int, payload_len: int) -> tuple[bool, bool]:
    """Whether the skeleton, and then the payload, ride in the header (both sides compute the same)."""
    body_inline = LENGTHS + body_len <= INLINE_BYTES
    payload_inline = body_inline and _padded(LENGTHS + body_len) + payload_len <= INLINE_BYTES
    return body_inline, payload_inline


class CommandChannel:
    """See the module docstring. `comm`: the group's `TorchDistributed`; `device`: where payloads travel."""

    def __init__(self, comm, device: torch.device | str = "cpu"):
        self.comm = comm
        self.device = torch.device(device)
        self.commands = 0

    def send(self, obj: Any) -> Any:
        skeleton, tensors, sharded = split_tensors(obj)
        body = _dumps((skeleton, [_spec(t) for t in tensors], [_spec(s.parts[0]) for s in sharded]))
        payload = _to_bytes(tensors, torch.device("cpu"))
        parts = [_to_bytes([s.parts[r] for s in sharded], self.device) for r in range(self.comm.size)]
        body_inline, payload_inline = _layout(len(body), payload.numel())
        header = torch.zeros(INLINE_BYTES, dtype=torch.uint8)
        header[:LENGTHS].view(torch.int64)[:] = torch.tensor([len(body), payload.numel(), parts[0].numel()])
        if body_inline:
            header[LENGTHS:LENGTHS + len(body)] = torch.frombuffer(bytearray(body), dtype=torch.uint8)
        if payload_inline:
            at = _padded(LENGTHS + len(body))
            header[at:at + payload.numel()] = payload
        self.comm.broadcast(header.to(self.device))
        if not body_inline:
            self.comm.broadcast(torch.frombuffer(bytearray(body), dtype=torch.uint8).to(self.device))
        if not payload_inline and payload.numel():
            self.comm.broadcast(payload.to(self.device))
        if sharded:
            self.comm.scatter(parts[0].clone(), parts)
        self.commands += 1
        return join_tensors(skeleton, tensors, [s.parts[0] for s in sharded])

    def receive(self) -> Any:
        header = torch.empty(INLINE_BYTES, dtype=torch.uint8, device=self.device)
        self.comm.broadcast(header)
        host = header.cpu()
        body_len, payload_len, part_len = host[:LENGTHS].view(torch.int64).tolist()
        body_inline, payload_inline = _layout(body_len, payload_len)
        body = host[LENGTHS:LENGTHS + body_len] if body_inline else self._bytes(body_len).cpu()
        skeleton, specs, part_specs = pickle.loads(body.numpy().tobytes())
        if payload_inline:
            at = _padded(LENGTHS + body_len)
            payload = header[at:at + payload_len]
        else:
            payload = self._bytes(payload_len) if payload_len else header[:0]
        mine = torch.empty(part_len, dtype=torch.uint8, device=self.device)
        if part_specs:
            self.comm.scatter(mine, None)
        self.commands += 1
        return join_tensors(skeleton, _from_bytes(payload, specs), _from_bytes(mine, part_specs))

    def _bytes(self, n: int) -> torch.Tensor:
        buffer = torch.empty(n, dtype=torch.uint8, device=self.device)
        self.comm.broadcast(buffer)
        return buffer
