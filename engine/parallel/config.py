"""What one rank of a tensor/expert-parallel model is: `ParallelConfig`, and the checks that a model splits evenly.

Contract:
- `ParallelConfig(tensor_parallel_size, rank, enable_expert_parallel)` is frozen; `__post_init__` rejects a size < 1
  and a rank outside `[0, size)` with a `ParallelError` naming the field.
- `split(total, what)` is the per-rank share of `total` (heads, channels, experts, vocabulary rows) and raises a
  `ParallelError` naming `what` when `total` is not divisible by the size: a model never runs with uneven shards.
- `shard_range(total, what)` is this rank's `[start, stop)` of `total`, in rank order (rank r holds the r-th block).
- `decode_context_parallel_size` N (DCP, engine/parallel/context.py): the MLA latent cache is split by token over
  groups of N consecutive ranks (rank r is DCP rank `r % N` of group `r // N`); N must divide the TP size.
- Expert parallelism splits the routed experts across the same ranks as tensor parallelism (as vLLM's
  `--enable-expert-parallel` without data parallelism): the expert-parallel size is the tensor-parallel size.
"""

from __future__ import annotations

from dataclasses import dataclass


class ParallelError(ValueError):
    """The model cannot be split as asked; the message names the dimension and the size."""


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    rank: int = 0
    enable_expert_parallel: bool = False
    decode_context_parallel_size: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.tensor_parallel_size, int) or self.tensor_parallel_size < 1:
            raise ParallelError(f"tensor_parallel_size must be a positive integer, got {self.tensor_parallel_size!r}")
        if not isinstance(self.rank, int) or not 0 <= self.rank < self.tensor_parallel_size:
            raise ParallelError(f"rank {self.rank!r} is outside [0, {self.tensor_parallel_size})")
        dcp = self.decode_context_parallel_size
        if not isinstance(dcp, int) or dcp < 1 or self.tensor_parallel_size % dcp:
            raise ParallelError(f"--decode-context-parallel-size {dcp!r} must be a positive integer dividing "
                                f"--tensor-parallel-size {self.tensor_parallel_size}")

    @property
    def dcp_size(self) -> int:
        return self.decode_context_parallel_size

    @property
    def dcp_rank(self) -> int:
        """This rank's index in its DCP group (the token share it holds)."""
        return self.rank % self.decode_context_parallel_size

    def dcp_groups(self) -> list[list[int]]:
        """The DCP groups' global ranks: N consecutive ranks each."""
        n = self.decode_context_parallel_size
        return [list(range(g, g + n)) for g in range(0, self.tensor_parallel_size, n)]

    @property
    def size(self) -> int:
        return self.tensor_parallel_size

    def split(self, total: int, what: str) -> int:
        """`total / size`, or a `ParallelError` naming `what` when it does not divide."""
        if total % self.size:
            hint = ""
            if "expert" in what and "intermediate" in what and not self.enable_expert_parallel:
                hint = " (or use --enable-expert-parallel to split the experts by expert instead)"
            raise ParallelError(f"{what} = {total} is not divisible by --tensor-parallel-size {self.size}{hint}")
        return total // self.size

    def shard_range(self, total: int, what: str) -> tuple[int, int]:
        local = self.split(total, what)
        return self.rank * local, (self.rank + 1) * local
