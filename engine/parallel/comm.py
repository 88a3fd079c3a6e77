"""The collectives a rank's model calls, and the per-rank context the model is built with.

Contract:
- `Communicator` is what the layers need: `all_reduce(x)` (sum over ranks; returns the reduced tensor, which may be
  `x` itself reduced in place — callers never reuse `x`), `all_gather(x, dim)` (the ranks' tensors concatenated along
  `dim` in rank order), `broadcast_object(obj, src)` (start-up only: the step path sends tensors,
  engine/parallel/channel.py) and `barrier()`; `TorchDistributed` also has `broadcast(x, src)` and
  `scatter(out, parts, src)` (in place) for the command channel. Every rank must call the same collectives in the same order with tensors of the same shape.
- `SingleProcess` is the identity (one rank); `TorchDistributed(group)` runs them with `torch.distributed` on a
  process group (gloo on CPU, NCCL on CUDA; see engine/parallel/launch.py).
- `RankContext(config, comm)` is what layers are built with: the `ParallelConfig` decides which slices a rank holds
  (and so which it loads), the communicator combines them. `RankContext.single()` is the unsharded model.
  `comm.size` must equal `config.tensor_parallel_size`. `dcp_comm` runs the collectives of this rank's
  decode-context-parallel group (engine/parallel/context.py): None when `decode_context_parallel_size` is 1, the
  TP communicator itself when it equals the TP size. Under pipeline parallelism `stage` says which layers (and
  whether the embedding / LM head) the model holds; `comm` is then the stage's TP sub-group.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from engine.parallel.config import ParallelConfig, ParallelError
from engine.parallel.pipeline import SINGLE_STAGE, Stage


class Communicator(Protocol):
    size: int
    rank: int

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor: ...

    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor: ...

    def broadcast_object(self, obj: Any, src: int = 0) -> Any: ...

    def barrier(self) -> None: ...


class SingleProcess:
    """One rank: every collective is the identity."""

    size = 1
    rank = 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        return x

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        return obj

    def barrier(self) -> None:
        return None


class TorchDistributed:
    """Collectives over a `torch.distributed` process group (the default group when `group` is None)."""

    def __init__(self, group: Any = None):
        import torch.distributed as dist

        self._dist = dist
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        self._dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self._dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=dim)

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        box = [obj if self.rank == src else None]
        self._dist.broadcast_object_list(box, src=src, group=self.group)
        return box[0]

    def barrier(self) -> None:
        self._dist.barrier(group=self.group)

    def broadcast(self, x: torch.Tensor, src: int = 0) -> None:
        """`x` (contiguous) becomes rank `src`'s on every rank, in place."""
        self._dist.broadcast(x, src=self._global(src), group=self.group)

    def _global(self, rank: int) -> int:
        return rank if self.group is None else self._dist.get_global_rank(self.group, rank)

    def scatter(self, out: torch.Tensor, parts: list[torch.Tensor] | None, src: int = 0) -> None:
        """Rank r's `out` receives `parts[r]` (given on `src` only; equal shapes), in place."""
        self._dist.scatter(out, parts if self.rank == src else None,
                           src=self._global(src), group=self.group)


@dataclass(frozen=True)
class RankContext:
    config: ParallelConfig = field(default_factory=ParallelConfig)
    comm: Communicator = field(default_factory=SingleProcess)  # the TP group (this rank's stage's ranks)
    dcp_comm: Communicator | None = None  # the decode-context-parallel group's collectives (DCP > 1 only)
    stage: Stage = SINGLE_STAGE  # pipeline parallelism: the layers this rank's model owns (engine/parallel/pipeline.py)

    def __post_init__(self) -> None:
        if self.comm.size != self.config.tensor_parallel_size:
            raise ParallelError(f"the process group has {self.comm.size} ranks but tensor_parallel_size is "
                                f"{self.config.tensor_parallel_size}")
        dcp = self.config.decode_context_parallel_size
        if dcp > 1 and (self.dcp_comm is None or self.dcp_comm.size != dcp):
            raise ParallelError(f"--decode-context-parallel-size {dcp} needs a communicator over its {dcp} ranks")

    @classmethod
    def single(cls) -> "RankContext":
        return cls(ParallelConfig(), SingleProcess())

    @property
    def size(self) -> int:
        return self.config.tensor_parallel_size

    @property
    def rank(self) -> int:
        return self.config.rank

    @property
    def expert_parallel(self) -> bool:
        return self.config.enable_expert_parallel

    def split(self, total: int, what: str) -> int:
        return self.config.split(total, what)

    def shard_range(self, total: int, what: str) -> tuple[int, int]:
        return self.config.shard_range(total, what)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.size == 1 else self.comm.all_reduce(x)

    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        return x if self.size == 1 else self.comm.all_gather(x, dim)


SINGLE = RankContext.single()  # the unsharded model's context (immutable; every default argument shares it)
