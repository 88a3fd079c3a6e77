"""The model executor the engine drives: the model runner in this process (TP=1) or a group of rank processes.

Contract:
- `open_executor(config, model_dir, load)` returns a `LocalExecutor` for `tensor_parallel_size == 1` (the model
  loaded here, unsharded) or a `RankGroupExecutor` for N > 1: it spawns ranks 1..N-1 (multiprocessing `spawn`), this
  process joins the `torch.distributed` group as rank 0 (gloo on CPU, NCCL on CUDA: engine/parallel/launch.py), and
  every rank loads only its own slices (`load_model(dir, load, ctx)`; on CUDA rank r uses `cuda:r`).
- `executor.model` is rank 0's model (its config and dtype size the cache: `engine.config.plan_cache` with
  `tensor_parallel_size`); `executor.profile(args)` runs engine/memory_profile.py's profile on every rank (the
  forward is a collective; every rank gets the tightest rank's result); `executor.start(plan, max_forward_tokens)`
  builds the `ModelRunner` on every rank.
- Then it has the runner's interface: `execute(out, running_slots)` (fp32 logits `[L, V]`, full vocabulary, on rank
  0 only: sampling happens here), `copy_slots`, `read_blocks`, `write_blocks`, `read_state`, `write_state` (the
  TP-independent layout: all heads), `block_shape`, `state_shapes`, `device`. In a rank group each call that touches
  the cache is a command rank 0 sends (engine/parallel/channel.py: tensor payloads, never a pickled tensor; a KDA
  state goes to each rank as its own heads only) before running it itself, so every rank executes the
  same commands, and so the same collectives, in the same order: `run_step` (the `RankStep` rank 0 planned),
  `copy_slots`, `read_state` (an all-gather), `write_state` / `write_blocks` (each rank keeps its heads), `shutdown`.
  MLA blocks are replicated, so `read_blocks` reads rank 0's copy and sends no command — except under
  decode-context parallelism (`decode_context_parallel_size` > 1, engine/parallel/context.py), where each rank
  holds a token share of every block and `read_blocks` is a command (a gather over the DCP group).
- Idle ranks wait for the next command inside a collective: when no command was sent for a quarter of
  `collective_timeout_s`, a heartbeat thread sends `ping` (a barrier on every rank), so an idle group stays up and a
  rank that hangs while idle is noticed too. Commands are serialised by a lock.
- Faults: before each command rank 0 checks that every rank process lives; a dead one (or a collective past
  `collective_timeout_s`, e.g. a hung rank) raises `RankFailedError`, and the executor stays failed (every later
  call raises it too); `healthy()` says so without a collective (any thread may ask). `close()` sends `shutdown` when the group is healthy, waits `join_timeout_s`, kills what is
  left and leaves the group; after it no rank process remains (`rank_pids` names them). A rank whose rank 0 is
  gone exits when its next collective fails.
- One rank group per process at a time (it is `torch.distributed`'s default group).
"""

from __future__ import annotations

import multiprocessing as mp
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from engine.model.config import load_model_config
from engine.model.loader import LoadConfig, load_model
from engine.parallel.channel import CommandChannel, Sharded
from engine.parallel.comm import SINGLE, RankContext, TorchDistributed
from engine.parallel.config import ParallelConfig
from engine.parallel.config import ParallelError
from engine.parallel.context import open_dcp_comm
from engine.parallel.launch import Rendezvous, init_rank
from engine.parallel.pipeline import SINGLE_STAGE, Stage
from engine.parallel.state import scatter_state
from engine.runner import ModelRunner, RankStep


class RankFailedError(RuntimeError):
    """A rank process died or a collective timed out: the model can no longer run."""


