"""engine/parallel: tensor and expert parallelism for one model built per rank.

- `config.py`: `ParallelConfig` (tensor-parallel size, rank, expert parallelism) and the divisibility checks
  (torch-free: the planner, engine/plan.py, uses them).
- `comm.py`: `Communicator` (the collectives a rank's model calls) and `RankContext` (config + communicator) that the
  model layers are built with; `RankContext.single()` is the one-process default.
- `state.py`: a rank's KDA state slice <-> the TP-independent by-head layout (handoffs, cache objects).
- `launch.py`: process groups (gloo on CPU, NCCL on CUDA) and a spawn helper for N local rank processes.
- `executor.py`: what the engine drives — the runner in this process (TP=1) or rank 0 of a group of rank
  processes that execute its broadcast commands (phase 2: `--tensor-parallel-size` on the workers).

What is sharded how is decided by the model layers (`engine/model/layers.py` declares each parameter's split); the
loader reads each rank's slices only (`engine/model/loader.py`). This package file imports nothing, so importing
`engine.parallel.config` stays torch-free.
"""
