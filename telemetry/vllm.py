"""The `vllm:` Prometheus series (vLLM's names, types, label `model_name` and bucket boundaries), so that dashboards
and alerts written for vLLM read a kdamesh mesh. The `kdamesh_*` series (telemetry/metrics.py, gateway/metrics.py)
stay for what vLLM has no name for.

Which process exposes which, so that summing over pods never counts one request twice:
- The gateway (`VllmRequestMetrics`) exposes the request-level series, one observation per request it answered:
  `vllm:prompt_tokens_total`, `vllm:generation_tokens_total`, `vllm:request_success_total{finished_reason}`
  ("stop" | "length" | "abort"; a chat turn that ended in tool calls is "stop"),
  `vllm:time_to_first_token_seconds`, `vllm:inter_token_latency_seconds` (each of a request's n-1 gaps observed
  as its mean gap: the gateway sees tokens in batches, so the sum and count are exact, the spread is not),
  `vllm:e2e_request_latency_seconds`, `vllm:request_time_per_output_token_seconds` (a request's mean gap, requests
  of two or more tokens), and the length histograms `vllm:request_prompt_tokens` and
  `vllm:request_generation_tokens` (vLLM's 1-2-5 buckets, here up to `LENGTH_BUCKETS[-1]` whatever the context),
  the request parameters `vllm:request_params_n` (the run's choices) and `vllm:request_params_max_tokens` (when the
  request set it), and `vllm:request_max_num_generation_tokens` (the longest choice's tokens).
- Each prefill and decode worker (`VllmEngineCollector`, read at scrape time from the engine's published stats)
  exposes the engine-level series of its own engine: `vllm:num_requests_running`, `vllm:num_requests_waiting`,
  `vllm:kv_cache_usage_perc` (0..1), `vllm:prefix_cache_queries_total` and `vllm:prefix_cache_hits_total` (in
  prompt tokens), `vllm:num_preemptions_total`, and the phase histograms `vllm:request_queue_time_seconds`,
  `vllm:request_prefill_time_seconds`, `vllm:request_decode_time_seconds` (engine/phase_times.py: a request handed
  from prefill to decode counts its queue and prefill on the prefill worker, its decode on the decode worker),
  `vllm:request_inference_time_seconds` (first scheduled to last token on this engine: a handed-off request is
  observed on both workers, its prefill on one and its decode on the other, so the sums add up while the counts
  count it twice), `vllm:iteration_tokens_total` (tokens per engine step) and `vllm:cache_config_info` (1, with
  the cache's configuration as labels).
  A worker that speculates (`--speculative-config`) adds vLLM's speculative decoding counters:
  `vllm:spec_decode_num_drafts_total`, `vllm:spec_decode_num_draft_tokens_total`,
  `vllm:spec_decode_num_accepted_tokens_total` and `vllm:spec_decode_num_accepted_tokens_per_pos_total{position}`
  (mean acceptance length = 1 + accepted / drafts, as vLLM's dashboards compute it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

# vLLM's bucket boundaries (seconds)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0)  # e2e and the request phases

LENGTH_BUCKETS = tuple(float(m * 10 ** e) for e in range(7) for m in (1, 2, 5))  # 1 … 5e6 tokens
N_BUCKETS = (1.0, 2.0, 5.0, 10.0, 20.0)  # vLLM's request_params_n
ITERATION_TOKEN_BUCKETS = tuple(float(2 ** i) for i in range(15))  # 1 … 16384 tokens in one step

FINISHED_REASONS = ("stop", "length", "abort")

# every series name as it appears in the exposition (the dashboard test checks its expressions against these)
REQUEST_SERIES = ("vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:request_success_total",
                  "vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
                  "vllm:e2e_request_latency_seconds", "vllm:request_time_per_output_token_seconds",
                  "vllm:request_prompt_tokens", "vllm:request_generation_tokens", "vllm:request_params_n",
                  "vllm:request_params_max_tokens", "vllm:request_max_num_generation_tokens")
ENGINE_SERIES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total",
                 "vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds",
                 "vllm:request_decode_time_seconds", "vllm:request_inference_time_seconds",
                 "vllm:iteration_tokens_total", "vllm:cache_config_info")
SPEC_DECODE_SERIES = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
                      "vllm:spec_decode_num_accepted_tokens", "vllm:spec_decode_num_accepted_tokens_per_pos")
HISTOGRAM_SERIES = ("vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
                    "vllm:e2e_request_latency_seconds", "vllm:request_time_per_output_token_seconds",
                    "vllm:request_prompt_tokens", "vllm:request_generation_tokens", "vllm:request_queue_time_seconds",
                    "vllm:request_prefill_time_seconds", "vllm:request_decode_time_seconds",
                    "vllm:request_inference_time_seconds", "vllm:iteration_tokens_total", "vllm:request_params_n",
                    "vllm:request_params_max_tokens", "vllm:request_max_num_generation_tokens")


def finished_reason(reason: str | None) -> str:
    """A gateway finish reason as vLLM's engine names it ("tool_calls" and the like: "stop")."""
    if reason in ("length", "abort"):
        return reason
    return "stop"


