"""Pipeline parallelism: which layers a stage owns, and the hidden stream sent between stages.

Contract:
- `stage_layers(num_layers, num_stages)`: every stage's `[start, stop)` of the decoder layers, contiguous and in
  order; an even split, the first `num_layers % num_stages` stages one layer more (the planner's rule,
  `engine.plan_weights.stage_layers`, so `kdamesh plan`'s per-stage figures are this split's). A stage with no layer is refused
  (`ParallelError` naming --pipeline-parallel-size).
- `Stage(num_stages, stage, start, stop, tp_size, tp_rank)` is one rank's place in the pipeline (global rank =
  `stage * tp_size + tp_rank`): stage 0 owns the embedding, the last stage the final norm, the output mix of
  attention residuals and the LM head (and, with tied embeddings, its own copy of the embedding the head reads).
  `owns_layer(i)`, `prev_rank` / `next_rank` (the same TP rank of the neighbouring stage), `owner_of(name)` (the
  stages a checkpoint tensor belongs to, so the loader can leave other stages' tensors unread).
- `send_stream(stage, hidden, blocks)` / `recv_stream(stage, shape, n_blocks, dtype, device)`: the residual stream
  a stage hands on — the hidden `[T, D]` and, with K3 attention residuals, the block snapshots `[n_blocks, T, D]`
  the next layers mix — as ONE tensor `[1 + n_blocks, T, D]` over `torch.distributed` send/recv (no pickles). Both
  sides know the shape: `T` from the step's batch, `n_blocks` from the layer indices (`blocks_before`).
- `to_rank0(t)` (non-blocking: a handle to wait on) / `from_rank(shape, dtype, src)`: the last stage's logits and
  every stage's drafter taps go to global rank 0 point to point.
- Micro-batches (`KimiForCausalLM.forward_micro_batches`): a stage sends each micro-batch's stream with `isend` and
  goes on to the next, so neighbouring stages overlap; messages between two ranks match in send order.
Every rank of the world group must call the matching send/recv in the same order (they are blocking).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.parallel.config import ParallelError


def stage_layers(num_layers: int, num_stages: int) -> list[tuple[int, int]]:
    if num_stages < 1 or num_stages > num_layers:
        raise ParallelError(f"--pipeline-parallel-size {num_stages} must be in [1, {num_layers}] (the model's "
                            f"decoder layers): every stage owns at least one layer")
    from engine.plan_weights import stage_layers as planned  # the planner's rule (`kdamesh plan`), shared

    return [(r.start, r.stop) for r in (planned(num_layers, num_stages, s) for s in range(num_stages))]


def blocks_before(layer: int, block_size: int | None) -> int:
    """Attention-residual block snapshots the stream carries into `layer` (one per block started before it)."""
    if not block_size:
        return 0
    return -(-layer // block_size)  # layers 0, B, 2B, ... each start a block


@dataclass(frozen=True)
class Stage:
    num_stages: int = 1
    stage: int = 0
    start: int = 0
    stop: int = 0  # layers [start, stop); a single stage owns all (stop is set from the config)
    tp_size: int = 1
    tp_rank: int = 0
    tied_embeddings: bool = False

    @classmethod
    def of(cls, num_layers: int, num_stages: int, stage: int, tp_size: int = 1, tp_rank: int = 0,
           tied_embeddings: bool = False) -> "Stage":
        start, stop = stage_layers(num_layers, num_stages)[stage]
        return cls(num_stages, stage, start, stop, tp_size, tp_rank, tied_embeddings)

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.num_stages - 1

    @property
    def pipelined(self) -> bool:
        return self.num_stages > 1

    @property
    def owns_embedding(self) -> bool:
        return self.first or (self.last and self.tied_embeddings)

    @property
    def global_rank(self) -> int:
        return self.stage * self.tp_size + self.tp_rank

    @property
    def prev_rank(self) -> int:
        return (self.stage - 1) * self.tp_size + self.tp_rank

    @property
    def next_rank(self) -> int:
        return (self.stage + 1) * self.tp_size + self.tp_rank

    @property
    def last_rank0(self) -> int:
        """The global rank of the last stage's TP rank 0 (it sends logits and final taps to rank 0)."""
        return (self.num_stages - 1) * self.tp_size

    def owns_layer(self, index: int) -> bool:
        return self.start <= index < self.stop

    def stage_of_layer(self, index: int, num_layers: int) -> int:
        for s, (a, b) in enumerate(stage_layers(num_layers, self.num_stages)):
            if a <= index < b:
                return s
        return -1

    def owns_tensor(self, name: str, prefix: str, num_layers: int) -> bool:
        """Whether this stage holds the checkpoint tensor `name` (official, with the family's `prefix`)."""
        body = name[len(prefix):] if name.startswith(prefix) else name
        if body.startswith("model.layers."):
            index = int(body.split(".")[2])
            return index >= num_layers or self.owns_layer(index)  # MTP layers: set aside by the loader
        if body.startswith("model.embed_tokens."):
            return self.owns_embedding
        return self.last  # the final norm, the output attention-residual mix, the LM head


SINGLE_STAGE = Stage()


