"""What bench/gpu_validate.py's sections share: a check's record, the report, relative error and median time."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch


@dataclass
class Check:
    name: str
    backend: str
    status: str  # pass | fail | skipped | error
    rel_err: float | None = None
    ms: float | None = None
    note: str = ""


@dataclass
class Report:
    device: str
    checks: list[Check] = field(default_factory=list)

    def add(self, check: Check) -> None:
        self.checks.append(check)
        print(f"{check.status:8s} {check.name:28s} {check.backend:10s} err={check.rel_err} ms={check.ms} {check.note}",
              flush=True)


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-30))


def median_ms(fn, repeats: int = 5) -> float:
    """Median milliseconds of `fn()` (CUDA events; wall clock when CUDA is absent, as in the CPU smoke test)."""
    fn()
    if not torch.cuda.is_available():
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return sorted(times)[len(times) // 2]
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def _prefill_batch(prompts: list[list[int]], block: int, blocks_per_seq: int):
    from engine.model.batch import ForwardBatch

    ids, cu, slots = [], [0], []
    for n, p in enumerate(prompts):
        ids.extend(p)
        cu.append(cu[-1] + len(p))
        slots.extend((n * blocks_per_seq + i // block) * block + i % block for i in range(len(p)))
    tables = torch.arange(len(prompts) * blocks_per_seq, dtype=torch.int32).view(len(prompts), -1)
    return ForwardBatch(torch.tensor(ids), torch.tensor(cu), torch.tensor([len(p) for p in prompts]), tables,
                        torch.tensor(slots), torch.arange(len(prompts)))


def _decode_batch(lengths: list[int], tokens: list[int], block: int, blocks_per_seq: int):
    from engine.model.batch import ForwardBatch

    n = len(lengths)
    slots = [(s * blocks_per_seq + pos // block) * block + pos % block for s, pos in enumerate(lengths)]
    tables = torch.arange(n * blocks_per_seq, dtype=torch.int32).view(n, -1)
    return ForwardBatch(torch.tensor(tokens), torch.arange(n + 1), torch.tensor(lengths) + 1, tables,
                        torch.tensor(slots), torch.arange(n))


def model_steps(model, prompts: list[list[int]], decode_steps: int) -> dict:
    """Prefill the prompts in one batch, then greedy decode steps; logits and CUDA milliseconds."""
    from engine.model.batch import CacheTensors

    block, length = 16, max(len(p) for p in prompts) + decode_steps
    per_seq = -(-length // block)
    cache = CacheTensors.allocate(model.config, len(prompts) * per_seq, block, len(prompts), model.dtype,
                                  model.device, kda_heads=model.num_local_kda_heads)
    batch = _prefill_batch(prompts, block, per_seq).to(model.device)
    sync = torch.cuda.synchronize if model.device.type == "cuda" else (lambda: None)
    start = time.perf_counter()
    logits = model(batch, cache)  # [N, V]
    sync()
    prefill_ms = (time.perf_counter() - start) * 1e3
    lengths, tokens = [len(p) for p in prompts], logits.argmax(-1).tolist()
    start = time.perf_counter()
    for _ in range(decode_steps):
        step = model(_decode_batch(lengths, tokens, block, per_seq).to(model.device), cache)
        tokens, lengths = step.argmax(-1).tolist(), [n + 1 for n in lengths]
    sync()
    decode_ms = (time.perf_counter() - start) * 1e3 / max(decode_steps, 1)
    return {"logits": logits.float().cpu(), "prefill_ms": prefill_ms, "decode_ms": decode_ms}
