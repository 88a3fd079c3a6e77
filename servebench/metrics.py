"""Serving metrics with `vllm bench serve`'s definitions, from per-request timelines.

Per request (client clock, `time.perf_counter()`), as `RequestOutput`:
- TTFT: from sending the request to the first streamed chunk that carries a choice;
- ITL: the gaps between consecutive choice chunks (a chunk may hold several tokens: ITL is per chunk, not per token);
- E2EL (`latency`): from sending to the last choice chunk;
- output tokens: the server's `usage.completion_tokens` when it sent usage (we always ask for
  `stream_options.include_usage`), else the number of choice chunks.
Over the run (`calculate_metrics`), counting successful requests only:
- TPOT = (E2EL - TTFT) / (output_tokens - 1), per request, for requests with more than one output token (a
  single-token request has no TPOT; for goodput its TPOT counts as 0);
- ITLs are pooled over all chunks of all requests (so long requests weigh more than in TPOT);
- mean, median, std (population, numpy's default) and the chosen percentiles (numpy's linear interpolation) of TTFT,
  TPOT, ITL and E2EL, in ms; an empty list gives 0 for all of them (as vLLM);
- request_throughput = completed / duration; output_throughput = total output tokens / duration;
  total_token_throughput = (total input + total output tokens) / duration; input tokens of a request are the
  server's `usage.prompt_tokens` when sent, else the dataset's prompt length;
- request_goodput = requests meeting every `--goodput` SLO (`ttft`, `tpot`, `e2el`, in ms; a value equal to the SLO
  meets it) / duration;
- max_output_tokens_per_s: the most output tokens (first chunk + one per ITL) that fell into one 1-second bucket from
  the first request's start; max_concurrent_requests: the peak number of requests in flight ([start, end) intervals).
- prefix_cache_hit_rate = sum of `usage.prompt_tokens_details.cached_tokens` / sum of prompt tokens, over successful
  requests (a request whose usage has no cached count adds 0 cached tokens); 0 when there are no prompt tokens.
Failed requests count in `failed`, contribute 0 to `output_lens` and nothing else.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field

import numpy as np

MS = 1000.0
GOODPUT_METRICS = ("ttft", "tpot", "e2el")
PERCENTILE_METRICS = ("ttft", "tpot", "itl", "e2el", "client_queue_time", "e2el_including_client_queue")


@dataclass
class RequestOutput:
    """One request's outcome (vLLM's `RequestFuncOutput`); times in seconds."""

    generated_text: str = ""
    success: bool = False
    latency: float = 0.0
    output_tokens: int = 0  # from the server's usage; 0 when it sent none
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    prompt_len: int = 0
    error: str = ""
    start_time: float = 0.0
    client_queue_time: float = 0.0  # waiting for the --max-concurrency semaphore
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, when the server sent it

    @property
    def num_chunks(self) -> int:
        return 1 + len(self.itl) if self.success else 0

    @property
    def output_len(self) -> int:
        """Output tokens: the server's count when it sent usage, else the number of choice chunks."""
        if not self.success:
            return 0
        return self.output_tokens or self.num_chunks


@dataclass(frozen=True)
class Stats:
    """mean / median / std / percentiles of one metric, in ms."""

    mean: float
    median: float
    std: float
    percentiles: list[tuple[float, float]]


@dataclass
class BenchmarkMetrics:
    """The run's totals and rates, and one `Stats` per latency metric (vLLM's `mean_ttft_ms` is `ttft_ms.mean`)."""

    completed: int
    failed: int
    total_input: int
    total_output: int
    request_throughput: float
    request_goodput: float
    output_throughput: float
    total_token_throughput: float
    ttft_ms: Stats
    tpot_ms: Stats
    itl_ms: Stats
    e2el_ms: Stats
    max_output_tokens_per_s: float
    max_concurrent_requests: int
    total_cached: int = 0  # cached prompt tokens the server reported (usage.prompt_tokens_details.cached_tokens)

    @property
    def prefix_cache_hit_rate(self) -> float:
        return prefix_cache_hit_rate(self.total_cached, self.total_input)


def prefix_cache_hit_rate(cached_tokens: int, prompt_tokens: int) -> float:
    """Cached prompt tokens / prompt tokens (0 without prompt tokens)."""
    return cached_tokens / prompt_tokens if prompt_tokens > 0 else 0.0


def stats_ms(values_s: list[float], percentiles: list[float]) -> Stats:
    """Summary of values given in seconds, reported in ms; an empty list reports zeros (vLLM's `values or 0`)."""
    data = np.asarray(values_s if values_s else [0.0], dtype=np.float64)
    return Stats(float(np.mean(data)) * MS, float(np.median(data)) * MS, float(np.std(data)) * MS,
                 [(p, float(np.percentile(data, p)) * MS) for p in percentiles])


