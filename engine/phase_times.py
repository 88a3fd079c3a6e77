"""Where a request spent its time in this engine: queued, prefilling, decoding — vLLM's request phases.

Contract:
- `RequestTimes` holds one sequence's `time.monotonic()` stamps in this engine: `queued` (created), `scheduled`
  (first admitted to the running batch; a preemption does not move it), `first_token` and `last_token` (sampled
  here). `resumed` marks an imported sequence (its prefill ran on another engine); `handed_off` one that ends in
  an export (its decode runs on another engine).
- `PhaseTimes.observe(times)` adds a finished sequence to three cumulative histograms (vLLM's definitions and
  bucket boundaries, `REQUEST_LATENCY_BUCKETS`): queue = scheduled - queued, prefill = first_token - scheduled,
  decode = last_token - first_token. So that a request handed from a prefill engine to a decode engine is counted
  once per phase across the two: a resumed sequence adds only decode (last_token - scheduled: its load and its
  new tokens), a handed-off one only queue and prefill. A phase whose stamps are missing (aborted early) is skipped.
  A fourth, inference = last_token - scheduled (vLLM's prefill + decode), is what the sequence ran in this engine.
- `observe_step(num_tokens)` adds one engine step's scheduled tokens to the iteration histogram
  (`ITERATION_TOKEN_BUCKETS`, vLLM's `vllm:iteration_tokens_total`).
- `snapshot()` is an immutable `PhaseSnapshot` (the step thread publishes it with the engine's stats).
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field

from telemetry.vllm import ITERATION_TOKEN_BUCKETS, REQUEST_LATENCY_BUCKETS  # vLLM's boundaries


@dataclass
class RequestTimes:
    queued: float = field(default_factory=time.monotonic)
    scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    resumed: bool = False
    handed_off: bool = False

    def mark_scheduled(self) -> None:
        if self.scheduled is None:
            self.scheduled = time.monotonic()

    def mark_token(self) -> None:
        now = time.monotonic()
        if self.first_token is None:
            self.first_token = now
        self.last_token = now


@dataclass(frozen=True)
class HistogramSnapshot:
    """Per-bucket counts (not cumulative): `counts[i]` for values <= `bounds[i]`, the last one for the rest."""

    bounds: tuple[float, ...]
    counts: tuple[int, ...]  # len(bounds) + 1
    total: float  # sum of the observed values


@dataclass(frozen=True)
class PhaseSnapshot:
    queue: HistogramSnapshot
    prefill: HistogramSnapshot
    decode: HistogramSnapshot
    inference: HistogramSnapshot
    iteration_tokens: HistogramSnapshot


class _Histogram:
    def __init__(self, bounds: tuple[float, ...]):
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.total = 0.0

    def observe(self, value: float) -> None:
        value = max(0.0, value)
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value

    def snapshot(self) -> HistogramSnapshot:
        return HistogramSnapshot(self.bounds, tuple(self.counts), self.total)


class PhaseTimes:
    """The engine's cumulative queue / prefill / decode histograms (see the module docstring)."""

    def __init__(self, bounds: tuple[float, ...] = REQUEST_LATENCY_BUCKETS):
        self.queue, self.prefill, self.decode = _Histogram(bounds), _Histogram(bounds), _Histogram(bounds)
        self.inference = _Histogram(bounds)
        self.iteration_tokens = _Histogram(ITERATION_TOKEN_BUCKETS)

    def observe_step(self, num_tokens: int) -> None:
        self.iteration_tokens.observe(num_tokens)

    def observe(self, t: RequestTimes) -> None:
        if t.scheduled is None:
            return
        if t.last_token is not None:
            self.inference.observe(t.last_token - t.scheduled)
        if t.resumed:
            if t.last_token is not None:
                self.decode.observe(t.last_token - t.scheduled)
            return
        self.queue.observe(t.scheduled - t.queued)
        if t.first_token is None:
            return
        self.prefill.observe(t.first_token - t.scheduled)
        if not t.handed_off:
            self.decode.observe(t.last_token - t.first_token)

    def snapshot(self) -> PhaseSnapshot:
        return PhaseSnapshot(self.queue.snapshot(), self.prefill.snapshot(), self.decode.snapshot(),
                             self.inference.snapshot(), self.iteration_tokens.snapshot())
