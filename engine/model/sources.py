"""Where the loader's tensors come from: this rank's slice of each checkpoint tensor, from one of three sources.

Contract:
- `Slice(dim, start, length)` names the part of a checkpoint tensor a rank holds (None: the whole tensor).
- Every source has `stream(wanted)`: for each checkpoint name in `wanted` (name -> Slice or None) it yields
  `(name, tensor)` once, the tensor being that slice only, on CPU or the load device, in the checkpoint's dtype.
- `SafetensorsSource(header)`: `safe_open(...).get_slice(name)[...]`, so a rank never reads the rest of a sharded
  tensor. Files are visited one at a time in path order.
- `FastSafetensorsSource(files, header, ctx, device, expert_owner, skip, files_per_rank)`: the `fastsafetensors`
  package (its CPU `nogds` path on CPU, GPU Direct Storage where it can on CUDA). Loading is bounded: files go
  through in rounds (`rounds()`), each round's buffers holding at most `files_per_rank` files per rank (default 1),
  closed before the next round is read, so a rank's load device holds at most its weights plus one round's files
  (not the whole checkpoint's file buffers next to the weights). Tensors under `skip` (set-aside vision / MTP
  weights) are filtered out before any bytes are read. Under tensor parallelism it is a collective: every rank
  calls `stream` together; within a round file j goes to rank j, tensors split evenly in rank order along the
  sliced dim arrive by `get_sharded` (a scatter), an expert's tensors under expert parallelism go to their owner
  only (`push_tensor`; `expert_owner(name)` is that rank, the same on every rank), everything else by
  `get_tensor` (a broadcast) and is sliced here. A yielded tensor may be a view of its round's buffer: a consumer
  that keeps one past the next item copies it (`detach_from_buffer`).
- `checkpoint_files(model_dir)`: the weight files (those a `model.safetensors.index.json` names, else every
  `*.safetensors`), in path order; `read_header(files)`: tensor name -> (file, shape), headers only. A missing file
  raises `CheckpointError` (the loader's error, defined here).
- `DummySource(shapes, seed)`: seeded random tensors (`engine.model.init.sample_tensor`, per name, so every rank
  draws the same values for the same name); MXFP4 names (`*.weight_packed`, `*.weight_scale`) are the quantised
  draw of their `*.weight`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import safetensors
import torch
from safetensors import safe_open

from engine.model.init import sample_tensor
from engine.model.mxfp4 import quantize_mxfp4
from engine.parallel.comm import RankContext


@dataclass(frozen=True)
class Slice:
    dim: int
    start: int
    length: int

    def index(self, ndim: int) -> tuple[slice, ...]:
        return tuple(slice(self.start, self.start + self.length) if d == self.dim else slice(None)
                     for d in range(ndim))

    def is_even_split(self, full_shape: tuple[int, ...], size: int, rank: int) -> bool:
        """Whether this is rank `rank`'s block of `full_shape[dim]` split into `size` equal parts."""
        return self.length * size == full_shape[self.dim] and self.start == rank * self.length


Wanted = dict[str, "Slice | None"]


class CheckpointError(ValueError):
    """The checkpoint does not match the model; the message names each offending tensor."""


def checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        names = sorted(set(weight_map.values()))
        missing = [n for n in names if not (model_dir / n).is_file()]
        if missing:
            raise CheckpointError(f"{index.name} names shard files that do not exist: {missing}")
        return [model_dir / n for n in names]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors files in {model_dir}")
    return files


def read_header(files: list[Path]) -> dict[str, tuple[Path, tuple[int, ...]]]:
    """Tensor name → (file, shape), reading headers only."""
    header: dict[str, tuple[Path, tuple[int, ...]]] = {}
    for path in files:
        with safetensors.safe_open(str(path), framework="pt") as f:  # headers: not this module's data reads
            for name in f.keys():
                header[name] = (path, tuple(f.get_slice(name).get_shape()))
    return header


def narrow(tensor: torch.Tensor, part: Slice | None) -> torch.Tensor:
    return tensor if part is None else tensor.narrow(part.dim, part.start, part.length)