def _dist():
    import torch.distributed as dist

    return dist


def send_stream(stage: Stage, hidden: torch.Tensor, blocks: list[torch.Tensor], wait: bool = True):
    """hidden [T, D], blocks n x [T, D] -> the next stage's same TP rank, as one [1 + n, T, D] tensor. `wait`
    False: a non-blocking send whose handle (`.wait()`) the caller keeps until it completes."""
    buf = torch.stack([hidden, *blocks]).contiguous()
    if wait:
        _dist().send(buf, dst=stage.next_rank)
        return None
    return _Sent(_dist().isend(buf, dst=stage.next_rank), buf)


class _Sent:
    """A non-blocking send's handle, holding its buffer alive until `wait()`."""

    def __init__(self, work, buf: torch.Tensor):
        self.work, self.buf = work, buf

    def wait(self) -> None:
        self.work.wait()


def recv_stream(stage: Stage, tokens: int, hidden_size: int, n_blocks: int, dtype: torch.dtype,
                device: torch.device) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(hidden [T, D], blocks n x [T, D]) from the previous stage's same TP rank."""
    buf = torch.empty(1 + n_blocks, tokens, hidden_size, dtype=dtype, device=device)
    _dist().recv(buf, src=stage.prev_rank)
    return buf[0], list(buf[1:].unbind(0))


def to_rank0(t: torch.Tensor) -> _Sent:
    """A non-blocking send to global rank 0 (wait on the handle before the step ends)."""
    buf = t.contiguous()
    return _Sent(_dist().isend(buf, dst=0), buf)


def from_rank(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, src: int) -> torch.Tensor:
    buf = torch.empty(shape, dtype=dtype, device=device)
    _dist().recv(buf, src=src)
    return buf


class StageParts:
    """The whole model's cache layout (every MLA / KDA layer, all heads) and which part of it each stage holds: the
    runner's handoffs (`read_*` / `write_*`) use it to pick a stage's layers out of a full tensor, and rank 0 to
    gather the stages' parts (their TP rank 0 sends each) in layer order."""

    def __init__(self, config, stage: Stage, block_size: int, dtype: torch.dtype, kv_cache_dtype: str = "auto"):
        from kernels.attention.fp8_latent import allocate_latent_cache

        self.config, self.stage, self.block_size, self.dtype = config, stage, block_size, dtype
        self.mla_index = {layer: n for n, layer in enumerate(config.mla_layer_ids)}
        self.kda_index = {layer: n for n, layer in enumerate(config.kda_layer_ids)}
        probe = allocate_latent_cache(1, 1, config.mla.cache_dim, kv_cache_dtype in ("fp8", "fp8_e4m3"), dtype,
                                      "cpu") if config.mla_layer_ids else None
        self.kv_width, self.kv_dtype = (probe.shape[-1], probe.dtype) if probe is not None else (0, dtype)
        ranges = stage_layers(config.num_hidden_layers, stage.num_stages) if stage.pipelined else \
            [(0, config.num_hidden_layers)]
        self.mla_counts = [sum(a <= i < b for i in config.mla_layer_ids) for a, b in ranges]
        self.kda_counts = [sum(a <= i < b for i in config.kda_layer_ids) for a, b in ranges]

    def block_shape(self) -> tuple[tuple[int, ...], torch.dtype]:
        return (len(self.config.mla_layer_ids), self.block_size, self.kv_width), self.kv_dtype

    def state_shapes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        k = self.config.kda
        if k is None or not self.config.kda_layer_ids:
            return {}
        n = len(self.config.kda_layer_ids)
        return {"conv": ((n, 3 * k.num_heads * k.head_dim, k.conv_kernel_size - 1), self.dtype),
                "recurrent": ((n, k.num_heads, k.head_dim, k.head_dim), torch.float32)}

    def _gather(self, local: torch.Tensor | None, counts: list[int], row_shape: tuple[int, ...],
                dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
        """local [n_mine, *row_shape] per stage -> rank 0: [sum(counts), *row_shape] on the CPU; others None."""
        stage = self.stage
        if stage.global_rank != 0:
            if stage.tp_rank == 0 and counts[stage.stage]:
                to_rank0(local).wait()
            return None
        parts = [local] if counts[0] else []
        for s in range(1, stage.num_stages):
            if counts[s]:
                parts.append(from_rank((counts[s], *row_shape), dtype, device, s * stage.tp_size))
        return torch.cat(parts).cpu() if parts else torch.empty(0, *row_shape, dtype=dtype)

    def gather_blocks(self, local: list[torch.Tensor], n: int, device: torch.device) -> torch.Tensor | None:
        mine = torch.stack(local) if local else None  # [n_mine, n, block_size, width]
        return self._gather(mine, self.mla_counts, (n, self.block_size, self.kv_width), self.kv_dtype, device)

    def gather_state(self, local: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor] | None:
        shapes = self.state_shapes()
        out = {name: self._gather(local.get(name), self.kda_counts, shape[1:], dtype, device)
               for name, (shape, dtype) in shapes.items()}
        return out if self.stage.global_rank == 0 else None