def percentile_key(p: float) -> str:
    """`99` -> "p99", `99.9` -> "p99.9" (vLLM's naming of percentile fields)."""
    return "p" + (str(int(p)) if int(p) == p else str(p))


def parse_goodput(pairs: list[str] | None) -> dict[str, float]:
    """`["ttft:500", "tpot:50"]` -> {"ttft": 500.0, "tpot": 50.0} (ms); ValueError on a bad name or value."""
    config: dict[str, float] = {}
    for pair in pairs or []:
        name, sep, value = pair.partition(":")
        if not sep:
            raise ValueError(f"invalid --goodput {pair!r}: expected KEY:VALUE with the value in milliseconds")
        try:
            number = float(value)
        except ValueError:
            raise ValueError(f"invalid --goodput {pair!r}: {value!r} is not a number of milliseconds") from None
        if name not in GOODPUT_METRICS:
            raise ValueError(f"invalid --goodput metric {name!r}: choose from {', '.join(GOODPUT_METRICS)}")
        if number < 0:
            raise ValueError(f"invalid --goodput {pair!r}: the SLO must be non-negative")
        config[name] = number
    return config


def tpot_of(output: RequestOutput, output_len: int) -> float | None:
    """(E2EL - TTFT) / (output_len - 1), or None for a request with at most one output token."""
    if output_len <= 1:
        return None
    return (output.latency - output.ttft) / (output_len - 1)


def calculate_metrics(outputs: list[RequestOutput], dur_s: float, selected_percentiles: list[float],
                      goodput_config: dict[str, float] | None = None) -> tuple[BenchmarkMetrics, list[int]]:
    """The run's metrics and each request's output length (0 for failed requests)."""
    actual_output_lens: list[int] = []
    total_input = completed = good_completed = 0
    itls: list[float] = []
    tpots: list[float] = []
    all_tpots: list[float] = []  # 0 for single-token outputs: what goodput compares
    ttfts: list[float] = []
    e2els: list[float] = []
    for out in outputs:
        if not out.success:
            actual_output_lens.append(0)
            continue
        output_len = out.output_len
        actual_output_lens.append(output_len)
        total_input += out.prompt_len
        tpot = tpot_of(out, output_len)
        if tpot is not None:
            tpots.append(tpot)
        all_tpots.append(tpot or 0.0)
        itls.extend(out.itl)
        ttfts.append(out.ttft)
        e2els.append(out.latency)
        completed += 1

    if goodput_config:
        columns, slos = [], []
        for name, values in (("ttft", ttfts), ("tpot", all_tpots), ("e2el", e2els)):
            if name in goodput_config:
                columns.append(values)
                slos.append(goodput_config[name] / MS)
        for request in zip(*columns):
            if all(slo >= value for slo, value in zip(slos, request)):
                good_completed += 1

    if completed == 0 and outputs:
        warnings.warn("All requests failed. This is likely due to a misconfiguration of the benchmark arguments.",
                      stacklevel=2)
    peak_tokens, peak_concurrency = _peaks([o for o in outputs if o.success])
    total_output = sum(actual_output_lens)
    ttft, tpot, itl, e2el = (stats_ms(v, selected_percentiles) for v in (ttfts, tpots, itls, e2els))
    metrics = BenchmarkMetrics(
        completed=completed, failed=sum(1 for o in outputs if not o.success), total_input=total_input,
        total_output=total_output, request_throughput=completed / dur_s, request_goodput=good_completed / dur_s,
        output_throughput=total_output / dur_s, total_token_throughput=(total_input + total_output) / dur_s,
        ttft_ms=ttft, tpot_ms=tpot, itl_ms=itl, e2el_ms=e2el,
        max_output_tokens_per_s=peak_tokens, max_concurrent_requests=peak_concurrency,
        total_cached=sum(o.cached_tokens or 0 for o in outputs if o.success))
    return metrics, actual_output_lens


def _peaks(successful: list[RequestOutput]) -> tuple[float, int]:
    """(most chunk arrivals in one 1-second bucket, peak requests in flight) over successful requests."""
    if not successful:
        return 0.0, 0
    t0 = min(o.start_time for o in successful)
    t_end = max(o.start_time + o.latency for o in successful)
    buckets = np.zeros(int(math.ceil(t_end - t0)) + 1)
    for o in successful:
        t = o.start_time + o.ttft
        times = [t]
        for gap in o.itl:
            t += gap
            times.append(t)
        for when in times:
            b = int(when - t0)
            if 0 <= b < len(buckets):
                buckets[b] += 1
    events = sorted([(o.start_time, 1) for o in successful] + [(o.start_time + o.latency, -1) for o in successful])
    current = peak = 0
    for _, delta in events:  # a departure sorts before an arrival at the same instant: half-open intervals
        current += delta
        peak = max(peak, current)
    return float(buckets.max()), peak