class SafetensorsSource:
    def __init__(self, header: dict[str, tuple[Path, tuple[int, ...]]]):
        self.header = header

    def stream(self, wanted: Wanted) -> Iterator[tuple[str, torch.Tensor]]:
        by_file: dict[Path, list[str]] = {}
        for name in wanted:
            by_file.setdefault(self.header[name][0], []).append(name)
        for path in sorted(by_file):
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in by_file[path]:
                    part = wanted[name]
                    if part is None:
                        yield name, f.get_tensor(name)
                    else:
                        yield name, f.get_slice(name)[part.index(len(self.header[name][1]))]


class DummySource:
    def __init__(self, shapes: dict[str, tuple[int, ...]], seed: int):
        self.shapes = shapes
        self.seed = seed

    def _draw(self, name: str) -> torch.Tensor:
        shape = self.shapes[name]
        for suffix, factor in (("_packed", 2), ("_scale", 32)):
            if name.endswith(".weight" + suffix):
                dense = sample_tensor(name.removesuffix(suffix), (shape[0], shape[1] * factor), self.seed)
                packed, scale = quantize_mxfp4(dense)
                return packed if suffix == "_packed" else scale
        return sample_tensor(name, shape, self.seed)

    def stream(self, wanted: Wanted) -> Iterator[tuple[str, torch.Tensor]]:
        for name in sorted(wanted):
            yield name, narrow(self._draw(name), wanted[name])


class FastSafetensorsSource:
    def __init__(self, files: list[Path], header: dict[str, tuple[Path, tuple[int, ...]]], ctx: RankContext,
                 device: str, expert_owner: Callable[[str], int | None], skip: tuple[str, ...] = (),
                 files_per_rank: int = 1):
        if files_per_rank < 1:
            raise ValueError(f"files_per_rank must be at least 1, got {files_per_rank}")
        self.files, self.header, self.ctx, self.device = sorted(files), header, ctx, device
        self.expert_owner, self.skip, self.files_per_rank = expert_owner, skip, files_per_rank

    def rounds(self) -> list[list[Path]]:
        """The files of each round, in path order; round r's file j is read by rank j mod N (same on every rank)."""
        step = self.ctx.size * self.files_per_rank
        return [self.files[i: i + step] for i in range(0, len(self.files), step)]

    def _open(self, files: list[Path]):
        from fastsafetensors import SafeTensorsFileLoader

        size = self.ctx.size
        group = None
        if size > 1:
            import torch.distributed as dist

            group = getattr(self.ctx.comm, "group", None) or dist.group.WORLD
        loader = SafeTensorsFileLoader(group, device=self.device, nogds=torch.device(self.device).type == "cpu")
        if self.skip:
            loader.set_tensor_filter(lambda name: not name.startswith(self.skip))
        loader.add_filenames({r: [str(f) for f in files[r::size]] for r in range(min(size, len(files)))})
        return loader, loader.copy_files_to_device()

    def stream(self, wanted: Wanted) -> Iterator[tuple[str, torch.Tensor]]:
        for files in self.rounds():
            yield from self._stream_round(files, wanted)

    def _stream_round(self, files: list[Path], wanted: Wanted) -> Iterator[tuple[str, torch.Tensor]]:
        size, rank = self.ctx.size, self.ctx.comm.rank
        in_round = set(files)
        names = sorted(n for n, (path, _) in self.header.items() if path in in_round and not n.startswith(self.skip))
        loader, buffers = self._open(files)
        try:
            for name in names:  # the same order on every rank: each step may be a collective
                part, owner = wanted.get(name), self.expert_owner(name)
                if size > 1 and owner is not None:
                    tensor = buffers.push_tensor(name, owner)
                    if owner == rank:
                        yield name, narrow(tensor, part)
                elif size > 1 and part is not None and part.is_even_split(self.header[name][1], size, rank):
                    yield name, buffers.get_sharded(name, part.dim)
                else:
                    tensor = buffers.get_tensor(name)
                    if name in wanted:
                        yield name, narrow(tensor, part)
        finally:
            buffers.close()
            loader.close()


def detach_from_buffer(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` itself when it owns its storage, else a copy: a view kept past its round would keep the whole
    round's file buffer alive."""
    return tensor.clone() if tensor.untyped_storage().nbytes() > tensor.nbytes else tensor