class VllmRequestMetrics:
    """The gateway's request-level `vllm:` series of one served model (label values made at once, so they read 0)."""

    def __init__(self, registry: CollectorRegistry, model_name: str):
        labels = ["model_name"]
        self.model_name = model_name
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.", labels,
                                     registry=registry).labels(model_name)
        self.generation_tokens = Counter("vllm:generation_tokens", "Number of generation tokens processed.", labels,
                                         registry=registry).labels(model_name)
        self.success = Counter("vllm:request_success", "Count of successfully processed requests.",
                               [*labels, "finished_reason"], registry=registry)
        for reason in FINISHED_REASONS:
            self.success.labels(model_name, reason)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              labels, buckets=TTFT_BUCKETS, registry=registry).labels(model_name)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             labels, buckets=ITL_BUCKETS, registry=registry).labels(model_name)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             labels, buckets=REQUEST_LATENCY_BUCKETS, registry=registry).labels(model_name)
        self.tpot = Histogram("vllm:request_time_per_output_token_seconds", "Histogram of time_per_output_token_"
                              "seconds per request.", labels, buckets=ITL_BUCKETS, registry=registry).labels(model_name)
        self.prompt_len = Histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.", labels,
                                    buckets=LENGTH_BUCKETS, registry=registry).labels(model_name)
        self.generation_len = Histogram("vllm:request_generation_tokens", "Number of generation tokens processed.",
                                        labels, buckets=LENGTH_BUCKETS, registry=registry).labels(model_name)
        self.params_n = Histogram("vllm:request_params_n", "Histogram of the n request parameter.", labels,
                                  buckets=N_BUCKETS, registry=registry).labels(model_name)
        self.params_max_tokens = Histogram("vllm:request_params_max_tokens", "Histogram of the max_tokens request "
                                           "parameter.", labels, buckets=LENGTH_BUCKETS,
                                           registry=registry).labels(model_name)
        self.max_generation = Histogram("vllm:request_max_num_generation_tokens", "Histogram of maximum number of "
                                        "requested generation tokens.", labels, buckets=LENGTH_BUCKETS,
                                        registry=registry).labels(model_name)

    def observe(self, reason: str, prompt_tokens: int, generation_tokens: int, start: float, first: float | None,
                last: float | None, num_tokens: int, n: int = 1, max_tokens: int | None = None) -> None:
        """One answered request: its tokens, vLLM finish reason and times (`time.monotonic()`: arrival, first and
        last token; `num_tokens` those of its longest choice), its choices `n` and `max_tokens` (None: not set)."""
        self.params_n.observe(n)
        if max_tokens is not None:
            self.params_max_tokens.observe(max_tokens)
        self.max_generation.observe(num_tokens)
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(generation_tokens)
        self.success.labels(self.model_name, reason).inc()
        self.prompt_len.observe(prompt_tokens)
        self.generation_len.observe(generation_tokens)
        if first is not None:
            self.ttft.observe(max(0.0, first - start))
            if last is not None and num_tokens > 1:
                gap = max(0.0, last - first) / (num_tokens - 1)
                self.tpot.observe(gap)
                for _ in range(num_tokens - 1):
                    self.itl.observe(gap)
        self.e2e.observe(max(0.0, (last if last is not None else first or start) - start))


# -- engine level, read at scrape time -------------------------------------------------------------------------


