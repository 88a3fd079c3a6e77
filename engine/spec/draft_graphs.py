"""Compiled drafter steps: a model drafter's batched draft function under `torch.compile`, one graph per batch
bucket with the context length dynamic, called without Dynamo's guards once settled — the drafter's side of the
compiled decode step (engine/decode_graphs.py).

Contract:
- `DraftGraphs(owner, fn, compilation, device, max_num_seqs, length_dims)`: `fn(owner, *tensors) -> tensors` is
  the drafter's pure step (it reads its inputs and the owner's weights and writes nothing that outlives the call);
  `length_dims[i]` is the dimension of input i that grows with the context (None: none). It compiles where the
  engine's decode step does (`compilation.compiles`, `compilation` None under `enforce_eager`), on CPU with the
  inductor backend: elsewhere `compiled` is False and every call runs `fn` eagerly.
  (On CUDA the drafter's step would be a captured graph; that is not built: no device has run it.)
- `bucket(n)`: the batch size a step of `n` rows runs at (the engine's decode buckets, `CompilationConfig.
  bucket_sizes`), or None — not compiled, or more rows than the largest bucket: the caller runs `fn` eagerly.
  The caller pads its rows to the bucket itself (it knows what a harmless row is) and keeps the first `n` outputs.
- `__call__(*tensors)`: the bucket's graph (dimension 0 of every input is the bucket). Each input's context
  dimension is marked dynamic, so a growing context never recompiles; it must be at least `MIN_LENGTH` (a size
  of 0 or 1 would be specialised). The bucket is a `GuardSkipping` variant (engine/guard_skipping.py): once a
  call compiled nothing and a probe one row longer compiled nothing either, its calls run Dynamo's bytecode
  directly. The probe's inputs are the call's, each context dimension extended by one zero row: its outputs are
  discarded.
- Equal to eager up to rounding (tests compare the draft ids with `fn` run eagerly); a drafter only proposes, so
  a rounding difference can change which tokens are accepted, never the target's outputs.
"""

from __future__ import annotations

import logging
import types
from collections.abc import Callable, Sequence

import torch

from engine.compilation import CompilationConfig, checked_inductor_options, compiled_with_options
from engine.guard_skipping import GuardSkipping
from kernels import prepare_compiled_ops

logger = logging.getLogger(__name__)

MIN_LENGTH = 2  # a dynamic dimension of size 0 or 1 would be specialised by torch.compile


class DraftGraphs:
    def __init__(self, owner: object, fn: Callable, compilation: CompilationConfig | None, device: torch.device,
                 max_num_seqs: int, length_dims: Sequence[int | None]):
        self.owner, self.fn, self.length_dims = owner, fn, tuple(length_dims)
        self.compiled = (compilation is not None and compilation.compiles(device.type) and device.type == "cpu"
                         and compilation.backend == "inductor")
        self.buckets = compilation.bucket_sizes(max_num_seqs) if self.compiled else ()
        self.num_calls = 0  # compiled calls (tests tell them from eager ones by it)
        if not self.compiled:
            return
        prepare_compiled_ops(device)
        self._code = fn.__code__.replace()  # Dynamo caches graphs per code object: one per drafter
        options = checked_inductor_options(compilation, "cpu")
        self._step = compiled_with_options(self._bind(self._code), "inductor", options, dynamic=False)
        self.guards = GuardSkipping(self._probe, self._code, self._bind)
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 3 * len(self.buckets))
        logger.info("draft graphs: %s compiled, buckets %s", fn.__qualname__, list(self.buckets))

    def bucket(self, n: int) -> int | None:
        return next((b for b in self.buckets if b >= n), None)

    def __call__(self, *tensors: torch.Tensor):
        self.num_calls += 1
        length = next(t.shape[d] for t, d in zip(tensors, self.length_dims) if d is not None)
        self._current = tensors  # what a probe extends
        try:
            return self.guards.call(tensors[0].shape[0], length, lambda direct: self._run(direct, tensors))
        finally:
            self._current = ()

    def _bind(self, code: types.CodeType):
        return types.MethodType(types.FunctionType(code, self.fn.__globals__, self.fn.__name__), self.owner)

    def _run(self, direct, tensors: Sequence[torch.Tensor]):
        for t, d in zip(tensors, self.length_dims):
            if d is not None:
                torch._dynamo.maybe_mark_dynamic(t, d)
        with torch.inference_mode():
            return (direct or self._step)(*tensors)

    def _probe(self, bucket: int, length: int) -> int:
        """The call's bucket one context row longer (a zero row appended to each context dimension): compiles
        nothing unless the graph specialised on the length. Its outputs are discarded."""
        longer = [t if d is None else torch.cat([t, t.new_zeros(t.shape[:d] + (1,) + t.shape[d + 1:])], dim=d)
                  for t, d in zip(self._current, self.length_dims)]
        self._run(None, longer)
        return length + 1
