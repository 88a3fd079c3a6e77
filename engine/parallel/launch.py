"""Process groups for tensor-parallel ranks, and a helper that runs a function on N local rank processes.

Contract:
- `init_rank(rendezvous, world_size, rank, backend, timeout_s, local_rank)` joins a `torch.distributed` group and
  returns its `TorchDistributed`. `rendezvous`: a `Rendezvous` — a `FileStore` path (every rank passes the same
  path; the file must not exist before the first rank starts), or `master_addr:master_port`, a `TCPStore` rank 0
  serves, for ranks on several machines — or a bare path. `backend` None: NCCL when CUDA is available, else gloo.
  On CUDA a rank uses device `cuda:{local_rank}` (its index on its machine; default the rank).
- `run_ranks(fn, world_size, args, backend, timeout_s)` starts `world_size` processes (multiprocessing `spawn`),
  each calls `fn(comm, rank, *args)` after `init_rank`, and returns the list of the ranks' return values in rank
  order (they travel through `torch.save` files, so tensors are fine). A rank that raises fails the whole call with
  that rank's traceback; a run past `timeout_s` kills the ranks and raises `TimeoutError`. `fn` must be importable
  (a module-level function). Each rank runs torch with `threads_per_rank` intra-op threads.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from engine.parallel.comm import TorchDistributed


@dataclass(frozen=True)
class Rendezvous:
    """Where a group's ranks meet: a `FileStore` at `file` (one machine), or a `TCPStore` served by rank 0's process
    at `master_addr:master_port` (ranks on several machines, as `torchrun` does)."""

    file: str | None = None
    master_addr: str | None = None
    master_port: int | None = None

    def store(self, world_size: int, rank: int, timeout_s: float):
        import torch.distributed as dist

        if self.master_addr is None:
            return dist.FileStore(str(self.file), world_size)
        return dist.TCPStore(self.master_addr, int(self.master_port), world_size, is_master=rank == 0,
                             timeout=timedelta(seconds=timeout_s), wait_for_workers=False)


def init_rank(rendezvous: Rendezvous | str | Path, world_size: int, rank: int, backend: str | None = None,
              timeout_s: float = 120.0, local_rank: int | None = None) -> TorchDistributed:
    """`rendezvous`: a `Rendezvous`, or a FileStore path. `local_rank`: this rank's device index on its machine
    (default `rank`: every rank on one machine)."""
    import torch.distributed as dist

    if not isinstance(rendezvous, Rendezvous):
        rendezvous = Rendezvous(file=str(rendezvous))
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(rank if local_rank is None else local_rank)
    store = rendezvous.store(world_size, rank, timeout_s)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s))
    return TorchDistributed()


def _rank_main(fn: Callable, rank: int, world_size: int, workdir: str, args: tuple, backend: str | None,
               threads_per_rank: int) -> None:
    import torch.distributed as dist

    torch.set_num_threads(threads_per_rank)
    out = Path(workdir) / f"rank{rank}"
    try:
        comm = init_rank(Path(workdir) / "rendezvous", world_size, rank, backend)
        result = fn(comm, rank, *args)
        torch.save({"ok": True, "value": result}, str(out) + ".tmp")
    except BaseException:  # noqa: BLE001 - reported to the parent with the traceback
        torch.save({"ok": False, "value": traceback.format_exc()}, str(out) + ".tmp")
    finally:
        os.replace(str(out) + ".tmp", out)
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn: Callable, world_size: int, args: tuple = (), backend: str | None = None,
              timeout_s: float = 300.0, threads_per_rank: int = 1) -> list[Any]:
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="kdamesh-ranks-") as workdir:
        procs = [ctx.Process(target=_rank_main, args=(fn, r, world_size, workdir, args, backend, threads_per_rank),
                             daemon=True) for r in range(world_size)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        if any(p.is_alive() for p in procs):
            for p in procs:
                p.kill()
            raise TimeoutError(f"{world_size} ranks did not finish within {timeout_s} s")
        results = []
        for r in range(world_size):
            path = Path(workdir) / f"rank{r}"
            if not path.exists():
                raise RuntimeError(f"rank {r} exited with code {procs[r].exitcode} and no result")
            record = torch.load(str(path), weights_only=False)
            if not record["ok"]:
                raise RuntimeError(f"rank {r} failed:\n{record['value']}")
            results.append(record["value"])
        return results