class BucketCounts(Protocol):
    """A cumulative histogram as an engine keeps it (engine.phase_times.HistogramSnapshot has this shape)."""

    bounds: tuple[float, ...]
    counts: tuple[int, ...]  # per bucket, not cumulative; len(bounds) + 1 (the last: above every bound)
    total: float


class EngineSeries(Protocol):
    """What `VllmEngineCollector` reads (telemetry.metrics.EngineGauges)."""

    running: int
    waiting: int
    kv_usage: float
    prefix_lookup_tokens: int
    prefix_hit_tokens: int
    preemptions: int
    queue_time: BucketCounts | None
    prefill_time: BucketCounts | None
    decode_time: BucketCounts | None
    inference_time: BucketCounts | None
    iteration_tokens: BucketCounts | None
    cache_config: tuple[tuple[str, str], ...]
    spec_num_drafts: int
    spec_num_draft_tokens: int
    spec_num_accepted_tokens: int
    spec_accepted_per_pos: tuple[int, ...]


def histogram_family(name: str, documentation: str, model_name: str, h: BucketCounts) -> HistogramMetricFamily:
    """A cumulative histogram as the family `name` (label `model_name`)."""
    family = HistogramMetricFamily(name, documentation, labels=["model_name"])
    cumulative, buckets = 0, []
    for bound, count in zip((*h.bounds, float("inf")), h.counts):
        cumulative += count
        buckets.append(("+Inf" if bound == float("inf") else repr(float(bound)), cumulative))
    family.add_metric([model_name], buckets, h.total)
    return family


class VllmEngineCollector(Collector):
    """A worker's engine-level `vllm:` series; `read()` returns None until its engine is up (nothing exposed)."""

    def __init__(self, model_name: str, read: Callable[[], EngineSeries | None]):
        self._model = model_name
        self._read = read

    def collect(self) -> Iterator[Metric]:
        g = self._read()
        if g is None:
            return
        m = [self._model]
        for family, value in (
                (GaugeMetricFamily("vllm:num_requests_running", "Number of requests in model execution batches.",
                                   labels=["model_name"]), g.running),
                (GaugeMetricFamily("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                                   labels=["model_name"]), g.waiting),
                (GaugeMetricFamily("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                                   labels=["model_name"]), g.kv_usage),
                (CounterMetricFamily("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of "
                                     "queried tokens.", labels=["model_name"]), g.prefix_lookup_tokens),
                (CounterMetricFamily("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached "
                                     "tokens.", labels=["model_name"]), g.prefix_hit_tokens),
                (CounterMetricFamily("vllm:num_preemptions", "Cumulative number of preemption from the engine.",
                                     labels=["model_name"]), g.preemptions)):
            family.add_metric(m, value)
            yield family
        yield from self._histograms(g)
        if g.cache_config:
            info = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                                     labels=[k for k, _ in g.cache_config])
            info.add_metric([v for _, v in g.cache_config], 1)
            yield info
        if g.spec_accepted_per_pos:
            yield from self._spec_decode(g)

    def _histograms(self, g: EngineSeries) -> Iterator[Metric]:
        for name, what, h in (("vllm:request_queue_time_seconds", "WAITING phase", g.queue_time),
                              ("vllm:request_prefill_time_seconds", "PREFILL phase", g.prefill_time),
                              ("vllm:request_decode_time_seconds", "DECODE phase", g.decode_time),
                              ("vllm:request_inference_time_seconds", "RUNNING phase", g.inference_time)):
            if h is not None:
                yield histogram_family(name, f"Histogram of time spent in {what} for request.", self._model, h)
        if g.iteration_tokens is not None:
            yield histogram_family("vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.",
                                   self._model, g.iteration_tokens)

    def _spec_decode(self, g: EngineSeries) -> Iterator[Metric]:
        m = [self._model]
        for name, doc, value in (("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", g.spec_num_drafts),
                                 ("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.",
                                  g.spec_num_draft_tokens),
                                 ("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.",
                                  g.spec_num_accepted_tokens)):
            family = CounterMetricFamily(name, doc, labels=["model_name"])
            family.add_metric(m, value)
            yield family
        per_pos = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                      "Accepted tokens per draft position.", labels=["model_name", "position"])
        for pos, value in enumerate(g.spec_accepted_per_pos):
            per_pos.add_metric([self._model, str(pos)], value)
        yield per_pos
