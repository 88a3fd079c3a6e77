"""A machine of a multi-node rank group other than rank 0's: `kdamesh node` (or `python -m engine.parallel.node`) `--model DIR
--tensor-parallel-size N --nnodes M --node-rank K --master-addr HOST --master-port PORT [...]`.

Contract:
- `serve_node(config, model_dir, load)` starts this machine's ranks (`ExecutorConfig.node_ranks()`: ranks
  K·N/M … (K+1)·N/M − 1, device index = rank mod N/M) as local processes; each joins the group over the TCP
  rendezvous at `master_addr:master_port` (served by rank 0, inside the engine on node 0, which is started with
  the same `--tensor-parallel-size/--nnodes/--master-addr/--master-port` and `--node-rank 0`), loads its slices and
  executes rank 0's commands until rank 0 shuts the group down or fails. Returns 0 when every rank exited cleanly,
  else 1. Every rank waits at most `start_timeout_s` for the group to form and `collective_timeout_s` per command.
- The flags are the engine's own options (`EngineArgs`: model, dtype, load format, device, seed, parallel layout),
  so a node runs the model exactly as the engine's machine does.
"""

from __future__ import annotations

import argparse
import tempfile

from engine.config import EngineArgs
from engine.model.loader import LoadConfig
from engine.parallel.executor import ExecutorConfig, executor_config, spawn_ranks
from telemetry.options import add_options

NODE_OPTIONS = ("model", "dtype", "load_format", "device", "seed", "tensor_parallel_size", "pipeline_parallel_size",
                "enable_expert_parallel", "decode_context_parallel_size", "nnodes", "node_rank", "master_addr",
                "master_port")


def serve_node(config: ExecutorConfig, model_dir: str, load: LoadConfig) -> int:
    with tempfile.TemporaryDirectory(prefix="kdamesh-node-") as workdir:
        procs = spawn_ranks(config, config.node_ranks(), model_dir, load, config.rendezvous(workdir))
        for p in procs:
            p.join()
    return 0 if all(p.exitcode == 0 for p in procs) else 1


def main(argv: list[str] | None = None, prog: str = "python -m engine.parallel.node") -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    add_options(parser, EngineArgs, only=NODE_OPTIONS)
    ns = parser.parse_args(argv)
    args = EngineArgs(**{name: getattr(ns, name) for name in NODE_OPTIONS})
    load = LoadConfig(load_format=args.load_format, dtype=args.dtype, device=args.device, seed=args.seed)
    return serve_node(executor_config(args), args.model, load)


if __name__ == "__main__":
    raise SystemExit(main())