@dataclass(frozen=True)
class ExecutorConfig:
    tensor_parallel_size: int = 1
    enable_expert_parallel: bool = False
    decode_context_parallel_size: int = 1  # MLA latents split by token over groups of this many ranks
    pipeline_parallel_size: int = 1  # stages; ranks = TP x PP, global rank = stage * TP + tp_rank
    collective_timeout_s: float = 60.0  # a collective waiting longer fails the group (a hung or lost rank)
    start_timeout_s: float = 300.0  # how long the ranks may take to start and join
    join_timeout_s: float = 10.0  # how long `close()` waits for the ranks to exit before killing them
    threads_per_rank: int = 1  # torch intra-op threads in each spawned rank
    backend: str | None = None  # None: NCCL with CUDA, else gloo
    nnodes: int = 1  # machines the group spans; each runs world_size / nnodes ranks
    node_rank: int = 0  # this machine's index; node 0 hosts rank 0 (the engine)
    master_addr: str | None = None  # rank 0's machine (the TCP rendezvous), needed when nnodes > 1
    master_port: int | None = None

    def __post_init__(self) -> None:
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise ParallelError(f"node_rank {self.node_rank} must be in [0, nnodes {self.nnodes})")
        if self.pipeline_parallel_size < 1:
            raise ParallelError(f"--pipeline-parallel-size must be >= 1, got {self.pipeline_parallel_size}")
        if self.world_size % self.nnodes:
            raise ParallelError(f"--tensor-parallel-size {self.tensor_parallel_size} x --pipeline-parallel-size "
                                f"{self.pipeline_parallel_size} is not divisible by --nnodes {self.nnodes}")
        if self.nnodes > 1 and (self.master_addr is None or self.master_port is None):
            raise ParallelError("--nnodes > 1 needs --master-addr and --master-port (rank 0's machine)")

    def parallel(self, rank: int) -> ParallelConfig:
        """Global rank `rank`'s tensor-parallel place (its TP rank within its stage)."""
        return ParallelConfig(self.tensor_parallel_size, rank % self.tensor_parallel_size, self.enable_expert_parallel,
                              self.decode_context_parallel_size)

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def stage(self, rank: int, model_dir: str) -> Stage:
        """Global rank `rank`'s pipeline stage (its layers: engine/parallel/pipeline.py)."""
        if self.pipeline_parallel_size == 1:
            return SINGLE_STAGE
        config = load_model_config(model_dir)
        return Stage.of(config.num_hidden_layers, self.pipeline_parallel_size, rank // self.tensor_parallel_size,
                        self.tensor_parallel_size, rank % self.tensor_parallel_size, config.tie_word_embeddings)

    def context(self, rank: int, tp_comm: TorchDistributed, model_dir: str) -> RankContext:
        """Rank `rank`'s context: its slices, its stage's TP group and (DCP > 1) its DCP group, which every rank
        creates collectively (engine/parallel/context.py)."""
        parallel = self.parallel(rank)
        dcp = open_dcp_comm(parallel, tp_comm.group, stages=self.pipeline_parallel_size,
                            stage=rank // self.tensor_parallel_size)
        return RankContext(parallel, tp_comm, dcp_comm=dcp, stage=self.stage(rank, model_dir))

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.nnodes

    def node_ranks(self) -> range:
        """The ranks this machine runs (rank r on machine r // ranks_per_node, device index r % ranks_per_node)."""
        return range(self.node_rank * self.ranks_per_node, (self.node_rank + 1) * self.ranks_per_node)

    def rendezvous(self, workdir: str) -> Rendezvous:
        if self.nnodes > 1:
            return Rendezvous(master_addr=self.master_addr, master_port=self.master_port)
        return Rendezvous(file=str(Path(workdir) / "rendezvous"))


def _join(config: ExecutorConfig, rendezvous: Rendezvous, rank: int) -> tuple[TorchDistributed, TorchDistributed]:
    """Joins the group (waiting up to `start_timeout_s` for every rank to start), then opens the groups the
    commands (all ranks) and the model's TP collectives (this rank's stage) run on, whose operations time out after
    `collective_timeout_s`: (world, tp)."""
    import torch.distributed as dist

    init_rank(rendezvous, config.world_size, rank, config.backend, config.start_timeout_s,
              local_rank=rank % config.ranks_per_node)
    timeout = timedelta(seconds=config.collective_timeout_s)
    world = TorchDistributed(dist.new_group(list(range(config.world_size)), timeout=timeout))
    if config.pipeline_parallel_size == 1:
        return world, world
    tp = config.tensor_parallel_size
    groups = [dist.new_group(list(range(s * tp, (s + 1) * tp)), timeout=timeout)  # every rank creates every group
              for s in range(config.pipeline_parallel_size)]
    return world, TorchDistributed(groups[rank // tp])


def _rank_load(load: LoadConfig, local_rank: int) -> LoadConfig:
    """`local_rank`: the rank's device index on its machine."""
    if load.device.startswith("cuda"):
        return replace(load, device=f"cuda:{local_rank}")
    return load


class LocalExecutor:
    """TP=1: the model and its runner in this process."""

    rank_pids: list[int] = []

    def __init__(self, model_dir: str, load: LoadConfig, ctx: RankContext = SINGLE):
        self.model = load_model(model_dir, load, ctx)
        self.runner: ModelRunner | None = None

    def profile(self, args, media=None):
        """`engine.memory_profile.profiled_kv_budget` on this rank (every rank of a group: see RankGroupExecutor);
        `media`: rank 0's images (`engine.vision.feed.MediaSetup`), whose encoder is profiled here only."""
        from engine.memory_profile import profiled_kv_budget

        return profiled_kv_budget(args, self.model, media)

    def start(self, plan, max_forward_tokens: int | None, media=None, graphs=None) -> None:
        """`media`: rank 0's image feeder (engine.vision.feed); the batches it plans carry the image rows.
        `graphs`: `engine.runner.GraphOptions` for compiled / captured decode steps (None: eager)."""
        self.runner = ModelRunner(self.model, plan, max_forward_tokens, media=media, graphs=graphs)

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def cache(self):
        """Rank 0's `CacheTensors` (its KDA heads; MLA blocks are replicated)."""
        return self.runner.cache

    def block_shape(self):
        return self.runner.block_shape()

    def state_shapes(self):
        return self.runner.state_shapes()

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        return self.runner.read_blocks(block_ids)  # [num_mla_layers, n, block_size, cache_dim]

    def _command(self, name: str, *args: Any) -> Any:
        return getattr(self.runner, name)(*args)

    def execute(self, out, running_slots: list[int]) -> torch.Tensor:
        return self._command("run_step", self.runner.plan_step(out, running_slots))  # [L, V]

    def execute_with_prompt_rows(self, out, running_slots: list[int], prompt_rows: list[int]):
        """`ModelRunner.execute_with_prompt_rows` on every rank: planned here, run by all."""
        if not any(prompt_rows):
            return self.execute(out, running_slots), self.runner.no_prompt_rows(out)
        logits = self._command("run_step", self.runner.plan_step(out, running_slots, prompt_rows))
        return self.runner.split_prompt_rows(logits, out, running_slots, prompt_rows)

    def set_taps(self, taps: tuple[int, ...]) -> None:
        """Drafter taps every planned step captures (rank 0 plans; engine/spec/capture.py)."""
        self.runner.taps = tuple(taps)

    def take_tapped(self) -> torch.Tensor | None:
        return self.runner.take_tapped()  # rank 0's capture of the latest step

    def copy_slots(self, pairs: list[tuple[int, int]]) -> None:
        if pairs:
            self._command("copy_slots", pairs)

    def read_state(self, slot: int) -> dict[str, torch.Tensor]:
        return self._command("read_state", slot)

    def write_state(self, slot: int, state: dict[str, torch.Tensor]) -> None:
        self._command("write_state", slot, state)

    def write_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        self._command("write_blocks", block_ids, data)

    def healthy(self) -> bool:
        return True

    def close(self) -> None:
        return None


def _apply(runner: ModelRunner, comm: TorchDistributed, name: str, args: tuple) -> Any:
    """One command on one rank; `ping` (the idle heartbeat) is a barrier, so a hung rank is seen while idle too."""
    return comm.barrier() if name == "ping" else getattr(runner, name)(*args)


def _rank_main(config: ExecutorConfig, rank: int, model_dir: str, load: LoadConfig, rendezvous: Rendezvous) -> None:
    """Ranks 1..N-1: join the group, load this rank's slices, then execute rank 0's commands until `shutdown`."""
    import torch.distributed as dist

    torch.set_num_threads(config.threads_per_rank)
    comm, tp_comm = _join(config, rendezvous, rank)
    try:
        model = load_model(model_dir, _rank_load(load, rank % config.ranks_per_node),
                           config.context(rank, tp_comm, model_dir))
        start = TorchDistributed().broadcast_object(None)  # the start group (or first the memory profile)
        if start[0] == "profile":
            from engine.memory_profile import profiled_kv_budget

            profiled_kv_budget(start[1], model)  # collective with rank 0's; the engine sizes from rank 0's copy
            start = TorchDistributed().broadcast_object(None)
        plan, max_forward_tokens, graphs = start
        runner = ModelRunner(model, plan, max_forward_tokens, graphs=graphs)
        channel = CommandChannel(comm, model.device)
        while True:
            name, args = channel.receive()
            if name == "shutdown":
                return
            _apply(runner, comm, name, args)
    finally:
        dist.destroy_process_group()


def spawn_ranks(config: ExecutorConfig, ranks: range, model_dir: str, load: LoadConfig,
                rendezvous: Rendezvous) -> list[mp.Process]:
    """Starts these ranks as processes of this machine (`spawn`), each `_rank_main`."""
    spawn = mp.get_context("spawn")
    procs = [spawn.Process(target=_rank_main, args=(config, r, model_dir, load, rendezvous), daemon=True,
                           name=f"kdamesh-rank{r}") for r in ranks]
    for p in procs:
        p.start()
    return procs


class RankGroupExecutor(LocalExecutor):
    """TP=N: rank 0 here (the engine, scheduler and sampling), ranks 1..N-1 in spawned processes."""

    def __init__(self, config: ExecutorConfig, model_dir: str, load: LoadConfig):
        import torch.distributed as dist

        if dist.is_initialized():
            raise RankFailedError("this process already runs a rank group (one per process)")
        self.config = config
        self._failed: BaseException | None = None
        self._workdir = tempfile.mkdtemp(prefix="kdamesh-tp-")
        if config.node_rank != 0:
            raise RankFailedError("node_rank > 0 hosts ranks only (python -m engine.parallel.node), not an engine")
        rendezvous = config.rendezvous(self._workdir)
        self._procs = spawn_ranks(config, config.node_ranks()[1:], model_dir, load, rendezvous)
        self.rank_pids = [p.pid for p in self._procs]
        self._lock = threading.Lock()  # one command at a time: the step thread's and the heartbeat's
        self._last = time.monotonic()  # when the latest command was sent
        self._closed = threading.Event()
        try:
            self.comm, tp_comm = _join(config, rendezvous, 0)
            super().__init__(model_dir, _rank_load(load, 0), config.context(0, tp_comm, model_dir))
            self.channel = CommandChannel(self.comm, self.model.device)
        except BaseException:
            self._kill()
            raise

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """Replicated across TP ranks (rank 0's copy); a command of every rank under pipeline parallelism (every
        stage's part) and decode-context parallelism (each rank holds a token share, gathered by all)."""
        if self.config.pipeline_parallel_size == 1 and self.config.decode_context_parallel_size == 1:
            return super().read_blocks(block_ids)
        return self._command("read_blocks", block_ids)

    def profile(self, args, media=None):
        if args.gpu_memory_utilization is None:
            return None
        TorchDistributed().broadcast_object(("profile", args))
        return super().profile(args, media)

    def start(self, plan, max_forward_tokens: int | None, media=None, graphs=None) -> None:
        TorchDistributed().broadcast_object((plan, max_forward_tokens, graphs))
        super().start(plan, max_forward_tokens, media, graphs)
        self._last = time.monotonic()
        threading.Thread(target=self._heartbeat, name="kdamesh-tp-heartbeat", daemon=True).start()

    def _heartbeat(self) -> None:
        """Idle ranks wait for the next command inside a collective that times out: ping them well before."""
        interval = self.config.collective_timeout_s / 4
        while not self._closed.wait(interval / 2):
            if self.healthy() and time.monotonic() - self._last >= interval:
                try:
                    self._command("ping")
                except Exception:  # noqa: BLE001 - recorded in self._failed: healthy() is False from now on
                    pass

    def check_ranks(self) -> None:
        if self._failed is None:
            dead = [(p.name, p.exitcode) for p in self._procs if not p.is_alive()]
            if dead:
                self._failed = RankFailedError(f"rank processes exited: {dead}")
        if self._failed is not None:
            raise RankFailedError(f"the rank group failed: {self._failed}") from self._failed

    def healthy(self) -> bool:
        """Whether every rank lives and no collective failed (any thread may ask)."""
        return self._failed is None and all(p.is_alive() for p in self._procs)

    def _command(self, name: str, *args: Any) -> Any:
        with self._lock:
            self.check_ranks()
            self._last = time.monotonic()
            try:
                name, args = self.channel.send((name, _shard_states(name, args, self.comm.size,
                                                                    self.config.tensor_parallel_size)))
                return _apply(self.runner, self.comm, name, args)
            except Exception as exc:  # a lost peer or a collective past its timeout
                self._failed = exc
                self.check_ranks()
                raise

    def close(self) -> None:
        import torch.distributed as dist

        self._closed.set()
        with self._lock:
            if self._failed is None and all(p.is_alive() for p in self._procs):
                try:
                    self.channel.send(("shutdown", ()))
                except Exception as exc:  # noqa: BLE001 - the ranks are killed below anyway
                    self._failed = exc
        for p in self._procs:
            p.join(self.config.join_timeout_s)
        self._kill()
        if dist.is_initialized():
            dist.destroy_process_group()

    def _kill(self) -> None:
        for p in self._procs:
            if p.is_alive():
                p.kill()
            p.join(self.config.join_timeout_s)
        shutil.rmtree(self._workdir, ignore_errors=True)


def _sharded_state(state: dict[str, torch.Tensor] | None, size: int, tp: int) -> dict[str, Sharded] | None:
    """A TP-independent KDA state as each rank's own heads (`Sharded`): global rank r receives only the heads of
    its TP rank r % tp (of every layer: a pipeline stage keeps its own layers')."""
    if not state:
        return state
    heads = [scatter_state(state, tp, t) for t in range(tp)] if tp > 1 else [state]
    return {name: Sharded(tuple(heads[r % tp][name] for r in range(size))) for name in state}


def _shard_states(name: str, args: tuple, size: int, tp: int) -> tuple:
    """The command's KDA states sent as per-rank slices (`write_state`, a step's state loads), marked local."""
    if name == "write_state":
        slot, state = args
        return slot, _sharded_state(state, size, tp), True
    if name == "run_step" and any(i.state for i in args[0].inits):
        step: RankStep = args[0]
        inits = [replace(i, state=_sharded_state(i.state, size, tp), state_is_local=True) if i.state else i
                 for i in step.inits]
        return (replace(step, inits=inits),)
    return args


def executor_config(args) -> ExecutorConfig:
    """The rank group an engine's options (`EngineArgs`) describe: the one rule, for the engine and every node."""
    return ExecutorConfig(args.tensor_parallel_size, args.enable_expert_parallel,
                          pipeline_parallel_size=args.pipeline_parallel_size,
                          decode_context_parallel_size=args.decode_context_parallel_size,
                          collective_timeout_s=args.collective_timeout_s,
                          nnodes=args.nnodes, node_rank=args.node_rank, master_addr=args.master_addr,
                          master_port=args.master_port)


def open_executor(config: ExecutorConfig, model_dir: str, load: LoadConfig) -> LocalExecutor:
    if config.world_size == 1:
        return LocalExecutor(model_dir, load, RankContext(config.parallel(0)))
    return RankGroupExecutor(config, model_dir, load)
